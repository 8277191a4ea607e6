"""What is waiting in the per-model queues, read straight from the broker.

Celery's Redis transport keeps each queue as Redis lists of JSON envelopes,
one per priority step (the queue's own name for priority 0, then
``<queue>\x06\x16<step>``; LPUSH to add, BRPOP across them in priority order
to take, so the oldest is at the right). Reading the lists gives depth, head
wait and the jobs in the order they will run without taking anything, so the
controller can tell clients their position and the CLI can show and remove
queued jobs. Only our own task messages (JSON, protocol 2) are read. The
intake writes a job's message here too (:func:`job_message`), as Celery's
send would, on the round trip that parks the job.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from dataclasses import dataclass
from typing import Optional

import redis
from celery import Celery
from kombu import serialization

from ndif_celery import wire
from ndif_celery.celery_app import PRIORITY_FIRST, PRIORITY_NORMAL, RUN_JOB, queue_for

from . import jobs, registry

# kombu's Redis transport: its priority steps and the separator of the list names.
PRIORITY_STEPS = (0, 3, 6, 9)
_SEP = "\x06\x16"


def lists(queue: str) -> list[str]:
    """The Redis lists of ``queue``, in the order the workers take from them."""
    return [queue if step == 0 else f"{queue}{_SEP}{step}" for step in PRIORITY_STEPS]


def list_for(queue: str, priority: int) -> str:
    """The list a job sent at ``priority`` waits in (kombu files it under the
    highest step not above it)."""
    return lists(queue)[max(i for i, step in enumerate(PRIORITY_STEPS) if step <= priority)]


def lists_up_to(queue: str, priority: int) -> list[str]:
    """The lists whose jobs run before (or with) a job sent at ``priority``."""
    return [name for step, name in zip(PRIORITY_STEPS, lists(queue)) if step <= priority]


def job_message(app: Celery, job: jobs.Job) -> tuple[str, str]:
    """``(list, message)``: what ``celery_app.send_job`` LPUSHes for ``job``, for the
    intake to push on the round trip that parks the job.

    Why: Celery's send (its router, producer pool and kombu's publish) cost
    the web a millisecond of CPU and an extra round trip per request, and the
    message reached the broker ~2 ms after the job's QUEUED status. Celery
    still writes the message (``amqp.create_task_message``: protocol 2, its
    headers, its JSON body); only kombu's Redis envelope is written here, the
    one :func:`waiting` reads (tests/inprocess/ndif_celery/test_intake.py holds both to
    what ``send_task`` pushes)."""
    queue = queue_for(job.model_key)
    priority = PRIORITY_FIRST if job.priority else PRIORITY_NORMAL
    kwargs = {"job": job.to_message()}
    task = app.amqp.create_task_message(job.id, RUN_JOB, (), kwargs, reply_to=app.thread_oid,
                                        create_sent_event=False, ignore_result=None)
    content_type, content_encoding, body = serialization.dumps(task.body, serializer="json")
    envelope = {
        "body": base64.b64encode(body.encode()).decode(),
        "content-encoding": content_encoding,
        "content-type": content_type,
        "headers": task.headers,
        "properties": {
            **task.properties,
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": priority,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    return list_for(queue, priority), json.dumps(envelope)


@dataclass
class Waiting:
    job: jobs.Job
    raw: bytes  # the exact list element, for LREM
    list_name: str = ""  # which of the queue's lists holds it


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


def waiting(client: redis.Redis, queue: str, first: int = 0) -> list[Waiting]:
    """The jobs waiting in ``queue``, in the order they will run (priority
    first, then oldest first). ``first``: read only the first that many of
    each list (a worker after the head of a long queue reads no more of it)."""
    pipe = client.pipeline(transaction=False)
    read_waiting(pipe, queue, first)
    return decode_waiting(queue, pipe.execute())


def read_waiting(pipe: "redis.client.Pipeline", queue: str, first: int = 0) -> None:
    """Queue :func:`waiting`'s reads on ``pipe`` (with others, one round trip);
    :func:`decode_waiting` reads their answers, the last ``len(lists(queue))``."""
    for name in lists(queue):
        pipe.lrange(name, -first if first > 0 else 0, -1)


def decode_waiting(queue: str, answers: list) -> list[Waiting]:
    names = lists(queue)
    entries = []
    for name, raws in zip(names, answers[-len(names):]):
        for raw in reversed(raws):
            job = _decode(raw)
            if job is not None:
                entries.append(Waiting(job, raw, name))
    return entries


def remove(client: redis.Redis, queue: str, job_id: str) -> Optional[jobs.Job]:
    """Take a waiting job out of ``queue``; None if it is not (or no longer) there."""
    for entry in waiting(client, queue):
        if entry.job.id == job_id and client.lrem(entry.list_name, 1, entry.raw):
            return entry.job
    return None


# Take waiting messages and record them as a worker's, in one step (see `take`).
# KEYS[1]: the workers hash; KEYS[2..]: each message's list. ARGV[1]: the
# worker's name; ARGV[2]: its entry as JSON up to the open `"batch": [`; then
# each message and its job id, quoted as JSON.
_TAKE = """
local taken = {}
for i = 2, #KEYS do
  if redis.call('LREM', KEYS[i], 1, ARGV[2 * i - 1]) == 1 then
    table.insert(taken, ARGV[2 * i])
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. table.concat(taken, ',') .. ']}')
return taken
"""


def take(client: redis.Redis, entries: list[Waiting], worker: str, info: dict) -> list[jobs.Job]:
    """Take ``entries`` out of their queue for ``worker`` (a co-batch) and, in the
    same atomic step, write the worker's registry entry ``info`` with the jobs
    taken as its ``batch``; the jobs taken, in order (others got there first).

    Whoever removes a message owns it: its Celery message never reaches a
    worker. Why one step: between a removal and the registry write, a worker
    that died would hold a job nobody knows of; recorded in the same Lua script,
    the watchdog finds every job of a dead worker (``registry.running_jobs``).
    ``info`` is written as ``registry.register_worker`` writes it."""
    info = {key: value for key, value in info.items() if key != "batch"}
    head = json.dumps(dict(info, last_seen=time.time()))[:-1] + (', "batch": [' if info else '"batch": [')
    keys = [registry.WORKERS] + [entry.list_name for entry in entries]
    args = [worker, head]
    for entry in entries:
        args += [entry.raw, json.dumps(entry.job.id)]
    taken = {json.loads(raw) for raw in client.eval(_TAKE, len(keys), *keys, *args)}
    return [entry.job for entry in entries if entry.job.id in taken]


def drain(client: redis.Redis, queue: str) -> list[jobs.Job]:
    """Take every waiting job out of ``queue`` (to fail them all with one reason)."""
    taken = []
    for name in lists(queue):
        while True:
            raw = client.rpop(name)
            if raw is None:
                break
            job = _decode(raw)
            if job is not None:
                taken.append(job)
    return taken


def model_queues(client: redis.Redis) -> list[str]:
    return sorted(q.decode() for q in client.smembers(registry.QUEUES))


def summary(client: redis.Redis, now: Optional[float] = None) -> list[dict]:
    """Depth and head wait of every model queue that has jobs waiting or a live
    worker consuming it, for ``ndif-celery queue``. A queue's name stays in
    ``registry.QUEUES`` once a job used it (the intake adds it, nothing may
    remove it without racing the next job's push); an empty queue of a model
    nobody holds (its jobs failed, or it was evicted) is left out, not shown
    as a row that never goes away."""
    now = time.time() if now is None else now
    served = {queue_for(entry["model_key"]) for entry in registry.live_deployments(client)}
    rows = []
    for queue in model_queues(client):
        entries = waiting(client, queue)
        if not entries and queue not in served:
            continue
        rows.append(
            {
                "queue": queue,
                "model_key": entries[0].job.model_key if entries else client.hget(registry.QUEUE_MODELS, queue),
                "depth": len(entries),
                "head_wait_s": round(now - min(e.job.received_at for e in entries), 3) if entries else 0.0,
                "jobs": [entry.job.id for entry in entries],
            }
        )
    for row in rows:
        if isinstance(row["model_key"], bytes):
            row["model_key"] = row["model_key"].decode()
    return rows


def model_name(row: dict) -> str:
    """What a person reads for a ``summary`` row: its model's repo id, or the
    queue's own name when no model was ever recorded for it (the CLI, the
    dashboard and the ``ndif_queue_*`` metrics label queues alike)."""
    return wire.repo_id(row["model_key"]) if row["model_key"] else row["queue"]
