"""The delivery thread (``workers.job.deliveries``), on the worker's own job
function in the test process (the fixtures: tests/inprocess/workers/conftest.py).

The next job runs while a result is being stored; meanwhile the job is still
this worker's in its registry entry (a dead worker's job is rescued), and
``ndif-celery kill`` answers it once.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from ndif_celery import wire
from ndif_celery.celery_app import make_app, queue_for
from ndif_celery.farm.watchdog import FarmWatchdog
from ndif_celery.state import jobs, queues, registry
from tests.support.cases.worker_jobs import delivered, handed_by_celery, latest, logits, result, submit


class GatedStore:
    """The worker's real store, whose ``put`` waits until the test opens the gate."""

    def __init__(self, store) -> None:
        self.store = store
        self.entered = threading.Event()
        self.gate = threading.Event()

    def put(self, key, data):
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return self.store.put(key, data)

    def __getattr__(self, name):
        return getattr(self.store, name)


@pytest.fixture
def gated(worker):
    real = worker.store
    worker.store = GatedStore(real)
    try:
        yield worker.store
    finally:
        worker.store.gate.set()
        delivered(worker)
        worker.store = real


def test_the_next_job_runs_while_a_result_is_being_stored(worker, web, redis, client_lm, reference, gated):
    first = submit(web, logits, client_lm)
    second = submit(web, logits, client_lm)
    runner = threading.Thread(target=worker.run, args=(handed_by_celery(redis, first),), daemon=True)
    runner.start()
    assert gated.entered.wait(30)
    # The first job's result is held at the store; the second one runs meanwhile.
    deadline = time.monotonic() + 30
    while latest(redis, second)["status"] != wire.RUNNING and time.monotonic() < deadline:
        time.sleep(0.01)
    assert latest(redis, second)["status"] == wire.RUNNING
    assert latest(redis, first)["status"] == wire.RUNNING, "not answered before its result is stored"
    entry = json.loads(redis.hget(registry.WORKERS, worker.name))
    assert first in registry.running_jobs(entry), "still this worker's while delivered"
    gated.gate.set()
    runner.join(60)
    delivered(worker)
    assert torch.equal(result(worker, redis, first)["out"], reference)
    assert torch.equal(result(worker, redis, second)["out"], reference)


def test_a_kill_of_a_job_being_delivered_answers_it_once(worker, web, redis, client_lm, gated):
    job_id = submit(web, logits, client_lm)
    runner = threading.Thread(target=worker.run, args=(handed_by_celery(redis, job_id),), daemon=True)
    runner.start()
    assert gated.entered.wait(30)
    assert worker.cancel(job_id), "the worker answers a kill of a job it delivers"
    status = latest(redis, job_id)
    assert status["status"] == wire.ERROR and "cancelled" in status["description"].lower()
    gated.gate.set()
    runner.join(60)
    delivered(worker)
    assert latest(redis, job_id)["status"] == wire.ERROR, "its COMPLETED came second: dropped"


def test_a_worker_dead_while_delivering_has_the_job_rescued(redis, settings):
    """A job in a dead worker's ``delivering`` is run again (the beat's watchdog)."""
    job = jobs.Job(id="d" * 32, model_key="m", received_at=time.time())
    redis.set(jobs.message_key(job.id), jobs.dumps(job.to_message()))
    redis.set(jobs.status_key(job.id), wire.response_json(job.id, wire.RUNNING, ""))
    redis.hset(registry.WORKERS, "w@dead", json.dumps({"name": "w@dead", "pid": 1, "current_job": None, "batch": [],
                                                       "delivering": [job.id],
                                                       "last_seen": time.time() - registry.STALE_S - 1}))
    FarmWatchdog(settings, redis, make_app(settings), name="test-watchdog").tick()
    assert [e.job.id for e in queues.waiting(redis, queue_for("m"))] == [job.id]
