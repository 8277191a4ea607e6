"""The worker's job function (``WorkerState.run``, ``WorkerState.cancel``) on
the tiny model in the test process (the fixtures: tests/inprocess/workers/conftest.py):
a job taken as the next one and killed before it starts is skipped, and the
worker's entry stops naming it. The steps of ``WorkerState.run``: the chain
``job/test_gather.py``, the delivery thread ``job/test_deliveries.py``, a
job's start and end ``job/test_life.py``; its registry entry as a job ends:
``test_tasks.py``.
"""

from __future__ import annotations

from ndif_celery import wire
from ndif_celery.celery_app import queue_for
from ndif_celery.state import queues
from tests.support.cases.tiny_model import REPO_ID, client_model
from tests.support.cases.worker_jobs import latest, logits, submit


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
