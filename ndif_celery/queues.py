"""What is waiting in the per-model queues, read straight from the broker.

Celery's Redis transport keeps each queue as a Redis list of JSON envelopes
(LPUSH to add, BRPOP to take, so the oldest is at the right). Reading the
list gives depth, head wait and the jobs in order without taking anything, so
the controller can tell clients their position and the CLI can show and
remove queued jobs. Only our own task messages (JSON, protocol 2) are read.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass
from typing import Optional

import redis

from . import jobs, registry


@dataclass
class Waiting:
    job: jobs.Job
    raw: bytes  # the exact list element, for LREM


def _decode(raw: bytes) -> Optional[jobs.Job]:
    try:
        envelope = json.loads(raw)
        body = envelope["body"]
        if envelope.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        _args, kwargs, _embed = json.loads(body)
        return jobs.Job.from_message(kwargs["job"])
    except (ValueError, KeyError, TypeError):
        return None


def waiting(client: redis.Redis, queue: str) -> list[Waiting]:
    """The jobs waiting in ``queue``, oldest first."""
    entries = []
    for raw in reversed(client.lrange(queue, 0, -1)):
        job = _decode(raw)
        if job is not None:
            entries.append(Waiting(job, raw))
    return entries


def head_wait(client: redis.Redis, queue: str, now: Optional[float] = None) -> float:
    """Seconds the oldest waiting job of ``queue`` has waited (0 when empty)."""
    raw = client.lindex(queue, -1)
    job = _decode(raw) if raw is not None else None
    if job is None:
        return 0.0
    return max(0.0, (time.time() if now is None else now) - job.received_at)


def remove(client: redis.Redis, queue: str, job_id: str) -> Optional[jobs.Job]:
    """Take a waiting job out of ``queue``; None if it is not (or no longer) there."""
    for entry in waiting(client, queue):
        if entry.job.id == job_id and client.lrem(queue, 1, entry.raw):
            return entry.job
    return None


def drain(client: redis.Redis, queue: str) -> list[jobs.Job]:
    """Take every waiting job out of ``queue`` (to fail them all with one reason)."""
    taken = []
    while True:
        raw = client.rpop(queue)
        if raw is None:
            return taken
        job = _decode(raw)
        if job is not None:
            taken.append(job)


def model_queues(client: redis.Redis) -> list[str]:
    return sorted(q.decode() for q in client.smembers(registry.QUEUES))


def summary(client: redis.Redis, now: Optional[float] = None) -> list[dict]:
    """Depth and head wait of every model queue, for ``ndif-celery queue``."""
    now = time.time() if now is None else now
    rows = []
    for queue in model_queues(client):
        entries = waiting(client, queue)
        rows.append(
            {
                "queue": queue,
                "model_key": entries[0].job.model_key if entries else client.hget(registry.QUEUE_MODELS, queue),
                "depth": len(entries),
                "head_wait_s": round(now - entries[0].job.received_at, 3) if entries else 0.0,
                "jobs": [entry.job.id for entry in entries],
            }
        )
    for row in rows:
        if isinstance(row["model_key"], bytes):
            row["model_key"] = row["model_key"].decode()
    return rows
