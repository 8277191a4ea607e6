"""A worker that keeps the model busy, in-process (fast tier):
the worker's own job function (``WorkerState.run``) on the tiny model, real
nnsight payloads posted through the real intake (Flask's test client), a real
embedded Redis and the filesystem store; no Celery worker, no gunicorn.

- the weight check after trusted jobs: cheap stamps after every job, the whole
  fingerprint only when they show a write, when no job waits, or every
  ``NDIF_TRUSTED_CHECK_EVERY``-th job; a weight written by one job (through
  an nnsight edit, ``.data``, a new storage) never reaches the next one;
- the chain (``batch.next_job``): jobs at the head of the model's queue run
  one after another without a trip through Celery, in order, each once; the
  chain stops for anything else that waits for the worker;
- the delivery thread (``workers.job.deliveries``): the next job runs while a
  result is being stored; meanwhile the job is still this worker's in its
  registry entry (a dead worker's job is rescued), and ``ndif-celery kill``
  answers it once.
"""

from __future__ import annotations

import dataclasses
import io
import json
import threading
import time

import pytest
import torch
import zstandard

from ndif_celery import wire
from ndif_celery.celery_app import make_app, queue_for, send_job, worker_queue
from ndif_celery.farm.watchdog import FarmWatchdog
from ndif_celery.state import jobs, queues, registry
from tests.support.remote import recorded_request
from tests.support.tiny_model import REPO_ID, client_model

PROMPT = "The quick brown fox"
CHECK_EVERY = 100  # the whole check only when the stamps show a write, or nothing waits


@pytest.fixture(scope="module")
def settings(embedded_settings):
    # Co-batching off: each job runs alone, so the chain is what runs the waiting
    # ones (a co-batch's hand-over is tested end to end, tests/test_cobatch_e2e.py).
    return dataclasses.replace(embedded_settings, models="*", trusted_check_every=CHECK_EVERY, cobatch_max=1)


@pytest.fixture(scope="module")
def client_lm():
    return client_model(REPO_ID)


@pytest.fixture(scope="module")
def worker(settings):
    from workers.worker import WorkerState

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NDIF_MODELS", "*")  # what the worker's own load (and reload) reads
        state = WorkerState("w@pipeline", settings, make_app(settings))
        state.models.load(client_model(REPO_ID).to_model_key())
        yield state


@pytest.fixture(scope="module")
def web(settings):
    from web.app import create_app

    return create_app(settings).test_client()


@pytest.fixture
def redis(redis_client, worker):
    """An empty Redis; the worker's model pristine (a test may leave it written)."""
    worker.models.restore_if_changed(client_model(REPO_ID).to_model_key())
    return redis_client


# --- requests, as the real client sends them -------------------------------------------


def logits(model):
    with model.trace(PROMPT, remote=True):
        out = model.lm_head.output.save()
    return out


def edit_write(model):  # an nnsight edit of a weight, in place
    with model.trace(PROMPT, remote=True):
        model.transformer.h[1].mlp.c_fc.weight[:] = 0
        out = model.lm_head.output.save()
    return out


def data_write(model):  # through .data: no version counter moves
    with model.trace(PROMPT, remote=True):
        model.transformer.h[1].mlp.c_fc.weight.data[:] = 0
        out = model.lm_head.output.save()
    return out


def storage_write(model):  # a new storage under the same parameter
    with model.trace(PROMPT, remote=True):
        weight = model.transformer.h[1].mlp.c_fc.weight
        weight.data = torch.zeros_like(weight.data)
        out = model.lm_head.output.save()
    return out


def payload(fn, model) -> tuple[str, bytes]:
    """What the real client POSTs for ``fn``: (envelope JSON, payload)."""
    envelope, blob = recorded_request(fn, model)
    return json.dumps({"model_key": envelope.model_key, "session_id": "", "compress": envelope.compress,
                       "env": envelope.env or {}}), blob


def submit(web, fn, model) -> str:
    data, blob = payload(fn, model)
    response = web.post("/request", data={"data": data, "blob": (io.BytesIO(blob), "request")})
    assert response.status_code == 200, response.get_json()
    return response.get_json()["id"]


def handed_by_celery(redis, job_id: str) -> jobs.Job:
    """The job's message taken out of its queue, as Celery's consumer hands it to the pool."""
    for queue in queues.model_queues(redis):
        job = queues.remove(redis, queue, job_id)
        if job is not None:
            return job
    raise AssertionError(f"job {job_id} is not queued")


