"""A job's life (``workers.job.life``): how it ends, and how it starts.

A job's ending is ``life.fail``: each way a job ends badly gives the ERROR the
client reads, with its kind (no worker, no Redis). A job's start claims its
key's running slot on the model (``NDIF_MAX_RUNNING_PER_KEY``), on the
worker's own job function in the test process (the fixtures:
tests/inprocess/workers/conftest.py).
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from ndif_celery import wire
from ndif_celery.celery_app import queue_for
from ndif_celery.state import queues
from tests.support.cases.tiny_model import REPO_ID, client_model
from tests.support.cases.worker_jobs import delivered, handed_by_celery, latest, logits, result, submit


class _Channel:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, status, description, meta=None, kind=None, **_) -> None:
        self.sent.append((status, description, kind))


@pytest.mark.parametrize("error, kind, text", [
    ("cancelled", "cancelled", "Your job was cancelled by the operator."),
    ("timeout", "timeout", "Your job exceeded the execution timeout of 42s."),
    ("user", "user", "ValueError: the user's own"),
    ("store", "store", "the result store is unavailable"),
    ("server", "server", "Server error while running your job: KeyError"),
])
def test_every_bad_end_gives_its_error(error, kind, text):
    from ndif_celery.store import StoreUnavailable
    from workers.execute import RequestError
    from workers.job import life as job_life
    from workers.job.executors import JobCancelled, JobTimedOut

    raised = {"cancelled": JobCancelled(), "timeout": JobTimedOut(), "user": RequestError("ValueError: the user's own"),
              "store": StoreUnavailable("down"), "server": KeyError("x")}[error]
    worker = types.SimpleNamespace(settings=types.SimpleNamespace(execution_timeout_s=42.0),
                                   slot=types.SimpleNamespace(cancel_texts={}))
    channel = _Channel()
    life = types.SimpleNamespace(job=types.SimpleNamespace(id="j1"), meta={}, channel=channel)
    try:
        raise raised
    except BaseException as caught:  # noqa: BLE001 - fail is called while the error is handled
        job_life.fail(worker, life, caught)
    [(status, description, sent_kind)] = channel.sent
    assert (status, sent_kind) == ("ERROR", kind)
    assert text in description


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
