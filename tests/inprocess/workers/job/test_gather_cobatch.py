"""Gathering a co-batch (``workers.job.gather``) against a real embedded Redis: the
jobs a worker takes out of its model's queue are recorded as its own in the same
step (``queues.take``), so a worker that dies mid-batch loses none of them: the
beat's watchdog rescues every one (``registry.running_jobs``), whether the
worker went silent or restarted under its name. The end-to-end co-batch (real
client, real stack) is tests/test_cobatch_e2e.py.
"""

from __future__ import annotations

import json
import time

import pytest

from ndif_celery import wire
from ndif_celery.celery_app import make_app, queue_for, send_job
from ndif_celery.farm.watchdog import FarmWatchdog
from ndif_celery.state import jobs, queues, registry

MODEL_KEY = 'nnsight.modeling.language.LanguageModel:{"repo_id": "gather/tiny"}'
IDS = [c * 32 for c in "abcd"]


@pytest.fixture
def app(embedded_settings):
    return make_app(embedded_settings)


def _queued(client, app, job_id: str) -> jobs.Job:
    job = jobs.Job(id=job_id, model_key=MODEL_KEY, received_at=time.time())
    client.set(jobs.message_key(job_id), jobs.dumps(job.to_message()))
    client.set(jobs.status_key(job_id), wire.response_json(job_id, wire.QUEUED, ""))
    send_job(app, job)
    return job


def _waiting_ids(client) -> list[str]:
    return [entry.job.id for entry in queues.waiting(client, queue_for(MODEL_KEY))]


def test_taken_jobs_leave_the_queue_and_join_the_workers_entry_in_one_step(redis_client, app):
    for job_id in IDS:
        _queued(redis_client, app, job_id)
    waiting = queues.waiting(redis_client, queue_for(MODEL_KEY))
    # Another worker took the second one first: it is not ours.
    assert queues.remove(redis_client, queue_for(MODEL_KEY), IDS[1]) is not None
    info = {"name": "w@host", "pid": 7, "gpus": [], "current_job": "f" * 32, "batch": ["stale"]}
    taken = queues.take(redis_client, waiting[:3], "w@host", info)
    assert [job.id for job in taken] == [IDS[0], IDS[2]]
    assert _waiting_ids(redis_client) == [IDS[3]]
    entry = registry.all_workers(redis_client)["w@host"]
    assert entry["batch"] == [IDS[0], IDS[2]] and entry["gpus"] == [] and entry["current_job"] == "f" * 32
    assert registry.running_jobs(entry) == ["f" * 32, IDS[0], IDS[2]]
    assert time.time() - entry["last_seen"] < 5
    # Nothing left to take: the entry says so.
    assert queues.take(redis_client, waiting[:1], "w@host", info) == []
    assert registry.all_workers(redis_client)["w@host"]["batch"] == []


def test_a_worker_dead_mid_batch_has_every_job_rescued(redis_client, app, embedded_settings):
    for job_id in IDS[:3]:
        _queued(redis_client, app, job_id)
    waiting = queues.waiting(redis_client, queue_for(MODEL_KEY))
    lead = IDS[0]
    assert queues.remove(redis_client, queue_for(MODEL_KEY), lead)  # the lead: its Celery message was taken
    queues.take(redis_client, waiting[1:], "w@dead", {"name": "w@dead", "pid": 1, "current_job": lead})
    assert _waiting_ids(redis_client) == []
    stale = dict(registry.all_workers(redis_client)["w@dead"], last_seen=time.time() - registry.STALE_S - 1)
    redis_client.hset(registry.WORKERS, "w@dead", json.dumps(stale))
    FarmWatchdog(embedded_settings, redis_client, app, name="test-watchdog").tick()
    again = queues.waiting(redis_client, queue_for(MODEL_KEY))
    assert sorted(entry.job.id for entry in again) == sorted(IDS[:3])
    assert all(entry.job.attempt == 2 for entry in again)


def test_a_worker_restarted_mid_batch_hands_every_job_over(redis_client, app, embedded_settings):
    for job_id in IDS[:2]:
        _queued(redis_client, app, job_id)
    waiting = queues.waiting(redis_client, queue_for(MODEL_KEY))
    queues.take(redis_client, waiting[1:], "cpu@host", {"name": "cpu@host", "pid": 100, "current_job": IDS[0]})
    queues.remove(redis_client, queue_for(MODEL_KEY), IDS[0])
    registry.take_over(redis_client, "cpu@host", 200)
    assert {k.decode() for k in redis_client.hkeys(registry.ORPHANS)} == set(IDS[:2])
    FarmWatchdog(embedded_settings, redis_client, app, name="test-watchdog").tick()
    assert sorted(_waiting_ids(redis_client)) == sorted(IDS[:2])