def latest(redis, job_id: str) -> dict:
    return json.loads(redis.get(jobs.status_key(job_id)))


def result(worker, redis, job_id: str) -> dict:
    status = latest(redis, job_id)
    assert status["status"] == wire.COMPLETED, status
    raw = bytes(worker.store.get(jobs.result_key(job_id)))
    return torch.load(io.BytesIO(zstandard.ZstdDecompressor().decompress(raw) if raw[:4] == b"\x28\xb5\x2f\xfd"
                                 else raw), weights_only=False)


def delivered(worker, timeout: float = 30) -> None:
    assert worker.deliveries.wait_idle(timeout), f"still delivering {worker.deliveries.delivering()}"


@pytest.fixture(scope="module")
def reference(client_lm):
    """The logits of the pristine model, run locally."""
    with client_lm.trace(PROMPT):
        out = client_lm.lm_head.output.save()
    return out


# --- the weight check --------------------------------------------------------------------


def test_an_untouched_model_passes_the_stamps_and_is_checked_whole_only_when_due(worker, redis):
    """The saving: with a job waiting, a job that wrote nothing skips the whole
    fingerprint (~0.1 s per GiB); nothing waiting, or the Nth job, runs it."""
    key = client_model(REPO_ID).to_model_key()
    models = worker.models
    models.restore_if_changed(key)  # unchecked = 0
    assert models.check_after_trusted(key, idle=False) == ("", [])
    assert models.check_after_trusted(key, idle=True) == ("no job is waiting", [])
    for _ in range(CHECK_EVERY - 1):
        assert models.check_after_trusted(key, idle=False) == ("", [])
    why, changed = models.check_after_trusted(key, idle=False)
    assert why == f"{CHECK_EVERY} trusted jobs since the last whole check" and changed == []


def test_idle_moments_run_the_whole_check_at_most_once_a_gap(worker, redis):
    """A lone client's back-to-back jobs each leave the worker idle: the whole
    check runs in one such moment per IDLE_CHECK_GAP_S, and in the others the
    broker is not even asked whether a job waits."""
    from workers.job.executors import InProcess
    from workers.models import resident

    key = client_model(REPO_ID).to_model_key()
    models = worker.models
    asked: list = []
    executor = InProcess(worker.settings, models, worker.deadlines, lambda model_key: asked.append(model_key))
    job = jobs.Job(id="idle-gap", model_key=key, session_id="", compress=False, env={}, received_at=time.time())
    models.restore_if_changed(key)  # a whole check: just now
    assert not models.idle_check_due(key)
    unchecked = models.resident(key).unchecked
    executor.after(job)
    assert asked == [] and models.resident(key).unchecked == unchecked + 1, "no whole check, no question"
    models.resident(key).checked_at -= resident.IDLE_CHECK_GAP_S
    assert models.idle_check_due(key)
    executor.after(job)  # nothing waits (job_waiting answers None): the whole check runs
    assert asked == [key] and models.resident(key).unchecked == 0
    assert not models.idle_check_due(key)


def test_every_job_of_a_co_batch_counts_towards_the_nth_whole_check(worker, redis):
    """A co-batch's lead checks once for all its jobs: a batch of N-1 jobs and
    then one more job make the Nth, so a write no stamp sees during a shared
    forward reaches no more jobs than one run one at a time."""
    key = client_model(REPO_ID).to_model_key()
    models = worker.models
    models.restore_if_changed(key)
    assert models.check_after_trusted(key, idle=False, jobs=CHECK_EVERY - 1) == ("", [])
    why, changed = models.check_after_trusted(key, idle=False)
    assert why == f"{CHECK_EVERY} trusted jobs since the last whole check" and changed == []


