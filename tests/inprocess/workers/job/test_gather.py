"""The chain (``workers.job.gather.next_job``), on the worker's own job
function in the test process (the fixtures: tests/inprocess/workers/conftest.py).

Jobs at the head of the model's queue run one after another without a trip
through Celery, in order, each once; the chain stops for anything else that
waits for the worker, after ``CHAIN_MAX`` jobs, and at an untrusted job.
A co-batch's gathering: ``test_gather_cobatch.py``.
"""

from __future__ import annotations

import dataclasses

import torch

from ndif_celery import wire
from ndif_celery.celery_app import make_app, queue_for, send_job, worker_queue
from ndif_celery.state import jobs, queues
from tests.support.cases.tiny_model import REPO_ID, client_model
from tests.support.cases.worker_jobs import delivered, handed_by_celery, latest, logits, result, submit


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
