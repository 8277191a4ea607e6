"""Replicas follow the queue: a second worker takes on a model whose jobs wait
too long, and gives it up again once it sits idle."""

from __future__ import annotations

import time

import httpx
import nnsight
import pytest

from tests.stack import Stack
from tests.tiny_model import PROMPT, build_tiny_gpt2, client_model

REPO = "farm/replicated"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, hf_home):
    build_tiny_gpt2(hf_home, REPO, n_layer=2, seed=30)
    stack = Stack(
        tmp_path_factory.mktemp("replicas"),
        env={
            "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "NDIF_WORKER_NAME": "gpu0@replicas", "NDIF_WORKER_GPUS": "0", "NDIF_WORKER_MEMORY_GIB": "1",
            "NDIF_REPLICA_WAIT_S": "1", "NDIF_AUTOSCALE_BACKOFF_S": "1", "NDIF_REPLICA_IDLE_S": "4",
        },
    )
    stack.start()
    try:
        stack.add_worker("gpu1@replicas", gpus="1", memory_gib=1)
        saved = nnsight.CONFIG.API.HOST
        nnsight.CONFIG.API.HOST = stack.url
        yield stack
    finally:
        nnsight.CONFIG.API.HOST = saved
        stack.stop()


def _replicas(stack) -> set:
    return {
        e["worker"] for e in stack.farm()["deployments"].values()
        if e["repo_id"] == REPO and e.get("application_state") == "RUNNING"
    }


def _slow_job(model):
    with model.trace(PROMPT, remote=True, blocking=False) as tracer:
        out = model.transformer.h[0].output.save()  # noqa: F841
        for _ in range(15):
            time.sleep(0.05)
    return tracer.backend


def test_a_replica_is_added_under_queue_pressure_and_removed_when_idle(stack):
    model = client_model(REPO)
    backends = [_slow_job(model) for _ in range(8)]
    most = set()
    deadline = time.monotonic() + 90
    pending = list(backends)
    while pending and time.monotonic() < deadline:
        most = max(most, _replicas(stack), key=len)
        pending = [b for b in pending if b() is None]
        time.sleep(0.1)
    assert not pending, "jobs did not finish"
    assert most == {"gpu0@replicas", "gpu1@replicas"}, "no replica was added while jobs waited"
    served = {httpx.get(f"{stack.url}/response/{b.job_id}").json()["meta"]["worker"] for b in backends}
    assert served == {"gpu0@replicas", "gpu1@replicas"}, "the replica took no jobs"

    # Idle: back to one replica (never zero), within the idle time and a few ticks.
    deadline = time.monotonic() + 30
    while len(_replicas(stack)) > 1:
        assert time.monotonic() < deadline, "the idle replica was not removed"
        time.sleep(0.5)
    time.sleep(2)
    assert len(_replicas(stack)) == 1
