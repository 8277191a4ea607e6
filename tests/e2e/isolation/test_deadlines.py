"""Deadlines that always fire, and ``ndif-celery kill`` by the same road.

User code blocked where no Python exception reaches it (``time.sleep(600)``,
libc's ``sleep`` through ctypes, a ``read`` on a pipe nobody writes) used to
hold its client and the model's worker until it returned. Now the worker's
watchdog (``workers.job.deadline``) sends the ERROR at the limit itself, then
interrupts the job; a trusted job stuck in C makes the worker replace itself
(exit 75, restarted at once by ``up``'s supervisor, the model loaded again).
Isolated jobs are killed with their child. Each case, with the real client
against real stacks: the ERROR names the limit within timeout + 5 s, and the
next request on the same model is exactly right.
"""

from __future__ import annotations

import ctypes
import os
import time

import httpx
import nnsight
import pytest
import torch
from nnsight.intervention.backends.remote import RemoteError

from tests.support import pace
from tests.support.clients.remote import client_pointed_at, kill_stuck, poll
from tests.support.stacks.stack import client_on_stack
from tests.support.stacks.stack_pool import JAIL_TIMEOUT_S
from tests.support.cases.tiny_model import PROMPT

pytestmark = pytest.mark.pools("isolated", "zygote")

nnsight.register(__name__)  # the blocking helpers below run inside remote blocks

# 8, not 4: a kill test's ``ndif-celery kill`` must find its job still running,
# and at load 5 the CLI's interpreter start alone took over 3 s (with 4 s and a
# 2 s grace the watchdog had ended the job first).
TIMEOUT_S = 8
GRACE_S = 2


def sleep_in_python():
    time.sleep(600)


def sleep_in_c():
    ctypes.CDLL(None).sleep(600)  # libc: no Python instruction for 10 minutes


def read_a_silent_pipe():
    read, _write = os.pipe()
    os.read(read, 1)


def hold_the_gil_in_c():
    # libc's sleep through PyDLL, which keeps the GIL for the call: no other thread of the
    # process runs until it returns, as in a long C loop (sum(range(10**15))), without
    # burning a core for the deadline, grace and backstop (15 s a case).
    ctypes.PyDLL(None).sleep(600)


BLOCKS = {"time.sleep": sleep_in_python, "libc sleep": sleep_in_c, "pipe read": read_a_silent_pipe,
          "C call holding the GIL": hold_the_gil_in_c}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, hf_home):
    """Trusted requests (auth off), a short deadline and grace, under ``up``'s supervisor."""
    env = {"NDIF_EXECUTION_TIMEOUT_S": str(TIMEOUT_S), "NDIF_DEADLINE_GRACE_S": str(GRACE_S)}
    # Cold: a worker that replaces itself, and its exit status, are what these tests prove.
    with client_on_stack(tmp_path_factory.mktemp("deadlines"), hf_home, env, warm=False) as stack:
        yield stack


@pytest.fixture(params=["isolated", "zygote"])
def isolated(stack_pool, request):
    """The pooled untrusted stacks: NDIF_ISOLATION=fork and =zygote."""
    stack = stack_pool.get(request.param)
    with client_pointed_at(stack.url):
        yield stack


def _right(model, layer: int = 1):
    """The next request on the model is exactly the local answer; its meta."""
    with model.trace(PROMPT, remote=True) as tracer:
        remote = model.transformer.h[layer].output.save()
    with model.trace(PROMPT):
        local = model.transformer.h[layer].output.save()
    assert torch.equal(remote, local)
    return tracer.backend.meta


def _stuck(model, block, timeout_s: float) -> tuple[float, str]:
    """A blocking request whose block never returns: seconds to its ERROR, and the ERROR."""
    started = time.monotonic()
    with pytest.raises(RemoteError) as raised:
        with model.trace(PROMPT, remote=True):
            out = model.transformer.h[0].output.save()  # noqa: F841
            block()
    return time.monotonic() - started, str(raised.value)


def _worker_pid(stack) -> int:
    (info,) = stack.farm()["cluster"]["workers"].values()
    return info["pid"]


