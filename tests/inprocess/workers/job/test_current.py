"""The worker's job slot (``workers.job.current.CurrentJob``) against a real embedded Redis.

No whole worker: the slot gets a Redis client, a name, an entry lock and how
to build the registry entry, as ``WorkerState`` gives them. What it must keep
true: the registry entry names the job it runs and its co-batch; a job taken
(``take``, ``take_next``) leaves its queue in the same step; a kill interrupts
the job's thread, or answers a taken job that has no thread yet, and never
interrupts a thread that takes or answers a co-batch.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from ndif_celery import messages, wire
from ndif_celery.celery_app import make_app, queue_for, send_job
from ndif_celery.state import jobs, queues, registry
from workers.job.current import CurrentJob
from workers.job.executors import JobCancelled

NAME = "w@slot"
MODEL_KEY = 'nnsight.modeling.language.LanguageModel:{"repo_id": "slot/tiny"}'
IDS = [c * 32 for c in "abcd"]


@pytest.fixture
def slot(redis_client, embedded_settings):
    """A slot whose registry entry is the worker's bare info plus its own part."""
    made: list = []

    def registration() -> dict:
        return dict({"name": NAME, "pid": 7}, **made[0].entry())

    made.append(CurrentJob(redis_client, NAME, embedded_settings.job_ttl_s, threading.Lock(), registration))
    return made[0]


@pytest.fixture
def queued(redis_client, embedded_settings):
    """Queue ``IDS`` on the model's queue, as the web does; the waiting entries, in order."""
    app = make_app(embedded_settings)
    for job_id in IDS:
        job = jobs.Job(id=job_id, model_key=MODEL_KEY, received_at=time.time())
        redis_client.set(jobs.message_key(job_id), jobs.dumps(job.to_message()))
        redis_client.set(jobs.status_key(job_id), wire.response_json(job_id, wire.QUEUED, ""))
        send_job(app, job)
    return queues.waiting(redis_client, queue_for(MODEL_KEY))


def _entry(client) -> dict:
    return json.loads(client.hget(registry.WORKERS, NAME))


def _waiting_ids(client) -> list[str]:
    return [entry.job.id for entry in queues.waiting(client, queue_for(MODEL_KEY))]


def _latest(client, job_id: str) -> dict:
    return json.loads(client.get(jobs.status_key(job_id)))


def test_begin_names_the_job_and_its_thread_and_end_clears_them(slot, redis_client):
    pipe = redis_client.pipeline()
    slot.begin(IDS[0], pipe)
    assert redis_client.hget(registry.WORKERS, NAME) is None, "written on the caller's round trip"
    pipe.execute()
    assert _entry(redis_client)["current_job"] == IDS[0]
    assert (slot.job_id, slot.thread) == (IDS[0], threading.get_ident())
    slot.end()
    assert (slot.job_id, slot.thread, slot.batch) == (None, None, ())
    assert _entry(redis_client)["current_job"] is None and _entry(redis_client)["batch"] == []


def test_take_makes_the_waiting_jobs_the_co_batch_and_begin_keeps_the_lead(slot, redis_client, queued):
    slot.begin(IDS[0], redis_client)
    assert queues.remove(redis_client, queue_for(MODEL_KEY), IDS[2]) is not None  # another worker's now
    taken = slot.take(queued[1:3])
    assert [job.id for job in taken] == [IDS[1]]
    assert slot.batch == (IDS[1],)
    assert _waiting_ids(redis_client) == [IDS[0], IDS[3]]
    entry = _entry(redis_client)
    assert entry["current_job"] == IDS[0] and entry["batch"] == [IDS[1]]
    slot.begin(IDS[1], redis_client)  # a job of the co-batch starts: the lead is still the current job
    assert (slot.job_id, slot.batch) == (IDS[0], (IDS[1],))


def test_take_waits_for_the_heartbeats_write_of_the_same_entry(slot, redis_client, queued):
    with slot.entry_lock:  # the heartbeat writes the entry
        taker = threading.Thread(target=slot.take, args=(queued[:1],), daemon=True)
        taker.start()
        taker.join(0.2)
        assert taker.is_alive() and slot.batch == () and _waiting_ids(redis_client) == IDS
    taker.join(10)
    assert slot.batch == (IDS[0],) and _waiting_ids(redis_client) == IDS[1:]


def test_take_next_takes_the_head_as_the_current_job_without_a_thread(slot, redis_client, queued):
    taken = slot.take_next(queued[0])
    assert taken is not None and taken.id == IDS[0]
    assert (slot.job_id, slot.thread, slot.batch) == (IDS[0], None, ())
    assert _entry(redis_client)["current_job"] == IDS[0]
    assert _waiting_ids(redis_client) == IDS[1:]


def test_take_next_loses_to_another_taker(slot, redis_client, queued):
    assert queues.remove(redis_client, queue_for(MODEL_KEY), IDS[0]) is not None  # another worker got it first
    assert slot.take_next(queued[0]) is None
    assert slot.job_id is None and slot.entry()["current_job"] is None, "the next write of the entry names nothing"
    assert _waiting_ids(redis_client) == IDS[1:]


def test_a_kill_of_a_job_taken_but_not_started_is_answered_by_the_slot(slot, redis_client, queued):
    slot.take_next(queued[0])
    assert slot.cancel(IDS[0], "stopped by the test", JobCancelled) is True
    latest = _latest(redis_client, IDS[0])
    assert latest["status"] == wire.ERROR and latest["description"] == "stopped by the test"
    assert slot.cancel_texts == {}, "no thread to interrupt: nothing for life.fail"
    assert redis_client.get(jobs.final_key(IDS[0])).decode() == f"kill@{NAME}"


def test_a_kill_interrupts_the_jobs_thread_with_its_text(slot, redis_client):
    begun, caught = threading.Event(), []

    def job_thread() -> None:
        slot.begin(IDS[0], redis_client)
        begun.set()
        deadline = time.monotonic() + 10
        try:
            while time.monotonic() < deadline:
                time.sleep(0.01)
        except JobCancelled as error:
            caught.append(error)

    thread = threading.Thread(target=job_thread, daemon=True)
    thread.start()
    assert begun.wait(10)
    assert slot.cancel(IDS[0], messages.CANCELLED, JobCancelled) is True
    thread.join(10)
    assert len(caught) == 1
    assert slot.cancel_texts == {IDS[0]: messages.CANCELLED}
    assert redis_client.get(jobs.status_key(IDS[0])) is None, "answered by life.fail, not by the slot"


def test_a_kill_leaves_a_co_batch_and_other_jobs_alone(slot, redis_client, queued):
    slot.begin(IDS[0], redis_client)
    slot.take(queued[1:2])
    assert slot.cancel(IDS[0], messages.CANCELLED, JobCancelled) is False, "its thread answers a co-batch"
    assert slot.cancel(IDS[1], messages.CANCELLED, JobCancelled) is False
    slot.end()
    assert slot.cancel(IDS[0], messages.CANCELLED, JobCancelled) is False, "not this slot's job any more"
    assert slot.cancel_texts == {}
    assert all(_latest(redis_client, job_id)["status"] == wire.QUEUED for job_id in IDS)
