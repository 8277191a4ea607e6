"""The beat's watchdog (``ndif_celery.farm.watchdog``) against a real embedded Redis,
ticked by hand: a dead worker's job is sent again exactly once, then ended with
ERROR; a worker restarted under its own name hands its predecessor's job over;
jobs waiting for a model nobody serves are told so once per change; two
watchdogs never both act. The end-to-end story (a real worker ``kill -9``ed
under ``up``'s supervisor) is tests/e2e/host/test_supervision.py.
"""

from __future__ import annotations

import json
import time

import pytest

from ndif_celery import messages, wire
from ndif_celery.celery_app import make_app, queue_for
from ndif_celery.farm import watchdog as watchdog_module
from ndif_celery.farm.watchdog import FarmWatchdog, unserved_key
from ndif_celery.state import jobs, queues, registry

MODEL_KEY = 'nnsight.modeling.language.LanguageModel:{"repo_id": "watchdog/tiny"}'


@pytest.fixture(scope="module")
def settings(embedded_settings):
    return embedded_settings


@pytest.fixture
def client(redis_client):
    return redis_client


@pytest.fixture
def watchdog(settings, client):
    return FarmWatchdog(settings, client, make_app(settings), name="test-watchdog")


def _job(client, job_id: str, attempt: int = 1) -> jobs.Job:
    job = jobs.Job(id=job_id, model_key=MODEL_KEY, received_at=time.time(), attempt=attempt)
    client.set(jobs.message_key(job_id), jobs.dumps(job.to_message()))
    client.set(jobs.status_key(job_id), wire.response_json(job_id, wire.RUNNING, ""))
    return job


def _worker(client, name: str, pid: int, current_job=None, seen_ago: float = 0.0) -> None:
    client.hset(registry.WORKERS, name, json.dumps(
        {"name": name, "pid": pid, "last_seen": time.time() - seen_ago, "current_job": current_job}))


def _latest(client, job_id: str) -> dict:
    return json.loads(client.get(jobs.status_key(job_id)))


def _queued_ids(client) -> list[str]:
    return [entry.job.id for entry in queues.waiting(client, queue_for(MODEL_KEY))]


def test_a_dead_workers_job_is_sent_again_once_then_ended(client, watchdog):
    _job(client, "a" * 32)
    _worker(client, "w@dead", 1, current_job="a" * 32, seen_ago=registry.STALE_S + 1)
    watchdog.tick()
    assert _queued_ids(client) == ["a" * 32]
    assert queues.waiting(client, queue_for(MODEL_KEY))[0].job.attempt == 2
    assert _latest(client, "a" * 32)["status"] == wire.QUEUED
    assert "was lost" in _latest(client, "a" * 32)["description"]
    assert not client.hexists(registry.WORKERS, "w@dead")
    # The same worker entry again (say, read before it was deleted): never twice.
    _worker(client, "w@dead", 1, current_job="a" * 32, seen_ago=registry.STALE_S + 1)
    watchdog.tick()
    assert _queued_ids(client) == ["a" * 32]

    # Its second worker dies too: ERROR, not a third run.
    client.delete(jobs.lost_key("b" * 32))
    _job(client, "b" * 32, attempt=2)
    _worker(client, "w@dead2", 2, current_job="b" * 32, seen_ago=registry.STALE_S + 1)
    watchdog.tick()
    latest = _latest(client, "b" * 32)
    assert latest["status"] == wire.ERROR and "twice" in latest["description"]
    assert "b" * 32 not in _queued_ids(client)


def test_an_ended_job_is_not_run_again(client, watchdog):
    _job(client, "c" * 32)
    client.set(jobs.status_key("c" * 32), wire.response_json("c" * 32, wire.COMPLETED, ""))
    _worker(client, "w@dead", 1, current_job="c" * 32, seen_ago=registry.STALE_S + 1)
    watchdog.tick()
    assert _queued_ids(client) == []
    assert _latest(client, "c" * 32)["status"] == wire.COMPLETED


