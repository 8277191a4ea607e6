"""Shared test setup: an offline Hugging Face cache holding the tiny GPT-2.

At import time (before anything imports transformers / huggingface_hub, which
read these variables once, at their own import):

* ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1`` (the hub is unreachable;
  without them loading sits in retry backoff for minutes);
* ``HF_HOME`` = ``tests/_out/hf`` (gitignored), unless ``HF_HOME`` already points
  at a folder holding the tiny model;
* the tiny model is built there once (`tiny_model.build_tiny_gpt2` is idempotent
  and safe against concurrent builders).

Fixtures: ``hf_home`` (the folder), ``tiny_model_factory`` (build more tiny
models under it), ``model`` (the shared client model on ``REPO_ID``).
Constants (``PROMPT``, ``HIDDEN``, ``VOCAB``, ``N_LAYER``, ``REPO_ID``) live in
``tiny_model`` and are re-exported here and by ``conformance``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
OUT_DIR = TESTS_DIR / "_out"

# `import tiny_model` / `conformance` and `from tests.x import ...` both work.
for _path in (TESTS_DIR, TESTS_DIR.parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from tiny_model import (  # noqa: E402
    HIDDEN,
    N_LAYER,
    PROMPT,
    PROMPTS,
    REPO_ID,
    VOCAB,
    build_tiny_gpt2,
    client_model,
    snapshot_dir,
)

__all__ = ["HIDDEN", "N_LAYER", "PROMPT", "PROMPTS", "REPO_ID", "VOCAB"]


def _configure_offline_hf() -> Path:
    """Point the HF libraries at a local cache and forbid network access."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    preset = os.environ.get("HF_HOME")
    if preset and snapshot_dir(Path(preset), REPO_ID) is not None:
        hf_home = Path(preset)
    else:
        hf_home = OUT_DIR / "hf"
        os.environ["HF_HOME"] = str(hf_home)

    # huggingface_hub freezes its cache path and offline flag at import.
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None and (
        Path(constants.HF_HUB_CACHE).resolve() != (hf_home / "hub").resolve()
        or not constants.HF_HUB_OFFLINE
    ):
        raise RuntimeError(
            "huggingface_hub was imported before tests/conftest.py could set "
            f"HF_HOME={hf_home} and HF_HUB_OFFLINE=1; set them in the environment "
            "instead (e.g. HF_HOME=tests/_out/hf HF_HUB_OFFLINE=1 pytest ...)."
        )
    return hf_home


HF_HOME = _configure_offline_hf()
build_tiny_gpt2(HF_HOME, REPO_ID)


@pytest.fixture(scope="session")
def hf_home() -> Path:
    """The offline HF cache folder (``$HF_HOME``) the tiny models live in."""
    return HF_HOME


@pytest.fixture(scope="session")
def tiny_model_factory(hf_home):
    """``make(repo_id, **sizes) -> snapshot dir``: build another tiny model once."""

    def make(repo_id: str, **kwargs) -> Path:
        return build_tiny_gpt2(hf_home, repo_id, **kwargs)

    return make


@pytest.fixture(scope="session")
def model():
    """The shared nnsight client model (``TransformersModel``) on ``REPO_ID``."""
    return client_model(REPO_ID)


# --- the real stack ---------------------------------------------------------------


@pytest.fixture(scope="session")
def stack_pool(tmp_path_factory, hf_home):
    """Real stacks (redis, gunicorn web, celery worker, flower) started through
    the CLI on first use, one per kind, stopped at the end of the session."""
    from tests.stack_pool import StackPool

    pool = StackPool(
        tmp_path_factory.mktemp("stacks"),
        {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def fs_stack(stack_pool):
    return stack_pool.get("fs")


@pytest.fixture
def on_fs_stack(fs_stack):
    """The client pointed at the default stack (inline results, filesystem store)."""
    from tests.remote import client_pointed_at

    with client_pointed_at(fs_stack.url):
        yield fs_stack


def _variant_params():
    from tests.remote import VARIANTS

    return [pytest.param(v, id=v.id) for v in VARIANTS]


@pytest.fixture(scope="session", params=_variant_params())
def variant(request, stack_pool):
    """One way of reaching the farm; the client is pointed at its stack."""
    v = request.param
    stack = stack_pool.get(v.stack)
    from tests.remote import client_pointed_at

    with client_pointed_at(stack.url, compress=v.compress):
        yield v


@pytest.fixture
def stack_for_variant(variant, stack_pool):
    return stack_pool.get(variant.stack)


# --- an embedded Redis for the fast tier's in-process tests ------------------------


@pytest.fixture(scope="module")
def embedded_settings(tmp_path_factory, request):
    """Settings of a real embedded redis-server of this module's own
    (``tests.servers.embedded_redis``): the fast tier's in-process tests (the
    intake, the watchdogs) drive the real code against a real Redis."""
    from tests.servers import embedded_redis

    with embedded_redis(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])) as settings:
        yield settings


