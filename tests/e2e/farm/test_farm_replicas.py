"""Replicas follow the queue: a second worker takes on a model whose jobs wait
too long, and gives it up again once it sits idle."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.support.clients.remote import slow_job
from tests.support.stacks.stack import client_on_stack
from tests.support.cases.tiny_model import build_tiny_gpt2, client_model

REPO = "farm/replicated"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, hf_home):
    build_tiny_gpt2(hf_home, REPO, n_layer=2, seed=30)
    env = {
        "NDIF_WORKER_NAME": "gpu0@replicas", "NDIF_WORKER_GPUS": "0", "NDIF_WORKER_MEMORY_GIB": "1",
        "NDIF_REPLICA_WAIT_S": "1", "NDIF_AUTOSCALE_BACKOFF_S": "1", "NDIF_REPLICA_IDLE_S": "4",
        # One job at a time, so the slow jobs wait in the queue: co-batching would
        # take all eight into one batch, and no queue pressure would be left.
        "NDIF_COBATCH_MAX": "1",
    }
    with client_on_stack(tmp_path_factory.mktemp("replicas"), hf_home, env, [("gpu1@replicas", "1", 1)]) as stack:
        yield stack


def _replicas(stack) -> set:
    return {
        e["worker"] for e in stack.farm()["deployments"].values()
        if e["repo_id"] == REPO and e.get("application_state") == "RUNNING"
    }


def test_a_replica_is_added_under_queue_pressure_and_removed_when_idle(stack):
    model = client_model(REPO)
    # 2 s each: 16 s of work for one worker. With 0.75 s each, at load the
    # first worker had drained the queue before the replica's model was loaded.
    backends = [slow_job(model, 40) for _ in range(8)]
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
