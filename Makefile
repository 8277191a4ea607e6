# make install   build .venv (CPU torch first, then the project with its test extras)
# make run       run the whole farm on this host in the foreground (Ctrl-C stops it)
# make test      run the whole test suite, both tiers, as CI does (extra pytest arguments: PYTEST_ARGS="-k cli -x")
# make test-bench the bench's smoke run under pytest (every workload measured and exact); CI runs it after make test
# make test-fast the fast tier only (tests/unit and tests/inprocess, no real stacks; under 90 s)
# make clean     remove build and test leftovers (make distclean also removes .venv)
# make bench     measure local vs null server vs the stack, one table per workload (bench-smoke: ~1 min; BENCH_ARGS="--only small_trace")

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned by setup.cfg too; installing it first, alone, means the
# project install finds the pin satisfied and never pulls a CUDA build.
TORCH := torch==2.13.0
STAMP := $(VENV)/.ndif-celery-installed
PYTEST_ARGS ?=

.PHONY: install run test test-fast test-bench clean distclean

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Redone only when the venv is new or the requirements changed.
$(STAMP): setup.cfg setup.py | $(BIN)/python
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install '$(TORCH)'
	$(BIN)/python -m pip install -e '.[test]'
	touch $@

run: install
	$(BIN)/ndif-celery up

# TEST_WORKERS > 1: that many pytest processes (pytest-xdist) share the modules
# out, a group at a time: a module, or all the tests on one pool of shared stacks
# (each stack starts once per run; tests/support/scheduling.py groups them and orders the
# longest first). Two by default: a third of the suite waits on deadlines,
# restarts and leases, and one process leaves a core idle meanwhile. More than
# two gains nothing on 2 cores: the suite is CPU-bound there, and timing checks
# fail under the load. tools/suite_cpu.py shows where the CPU goes. Why, with
# the measurements: docs/decisions/test-processes.md; wall times per machine:
# docs/performance.md, "The test suite".
TEST_WORKERS ?= 2
XDIST := $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup)

# The bench's smoke run tests bench/, not the farm: it starts stacks of its own
# for a minute, so it is a target of its own (CI runs both).
test: install
	$(BIN)/python -m pytest -q $(XDIST) -m "not bench_smoke" $(PYTEST_ARGS)

test-bench: install
	$(BIN)/python -m pytest -q -m bench_smoke tests/e2e/bench/test_bench_smoke.py $(PYTEST_ARGS)

# The fast tier: tests/unit and tests/inprocess, in the same pytest processes as make test;
# the end-to-end tier (tests/e2e, real stacks) is left out.
test-fast: install
	$(BIN)/python -m pytest -q $(XDIST) tests/unit tests/inprocess $(PYTEST_ARGS)

clean:
	rm -rf build dist *.egg-info .pytest_cache tests/_out
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)

BENCH_ARGS ?=
.PHONY: bench bench-smoke

bench: install
	$(BIN)/python bench/run.py $(BENCH_ARGS)

bench-smoke: install
	$(BIN)/python bench/run.py --smoke $(BENCH_ARGS)