@pytest.fixture
def redis_client(embedded_settings):
    """A client of the module's embedded Redis, emptied before each test."""
    import redis

    client = redis.Redis.from_url(embedded_settings.redis_url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def local_results(model, tmp_path_factory):
    """``results(case)``: what a conformance case gives run locally, computed once."""
    cache = {}

    def results(case):
        if case not in cache:
            cache[case] = case(model, lambda m: {}, tmp_path_factory.mktemp("local"))
        return cache[case]

    return results


# --- test tiers ----------------------------------------------------------------------
#
# Two tiers, one marker: `e2e` is every test that starts a real multi-process
# stack (embedded Redis + gunicorn + Celery worker + Flower) or another real
# server process (moto, a PostgreSQL proxy, chromium, honcho). Everything else
# is the fast tier (`make test-fast`, `pytest -m "not e2e"`): unit tests and
# in-process integration (Flask's test client, an embedded Redis, the worker's
# job function called directly). A test is e2e when any of these holds:
#
# * it uses (directly or through another fixture) one of E2E_FIXTURES: the
#   shared stacks of tests/stack_pool.py and tests/jail_fixtures.py, and the
#   module-level fixtures that start their own Stack or server;
# * its module is in E2E_MODULES (every test of it drives a stack);
# * it carries ``@pytest.mark.e2e`` itself (it starts a stack in its body).
#
# A fast-tier test that starts a stack or moto anyway fails at once, naming this
# fix (``tests.servers.refuse_in_fast_tier``), so the fast tier stays fast.

E2E_FIXTURES = frozenset({
    # tests/stack_pool.py and the fixtures above
    "stack_pool", "fs_stack", "on_fs_stack", "variant", "stack_for_variant",
    # tests/jail_fixtures.py
    "jail", "worker_pid", "still_serving_after",
    # module fixtures that start a Stack (test_cli, test_doctor, test_limits,
    # test_auth*, test_expiry, test_farm*, test_reliability, test_outages,
    # test_model_policy, test_integrity) or a server process (moto, chromium)
    "stack", "farm", "auth_stack", "listed_stack", "verifying_stack", "moto", "s3", "chromium",
})

E2E_MODULES = frozenset({
    "test_auth", "test_bench_smoke", "test_capacity", "test_conformance_remote", "test_dashboard", "test_e2e_api",
    "test_expiry", "test_farm", "test_farm_replicas", "test_jail_required", "test_limits", "test_load",
    "test_many_requests", "test_outages", "test_reliability", "test_deadlines", "test_operations", "test_multi_host",
})


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures: a fast-tier test that starts a stack or a
    server process fails, naming the fix (``tests.servers.refuse_in_fast_tier``)."""
    from tests import servers

    servers.FAST_TIER_TEST = "" if item.get_closest_marker("e2e") else item.nodeid


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _module(item) in E2E_MODULES or E2E_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.e2e)
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_module(item), len(rank)))  # stable: a module's own order is kept


def _module(item) -> str:
    return item.module.__name__.rpartition(".")[2] if item.module else ""


# --- order: the longest modules first ----------------------------------------------
#
# ``make test`` shares the modules out among pytest-xdist processes (``--dist
# loadscope``: a module at a time, in collection order). A long module picked
# last runs alone at the end while the other processes idle, so the longest
# go first. Ranked by their time in a full two-process run (test_deadlines,
# about 2.5 minutes, first); a module not listed keeps its place after them.

LONGEST_FIRST = (
    "test_deadlines", "test_bench_smoke", "test_conformance_remote", "test_security", "test_multi_host",
    "test_cobatch_e2e", "test_auth_defaults", "test_operations", "test_capacity", "test_auth", "test_reliability",
    "test_farm", "test_security_channels", "test_cli", "test_doctor", "test_model_policy", "test_supervision",
    "test_ledger", "test_limits", "test_conformance_local", "test_integrity", "test_jail_required", "test_expiry",
    "test_farm_replicas", "test_e2e_api", "test_dashboard", "test_outages", "test_cobatch",
)