def test_a_worker_restarted_under_its_name_hands_its_job_over(client, watchdog):
    _job(client, "d" * 32)
    _worker(client, "cpu@host", 100, current_job="d" * 32)  # fresh: not stale yet
    registry.set_deployment(client, "cpu@host", MODEL_KEY, registry.RUNNING, size_bytes=1)
    old = registry.take_over(client, "cpu@host", 200)  # the new process, at ready()
    assert old["pid"] == 100
    assert registry.get_deployment(client, "cpu@host", MODEL_KEY) is None, "the new process holds nothing yet"
    assert registry.take_over(client, "cpu@host", 200) is None
    watchdog.tick()
    assert _queued_ids(client) == ["d" * 32]
    assert client.hlen(registry.ORPHANS) == 0


def test_a_worker_restarted_while_it_was_judged_dead_keeps_its_fresh_entry(client, watchdog, monkeypatch):
    """The beat reads every entry, finds the old process silent, and meanwhile
    ``up``'s supervisor restarts it under the same name and the new process
    registers: the new entry (and what it claims) must survive the burial, and
    the old process's job is still sent again, once."""
    _job(client, "e" * 32)
    stale = {"name": "cpu@vm", "pid": 300, "last_seen": time.time() - registry.STALE_S - 1, "current_job": "e" * 32}
    registry.take_over(client, "cpu@vm", 301)  # the new process, at ready(): nothing of the old is left...
    _worker(client, "cpu@vm", 301)
    registry.set_deployment(client, "cpu@vm", MODEL_KEY, registry.DEPLOYING, size_bytes=1)  # ...and it loads
    read_earlier = {"cpu@vm": stale}  # what the beat read before the new process registered
    monkeypatch.setattr(registry, "all_workers", lambda _client: read_earlier)
    watchdog.tick()
    monkeypatch.undo()
    entry = json.loads(client.hget(registry.WORKERS, "cpu@vm"))
    assert entry["pid"] == 301, "the restarted worker's entry was erased with its dead predecessor"
    assert registry.get_deployment(client, "cpu@vm", MODEL_KEY) is not None
    assert _queued_ids(client) == ["e" * 32]
    # The old entry itself is still buried: by pid, one step (and a missing entry is left alone).
    assert not registry.unregister_worker(client, "cpu@vm", pid=300)
    assert registry.unregister_worker(client, "cpu@vm", pid=301)
    assert not client.hexists(registry.WORKERS, "cpu@vm") and registry.get_deployment(client, "cpu@vm", MODEL_KEY) is None
    assert not registry.unregister_worker(client, "cpu@vm", pid=301)


def test_jobs_nobody_serves_are_told_once_per_change(client, watchdog, settings):
    app = make_app(settings)
    from ndif_celery.celery_app import send_job

    job = _job(client, "e" * 32)
    send_job(app, job)
    client.sadd(registry.QUEUES, queue_for(MODEL_KEY))  # as the web's intake does
    watchdog.tick()
    watchdog.tick()
    assert _latest(client, job.id)["description"] == messages.unserved(MODEL_KEY)
    assert client.exists(unserved_key(job.id))
    # Told once: a third tick publishes nothing new (the key stays as it was).
    client.set(jobs.status_key(job.id), wire.response_json(job.id, wire.QUEUED, "marker"))
    watchdog.tick()
    assert _latest(client, job.id)["description"] == "marker"
    # A worker holds the model: the note is cleared, to be told again if it goes.
    _worker(client, "w@live", 3)
    registry.set_deployment(client, "w@live", MODEL_KEY, registry.DEPLOYING)
    watchdog.tick()
    assert not client.exists(unserved_key(job.id))


def test_two_watchdogs_one_leads(client, settings):
    first = FarmWatchdog(settings, client, make_app(settings), name="first")
    second = FarmWatchdog(settings, client, make_app(settings), name="second")
    assert first.lease.hold() and not second.lease.hold()
    assert first.lease.hold(), "the leader keeps its lease"
    client.delete("ndif:watchdog:leader")  # the leader died and its lease ran out
    assert second.lease.hold() and not first.lease.hold()


