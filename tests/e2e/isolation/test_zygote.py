"""NDIF_ISOLATION=zygote: untrusted children forked by a clean per-model process.

The attacks of tests/e2e/isolation/test_security.py and every conformance case run on this
mode too (the ``zygote`` stack); here: the zygote process itself. The weight
sharing underneath it and the keyed check of the GPU path are
tests/inprocess/workers/isolation/test_zygote.py.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.support.stacks.stack_pool import SECRETS
from tests.support.cases.tiny_model import PROMPT

pytestmark = pytest.mark.pools("zygote")


# --- the zygote process on a real stack --------------------------------------------


@pytest.fixture(scope="module")
def zygote_stack(stack_pool):
    import nnsight

    stack = stack_pool.get("zygote")
    saved = nnsight.CONFIG.API.HOST
    nnsight.CONFIG.API.HOST = stack.url
    yield stack
    nnsight.CONFIG.API.HOST = saved


def worker_pid(stack) -> int:
    (info,) = stack.farm()["cluster"]["workers"].values()
    return info["pid"]


def zygotes_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
            status = open(f"/proc/{entry}/status").read()
        except OSError:
            continue
        ppid = int(status.split("PPid:")[1].split()[0])
        if b"workers.isolation.zygote" in cmdline and ppid == pid:
            found.append(int(entry))
    return found


def trace_matches_local(model) -> dict:
    with model.trace(PROMPT, remote=True) as tracer:
        remote = model.transformer.h[2].output.save()
    with model.trace(PROMPT):
        local = model.transformer.h[2].output.save()
    assert torch.equal(remote, local)
    return tracer.backend.meta


def test_the_zygote_holds_no_secrets_and_serves(zygote_stack, model):
    meta = trace_matches_local(model)
    assert meta["isolation"] == "zygote" and meta["isolated"] is True
    (zygote,) = zygotes_of(worker_pid(zygote_stack))
    environ = open(f"/proc/{zygote}/environ", "rb").read()
    worker_environ = open(f"/proc/{worker_pid(zygote_stack)}/environ", "rb").read()
    for name, secret in SECRETS.items():
        assert secret.encode() in worker_environ, f"the test stack was expected to give the worker {name}"
        assert secret.encode() not in environ, f"{name} reached the zygote"
    assert b"NDIF_REDIS_URL" not in environ and b"NDIF_DATABASE_URL" not in environ


def test_a_dead_zygote_is_replaced_and_the_next_job_is_right(zygote_stack, model):
    trace_matches_local(model)
    pid = worker_pid(zygote_stack)
    (zygote,) = zygotes_of(pid)
    os.kill(zygote, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while zygote in zygotes_of(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    meta = trace_matches_local(model)  # a fresh zygote, started for this job
    assert meta["isolation"] == "zygote"
    (replacement,) = zygotes_of(pid)
    assert replacement != zygote
    assert worker_pid(zygote_stack) == pid, "the worker was replaced"
    trace_matches_local(model)