def test_a_write_no_stamp_sees_is_caught_by_the_nth_whole_check(worker, redis):
    """The stated bound: a write through ``.data`` to a word no sample covers
    shows only in the whole fingerprint, run after the Nth trusted job."""
    from workers.models import integrity

    key = client_model(REPO_ID).to_model_key()
    models = worker.models
    models.restore_if_changed(key)
    weight = models.get(key)._module.transformer.h[0].mlp.c_fc.weight
    words = weight.detach().reshape(-1).view(torch.int64)
    step = max(1, words.numel() // integrity.SAMPLED_WORDS)
    unsampled = step // 2  # between the first two samples
    assert 0 < unsampled < step and unsampled != words.numel() - 1
    weight.data.view(-1).view(torch.int64)[unsampled] += 1
    for _ in range(CHECK_EVERY - 1):
        assert models.check_after_trusted(key, idle=False) == ("", []), "the stamps cannot see this write"
    why, changed = models.check_after_trusted(key, idle=False)
    assert why.startswith(f"{CHECK_EVERY} trusted jobs") and changed == ["transformer.h.0.mlp.c_fc.weight"]
    assert torch.equal(models.get(key)._module.transformer.h[0].mlp.c_fc.weight.view(-1).view(torch.int64)[unsampled],
                       words[unsampled] - 1), "reloaded: the word is back"


def test_a_write_of_the_same_values_retakes_the_stamps_and_a_swap_the_sum_misses_reloads(worker, redis):
    """A counter that moved with nothing changed (``w.add_(0)``) costs one whole
    check, then the stamps are retaken; a sampled word that differs is a write
    even where the fingerprint's sum cancels (two words swapped), so the model
    is reloaded."""
    from workers import execute

    key = client_model(REPO_ID).to_model_key()
    models = worker.models
    models.restore_if_changed(key)
    model = models.get(key)
    weight = model._module.transformer.h[0].mlp.c_fc.weight
    execute.persistent_objects(model, {})  # kept, as after a request
    assert model._module in execute._PERSISTENT
    with torch.no_grad():
        weight.add_(0)
    assert models.check_after_trusted(key, idle=False) == ("a weight's version counter or storage changed", [])
    assert model._module not in execute._PERSISTENT, "the tree may have changed: read again at the next request"
    assert models.check_after_trusted(key, idle=False) == ("", []), "the stamps were retaken"
    words = weight.data.view(-1).view(torch.int64)  # through .data: no counter moves
    first, second = words[0].item(), words[1].item()
    assert first != second
    words[0], words[1] = second, first
    why, changed = models.check_after_trusted(key, idle=False)
    assert why == "a sampled word of a weight changed"
    assert changed == ["(a sampled word)"], "the sum alone cannot see a swap: the sampled word did"
    assert models.get(key)._module.transformer.h[0].mlp.c_fc.weight.view(-1).view(torch.int64)[0].item() == first


@pytest.mark.parametrize("writer", [edit_write, data_write, storage_write], ids=["nnsight-edit", "data", "storage"])
def test_a_weight_written_by_a_job_never_reaches_the_next_job(worker, web, redis, client_lm, reference, writer):
    """With the next job waiting (so the whole check is not due), the stamps
    see the write (a version counter, a sampled word, a new storage) and the
    model is reloaded before the next job's forward. Without that detection
    the next job would read the zeroed weight."""
    writing = submit(web, writer, client_lm)
    reading = submit(web, logits, client_lm)
    worker.run(handed_by_celery(redis, writing))  # and the reading job after it (the chain)
    delivered(worker)
    assert torch.equal(result(worker, redis, reading)["out"], reference)
    assert not torch.equal(result(worker, redis, writing)["out"], reference), "the write did change its own run"
    key = client_model(REPO_ID).to_model_key()
    assert torch.count_nonzero(worker.models.get(key)._module.transformer.h[1].mlp.c_fc.weight) > 0


# --- the chain and the delivery thread -----------------------------------------------


def test_waiting_jobs_run_in_order_in_one_task_each_once(worker, web, redis, client_lm, reference):
    ids = [submit(web, logits, client_lm) for _ in range(4)]
    worker.run(handed_by_celery(redis, ids[0]))
    delivered(worker)
    assert queues.waiting(redis, queue_for(client_model(REPO_ID).to_model_key())) == []
    ended = []
    for job_id in ids:
        assert torch.equal(result(worker, redis, job_id)["out"], reference)
        # NDIF_COBATCH_MAX=1: four trusted jobs of one model, waiting together, each ran alone.
        assert (latest(redis, job_id)["meta"] or {}).get("cobatch", 1) == 1, latest(redis, job_id)
        ended.append(redis.zscore(jobs.ENDED, job_id))
        assert redis.get(jobs.payload_key(job_id)) is None, "its payload is deleted once delivered"
    assert ended == sorted(ended), "in the queue's order"
    assert worker.registration()["current_job"] is None and worker.deliveries.delivering() == []


def test_the_chain_stops_for_anything_else_that_waits_for_the_worker(worker, web, redis, client_lm, settings):
    """A message on the worker's own queue (a load, an eviction) goes first:
    the task returns to Celery, and the model's waiting job stays queued."""
    first, second = submit(web, logits, client_lm), submit(web, logits, client_lm)
    redis.lpush(worker_queue(worker.name), b"a control message")
    worker.run(handed_by_celery(redis, first))
    delivered(worker)
    assert latest(redis, first)["status"] == wire.COMPLETED
    assert [e.job.id for e in queues.waiting(redis, queue_for(client_model(REPO_ID).to_model_key()))] == [second]


def test_one_task_runs_at_most_chain_max_jobs(worker, web, redis, client_lm, monkeypatch):
    from workers.job import gather

    monkeypatch.setattr(gather, "CHAIN_MAX", 2)
    ids = [submit(web, logits, client_lm) for _ in range(4)]
    worker.run(handed_by_celery(redis, ids[0]))
    delivered(worker)
    assert [latest(redis, job_id)["status"] for job_id in ids[:2]] == [wire.COMPLETED] * 2
    assert [e.job.id for e in queues.waiting(redis, queue_for(client_model(REPO_ID).to_model_key()))] == ids[2:]


def test_an_untrusted_job_at_the_head_ends_the_chain(worker, web, redis, client_lm):
    first, second = submit(web, logits, client_lm), submit(web, logits, client_lm)
    queue = queue_for(client_model(REPO_ID).to_model_key())
    queued = handed_by_celery(redis, second)
    send_job(make_app(worker.settings), dataclasses.replace(queued, trusted=False))
    worker.run(handed_by_celery(redis, first))
    delivered(worker)
    assert [(e.job.id, e.job.trusted) for e in queues.waiting(redis, queue)] == [(second, False)]


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


def test_a_kill_of_a_job_taken_as_the_next_one_before_it_starts(worker, web, redis, client_lm):
    job_id = submit(web, logits, client_lm)
    queue = queue_for(client_model(REPO_ID).to_model_key())
    taken = worker.slot.take_next(queues.waiting(redis, queue)[0])
    assert taken is not None and taken.id == job_id
    assert worker.cancel(job_id)
    assert latest(redis, job_id)["status"] == wire.ERROR
    worker.run(taken)  # starts as ended: skipped
    assert latest(redis, job_id)["status"] == wire.ERROR
    assert worker.registration()["current_job"] is None, "no longer named as running"


def test_a_key_at_its_running_bound_on_the_model_goes_back_in_line(worker, web, redis, client_lm, reference,
                                                                   monkeypatch):
    """NDIF_MAX_RUNNING_PER_KEY=1: while one job of the key runs on the model
    (on another replica), the worker sends its next job back in line instead of
    running it, and goes back to Celery; once that one ended, the job runs."""
    from ndif_celery.state import turns

    monkeypatch.setattr(worker, "settings", dataclasses.replace(worker.settings, max_running_per_key=1))
    queue = queue_for(client_model(REPO_ID).to_model_key())
    job_id = submit(web, logits, client_lm)
    job = handed_by_celery(redis, job_id)
    elsewhere = dataclasses.replace(job, id="f" * 32)  # the key's job on another replica
    claim = redis.pipeline()
    turns.claim_run(claim, elsewhere, queue, worker.settings)
    assert claim.execute() == [1]
    worker.run(job)
    assert latest(redis, job_id)["status"] == wire.QUEUED
    assert [entry.job.id for entry in queues.waiting(redis, queue)] == [job_id]
    turns.release_run(redis, elsewhere, queue)
    worker.run(handed_by_celery(redis, job_id))
    delivered(worker)
    assert torch.equal(result(worker, redis, job_id)["out"], reference)
    assert not redis.exists(f"ndif:turns:{queue}:running:{job.owner}"), "its slot was not freed"


def test_a_model_layered_by_a_requests_adapter_stays_walked_after_a_swap(worker, redis):
    """A model that took a PEFT adapter from a request's env is walked for every
    request; a swap the stamps saw drops kept objects, never that mark."""
    from workers import execute

    model = worker.models.get(client_model(REPO_ID).to_model_key())
    execute._PERSISTENT[model._module] = execute.LAYERED  # as a request with env {"peft": ...} leaves it
    try:
        execute.forget_tree(model)
        assert execute._PERSISTENT[model._module] is execute.LAYERED
        objects = execute.persistent_objects(model, {})
        assert objects["Module:model.transformer.h.0"] is model._module.transformer.h[0]
        assert execute._PERSISTENT[model._module] is execute.LAYERED, "walked, not kept"
    finally:
        execute._PERSISTENT.pop(model._module, None)