def test_a_job_past_its_deadline_that_its_worker_did_not_answer_gets_the_timeout_error(client, watchdog, settings):
    """User code holding the GIL starves its worker's own deadline thread: the
    beat answers, once, and a worker that answers late sends nothing."""
    from workers.job.channel import ELSEWHERE, FinalChannel

    job = _job(client, "c" * 32)
    worker_side = FinalChannel(client, job, 60)
    client.zadd(jobs.DEADLINES, {job.id: time.time() + 60})
    watchdog.tick()  # not yet due
    assert _latest(client, job.id)["status"] == wire.RUNNING

    client.zadd(jobs.DEADLINES, {job.id: time.time() - watchdog_module.OVERDUE_S - 0.1})
    watchdog.tick()
    latest = _latest(client, job.id)
    assert latest["status"] == wire.ERROR
    assert latest["description"] == messages.timed_out_unanswered(settings.execution_timeout_s)
    assert client.zscore(jobs.DEADLINES, job.id) is None
    # The worker wakes up and answers: dropped, in Redis as in the process.
    worker_side.send(wire.COMPLETED, "done")
    assert _latest(client, job.id)["status"] == wire.ERROR
    assert worker_side.answered_by == ELSEWHERE


def test_a_job_its_worker_answered_is_not_answered_again(client, watchdog):
    from workers.job.channel import FinalChannel

    job = _job(client, "d" * 32)
    FinalChannel(client, job, 60).send(wire.COMPLETED, "done")
    client.zadd(jobs.DEADLINES, {job.id: time.time() - 10})  # its worker died before clearing it
    watchdog.tick()
    assert _latest(client, job.id)["status"] == wire.COMPLETED
    assert client.zscore(jobs.DEADLINES, job.id) is None


def test_an_accepted_job_found_nowhere_is_sent_again_and_the_others_are_left_alone(client, watchdog):
    """The broker hands a job to a worker connection that was
    already dead; no worker records it, and the broker's redelivery waits for
    the visibility timeout. Found nowhere for LOST_AFTER_S, it is sent again."""
    from ndif_celery.celery_app import send_job

    now = time.time()
    accepted = now - watchdog_module.LOST_AFTER_S - 5
    lost, queued, running, ended = (_job(client, c * 32) for c in "1234")
    send_job(watchdog.app, queued)
    client.sadd(registry.QUEUES, queue_for(MODEL_KEY))  # as the intake registers it
    _worker(client, "w@alive", 7, current_job=running.id)
    client.set(jobs.status_key(ended.id), wire.response_json(ended.id, wire.COMPLETED, ""))
    client.zadd(jobs.OPEN, {job.id: accepted for job in (lost, queued, running, ended)})

    watchdog.tick(now)  # first seen nowhere: not yet (a worker may have taken it a moment ago)
    assert _queued_ids(client) == [queued.id]
    assert client.zscore(jobs.OPEN, ended.id) is None  # ended: no longer watched
    watchdog.tick(now + watchdog_module.LOST_AFTER_S / 2)
    assert _queued_ids(client) == [queued.id]
    # Its heartbeat, at the look's (simulated) time.
    _worker(client, "w@alive", 7, current_job=running.id, seen_ago=-watchdog_module.LOST_AFTER_S)
    watchdog.tick(now + watchdog_module.LOST_AFTER_S + 0.1)
    assert _queued_ids(client) == [queued.id, lost.id]
    assert queues.waiting(client, queue_for(MODEL_KEY))[1].job.attempt == 2
    assert "queued to run again" in _latest(client, lost.id)["description"]
    assert _latest(client, running.id)["status"] == wire.RUNNING  # reported by a live worker: left alone


def test_a_job_lost_in_delivery_twice_ends_with_an_error(client, watchdog):
    now = time.time()
    job = _job(client, "5" * 32, attempt=2)
    client.zadd(jobs.OPEN, {job.id: now - 60})
    watchdog.tick(now)
    watchdog.tick(now + watchdog_module.LOST_AFTER_S)
    latest = _latest(client, job.id)
    assert latest["status"] == wire.ERROR and messages.LOST_IN_DELIVERY in latest["description"]
    assert client.zscore(jobs.OPEN, job.id) is None
