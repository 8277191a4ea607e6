"""Jobs for the worker's own job function in the test process (``WorkerState.run``).

Real nnsight payloads posted through the real intake (Flask's test client),
taken out of their queue as Celery's consumer hands them to the pool, and
their statuses and results read back from Redis and the store. The fast
tier's worker tests use them with the fixtures of
``tests/inprocess/workers/conftest.py`` (the worker, the intake, the model).
"""

from __future__ import annotations

import io
import json

import torch
import zstandard

from ndif_celery import wire
from ndif_celery.state import jobs, queues
from tests.support.clients.remote import recorded_request

PROMPT = "The quick brown fox"
CHECK_EVERY = 100  # the whole check only when the stamps show a write, or nothing waits


# --- requests, as the real client sends them -------------------------------------------


def logits(model):
    with model.trace(PROMPT, remote=True):
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