def _replaced(stack, old_pid: int, block=None) -> None:
    """The worker replaced itself: a new pid, its log line, the supervisor's reason, the metric.

    A block that holds the GIL leaves no Python to do that: the process's
    C-level backstop (``deadline.backstop``) dumps its threads' stacks to the
    log and exits with status 1, and the supervisor restarts it."""
    log = (stack.logs_dir / "worker.log").read_text(errors="replace")
    assert _worker_pid(stack) != old_pid
    status = stack.cli("status", check=True).stdout
    if block is hold_the_gil_in_c:
        assert "Timeout (" in log and "hold_the_gil_in_c" in log, log[-3000:]
        assert "exited with status 1" in status, status
        return
    assert "replacing this worker: job" in log and "did not unwind" in log, log[-3000:]
    assert "replaced itself" in status, status
    metrics = httpx.get(f"{stack.url}/metrics", timeout=10).text
    assert "ndif_worker_replacements_total{worker=" in metrics, metrics[-2000:]


# Two of the four blocks on the trusted stack, one per road out: a block that
# released the GIL (libc's sleep; time.sleep and the pipe read wait in a system
# call the same way) leaves the watchdog to send the ERROR and the worker to
# replace itself; one that holds it leaves only the C-level backstop. Each costs
# a worker restart and a model load; all four blocks run on the zygote stack below.
@pytest.mark.parametrize("name", ["libc sleep", "C call holding the GIL"])
def test_a_trusted_block_stuck_in_c_gets_its_error_at_the_limit(stack, model, name):
    _right(model)  # deployed, and the worker ready (after any earlier replacement)
    pid = _worker_pid(stack)
    took, error = _stuck(model, BLOCKS[name], TIMEOUT_S)
    assert f"exceeded the execution timeout of {TIMEOUT_S}s" in error, error
    assert took < TIMEOUT_S + pace.bound(5), f"{name}: the ERROR took {took:.1f} s"
    meta = _right(model)  # waits for the fresh worker and its model
    assert meta["isolated"] is False
    _replaced(stack, pid, BLOCKS[name])


def test_a_trusted_block_that_unwinds_keeps_its_worker(stack, model):
    """A Python loop past the limit unwinds from the interruption: ERROR at the
    limit, one final status only, and the same worker serves the next request."""
    _right(model)
    pid = _worker_pid(stack)
    started = time.monotonic()
    with pytest.raises(RemoteError, match=f"exceeded the execution timeout of {TIMEOUT_S}s"):
        with model.trace(PROMPT, remote=True, blocking=False) as tracer:
            out = model.transformer.h[0].output.save()  # noqa: F841
            for _ in range(400):
                time.sleep(0.05)
        poll(tracer.backend, timeout_s=30)
    assert time.monotonic() - started < TIMEOUT_S + pace.bound(5)
    _right(model)
    assert _worker_pid(stack) == pid, "a job that unwound made its worker replace itself"


def test_an_operator_kill_of_a_trusted_job_stuck_in_c(stack, model):
    _right(model)
    pid = _worker_pid(stack)
    kill_stuck(stack, model, sleep_in_c)
    _right(model)
    _replaced(stack, pid)


def test_an_operator_kill_of_a_trusted_job_holding_the_gil(stack, model):
    """Its worker cannot even reply: ``kill`` answers the client itself, and the
    worker's backstop restarts it at the job's deadline (grace and margin after)."""
    _right(model)
    pid = _worker_pid(stack)
    kill_stuck(stack, model, hold_the_gil_in_c, said="did not reply")
    _right(model)
    _replaced(stack, pid, hold_the_gil_in_c)


# The four blocks on the zygote stack only (the default mode; each waits out
# the deadline, 10 s): in both modes the child is forked by its model's zygote
# and timed and killed by the same isolate.run, so what the child is stuck in
# does not depend on how the zygote came to be. The fork mode's deadline is
# shown by the attacks that wait it out in both modes: a Python spin
# (test_security) and a sleep in C with every fd closed (test_security_channels).
@pytest.mark.parametrize("name", list(BLOCKS))
def test_an_isolated_block_stuck_in_c_gets_its_error_at_the_limit(stack_pool, model, name):
    isolated = stack_pool.get("zygote")
    with client_pointed_at(isolated.url):
        _right(model)
        took, error = _stuck(model, BLOCKS[name], JAIL_TIMEOUT_S)
        meta = _right(model)
    assert f"exceeded the execution timeout of {JAIL_TIMEOUT_S}s" in error, error
    assert took < JAIL_TIMEOUT_S + pace.bound(5), f"{name}: the ERROR took {took:.1f} s"
    assert meta["isolated"] is True and meta["isolation"] == "zygote"


def test_an_operator_kill_of_an_isolated_job_stuck_in_c(isolated, model):
    _right(model)
    kill_stuck(isolated, model, read_a_silent_pipe)
    assert _right(model)["isolated"] is True
