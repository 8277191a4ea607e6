"""``ndif-celery up`` keeps a one-worker farm alive: its supervisor restarts a killed service, and no accepted job is lost.

End to end, against a stack started by ``up --detach`` (so its supervisor is the
forked copy of ``up`` that stays) and the real nnsight client: the worker, the
web and the embedded Redis are each killed with ``kill -9`` while jobs run and
wait; each comes back within 30 s, no accepted job is lost (the worker's job
is re-run by the beat's watchdog, which does not need a surviving worker), and
the next request works. ``ndif-celery status`` shows the restart and its
reason. The backoff rules themselves are tests/unit/ndif_celery/host/test_supervisor.py (fast tier).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.support import pace
from tests.support.clients.remote import blocking_client_in_background, final_status, poll, slow_job, wait_status
from tests.support.stacks.stack import client_on_stack
from tests.support.cases.tiny_model import PROMPT, build_tiny_gpt2, client_model

REPO = "supervision/tiny"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, hf_home):
    build_tiny_gpt2(hf_home, REPO, n_layer=2, seed=44)
    # Cold: the services' own processes, killed and restarted, are what these tests prove.
    with client_on_stack(tmp_path_factory.mktemp("supervision"), hf_home, warm=False) as stack:
        yield stack


def _local(model, layer: int = 1):
    with model.trace(PROMPT):
        out = model.transformer.h[layer].output.save()
    return out


def _remote(model, layer: int = 1):
    with model.trace(PROMPT, remote=True):
        out = model.transformer.h[layer].output.save()
    return out


def _restarted(stack, service: str, old_pid: int, timeout_s: float = 30) -> float:
    """Seconds until the supervisor recorded a new pid for ``service``."""
    started = time.monotonic()
    while stack.pids().get(service) in (None, old_pid):
        assert time.monotonic() - started < pace.bound(timeout_s), f"{service} was not restarted within {timeout_s} s\n{stack.logs()}"
        time.sleep(0.1)
    return time.monotonic() - started


def _status_line(stack, service: str) -> str:
    out = stack.cli("status", check=True).stdout
    return next(line for line in out.splitlines() if line.split() and line.split()[0] == service)


def test_a_killed_worker_comes_back_and_its_job_is_not_lost(stack):
    model = client_model(REPO)
    local = _local(model)
    assert torch.equal(_remote(model), local)  # deployed on the one worker
    backend = slow_job(model, 100, layer=1)  # 5 s: long enough to be killed in the middle
    wait_status(stack.url, backend.job_id, "RUNNING")
    old = stack.pids()["worker"]
    os.kill(old, signal.SIGKILL)
    killed = time.monotonic()

    latest = final_status(stack.url, backend.job_id, timeout_s=60)
    took = time.monotonic() - killed
    print(f"\nworker kill -9 -> job {latest['status']} after {took:.1f} s (load {os.getloadavg()[0]:.1f})")
    assert took < pace.bound(30), f"the lost job took {took:.0f} s to end: {latest}"
    if latest["status"] == "COMPLETED":  # re-run once, on the restarted worker
        assert torch.equal(poll(backend)["out"], local)
    else:
        assert "worker" in latest["description"] and "lost" in latest["description"], latest
    assert time.monotonic() - killed < pace.bound(30 + 1)  # the worker is back (it ran the job, or registers now)
    deadline = time.monotonic() + 30
    while not stack.farm()["cluster"]["workers"]:
        assert time.monotonic() < deadline, "no worker registered within 30 s of the kill"
        time.sleep(0.2)
    assert stack.pids()["worker"] != old
    line = _status_line(stack, "worker")
    assert "restarts 1" in line and "killed by SIGKILL" in line, line
    assert "worker (pid" in (stack.logs_dir / "supervisor.log").read_text()
    assert torch.equal(_remote(model), local)  # the next request works


def test_a_killed_web_comes_back_and_loses_no_non_blocking_job(stack):
    model = client_model(REPO)
    running = slow_job(model, 60, layer=1)
    wait_status(stack.url, running.job_id, "RUNNING")
    queued = [slow_job(model, 1, layer=0) for _ in range(2)]
    client, _ = blocking_client_in_background(lambda: _remote(model))
    time.sleep(1.0)  # waiting on its websocket now
    old = stack.pids()["web"]
    os.killpg(old, signal.SIGKILL)  # the gunicorn master and its workers
    killed = time.monotonic()
    client.join(timeout=30)
    assert not client.is_alive(), "a blocking client hung when the web died"
    back = _restarted(stack, "web", old)
    stack.wait_answers(timeout_s=30)
    print(f"\nweb kill -9 -> restarted after {back:.1f} s, answering after {time.monotonic() - killed:.1f} s")
    assert torch.equal(poll(running, timeout_s=60)["out"], _local(model, 1))
    for backend in queued:
        assert torch.equal(poll(backend, timeout_s=60)["out"], _local(model, 0))
    assert "restarts 1" in _status_line(stack, "web")
    assert torch.equal(_remote(model), _local(model))


def test_a_killed_redis_comes_back_and_loses_no_accepted_job(stack):
    """``kill -9``, not a clean stop: what the append-only file (fsynced every
    second) holds a second after the jobs were accepted is all there is."""
    model = client_model(REPO)
    running = slow_job(model, 60, layer=1)
    wait_status(stack.url, running.job_id, "RUNNING")
    queued = [slow_job(model, 0, layer=layer) for layer in (0, 1)]
    time.sleep(1.5)  # the AOF's fsync (every second) has the accepted jobs
    old = stack.pids()["redis"]
    os.kill(old, signal.SIGKILL)
    back = _restarted(stack, "redis", old)
    stack.wait_answers(timeout_s=30)
    print(f"\nredis kill -9 -> restarted after {back:.1f} s")
    for backend, layer in zip([running, *queued], (1, 0, 1)):
        assert torch.equal(poll(backend, timeout_s=90)["out"], _local(model, layer)), backend.job_id
    assert "killed by SIGKILL" in _status_line(stack, "redis")
    assert torch.equal(_remote(model), _local(model))
