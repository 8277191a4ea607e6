"""Operator actions on a running farm, as the CLI offers them.

Each one writes the operator's wish where the controller reads it (Redis) or
sends a worker a task on its own queue, then wakes the controller; none of
them needs torch. ``deploy`` records a wish the controller keeps true (pinned,
replica count, dtype), so it survives worker restarts.
"""

from __future__ import annotations

import json
import time
from typing import Optional

import redis

from ndif_celery import messages, statuses, wire
from ndif_celery.celery_app import EVICT_MODEL, worker_queue
from ndif_celery.policy import client_versions, held_formats
from ndif_celery.policy import model_policy
from ndif_celery.state import jobs, queues, registry

DEFAULT_CLASS = "nnsight.modeling.transformers.TransformersModel"


class FarmError(Exception):
    """An operator action that cannot be done; the message says why."""


def model_key_for(model: str, task: str = "text-generation", revision: Optional[str] = None,
                  nnsight: str = "", dtype: Optional[str] = None) -> str:
    """A full model key from a repo id (or a key), exactly as the nnsight client
    builds it: canonical and checked by ``policy.model_policy.parse``, as the web's are.
    ``nnsight``: a runtime's deployment of it (docs/versions.md). ``dtype``: a
    quantization makes it that quantized deployment (a float leaves the key as it is)."""
    if ":" not in model:
        suffix = {'repo_id': model, 'revision': revision, 'task': task}
        if client_versions.as_runtime(nnsight):
            suffix[model_policy.RUNTIME_FIELD] = nnsight
        if dtype and held_formats.is_quantized(dtype):
            suffix[model_policy.HELD_FIELD] = held_formats.canonical_quantization(dtype)
        model = f"{DEFAULT_CLASS}:{json.dumps(suffix)}"
    return model_policy.parse(model).key


def deploy(client: redis.Redis, model_key: str, pinned: bool, replicas: int, dtype: Optional[str]) -> None:
    """The operator's own wish (``source: cli``): a deployments file's ``--sync``
    leaves it alone (``ndif_celery.farm.deployments``)."""
    if replicas < 1:
        raise FarmError("--replicas must be at least 1")
    pipe = client.pipeline()
    registry.forget_load_failures(client, pipe, [model_key])  # asked again: every worker may try it
    pipe.hset(registry.DESIRED, model_key,
              json.dumps({"pinned": pinned, "replicas": replicas, "dtype": dtype, "source": "cli"}))
    pipe.execute()
    registry.wake_controller(client, "deploy")


def wait_running(client: redis.Redis, model_key: str, replicas: int, timeout: float,
                 since: float = 0.0) -> list[dict]:
    """Wait until ``replicas`` workers hold the model, RUNNING; fail at once when the
    controller marks the wish failed after ``since`` (every worker that could take
    it failed to load it), naming the workers and their reasons."""
    deadline = time.monotonic() + timeout
    repo = wire.repo_fields(model_key)["repo_id"]
    while True:
        running = [d for d in holders(client, model_key) if d["state"] == registry.RUNNING]
        if len(running) >= replicas:
            return running
        why = registry.unmet(client).get(model_key)
        if why and why.get("failed") and why.get("at", 0) >= since:
            raise FarmError(f"{repo}: {why['reason']}")
        if time.monotonic() > deadline:
            now = f": {why['reason']}" if why else ""
            raise FarmError(
                f"{repo}: {len(running)} of {replicas} replicas running after {timeout:.0f} s{now}; "
                "see `ndif-celery deployments` and the worker logs"
            )
        time.sleep(0.2)


def wait_replicas_at_most(client: redis.Redis, model_key: str, replicas: int, timeout: float) -> None:
    """Wait until at most ``replicas`` workers hold the model (a scale down)."""
    deadline = time.monotonic() + timeout
    while len(holders(client, model_key)) > replicas:
        if time.monotonic() > deadline:
            raise FarmError(f"still on more than {replicas} workers after {timeout:.0f} s "
                            "(a worker finishes its running job first)")
        time.sleep(0.2)


def holders(client: redis.Redis, model_key: str) -> list[dict]:
    return [d for d in registry.live_deployments(client) if d["model_key"] == model_key]


def evict(client: redis.Redis, celery_app, model_key: str) -> list[str]:
    """Forget the wish and tell every worker holding the model to let it go."""
    pipe = client.pipeline()
    forget_wish(client, pipe, model_key)
    pipe.execute()
    return send_evictions(client, celery_app, model_key)


def forget_wish(client: redis.Redis, pipe, model_key: str) -> None:
    """Queue on ``pipe`` the removal of the model's wish and failed loads (a file's
    ``--sync`` removes several in one transaction with its other writes)."""
    registry.forget_load_failures(client, pipe, [model_key])
    pipe.hdel(registry.DESIRED, model_key)


def send_evictions(client: redis.Redis, celery_app, model_key: str) -> list[str]:
    """Tell every worker holding the model to let it go; the workers told."""
    workers = [d["worker"] for d in holders(client, model_key)]
    for worker in workers:
        celery_app.send_task(EVICT_MODEL, kwargs={"model_key": model_key}, queue=worker_queue(worker))
    return workers


def wait_evicted(client: redis.Redis, model_key: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while holders(client, model_key):
        if time.monotonic() > deadline:
            raise FarmError(f"still held after {timeout:.0f} s (a worker finishes its running job first)")
        time.sleep(0.2)


# How long `ndif-celery kill` waits for workers' answers (the running worker's comes in milliseconds).
KILL_REPLY_S = 2.0


def kill(client: redis.Redis, celery_app, job_id: str, ttl_s: int, text: str = messages.CANCELLED) -> str:
    """End a job: take it out of its queue, or interrupt it where it runs;
    ``text`` is the ERROR its client reads (the operator's, its owner's, its client gone).

    A running job's worker answers the kill itself (``workers.job.deadline``). A
    worker that reports running it but does not reply is held by the job's
    code (a C call that keeps the GIL): the ERROR is sent from here, claimed
    like any final status, and the worker's own backstop restarts it at the
    job's deadline."""
    for queue in queues.model_queues(client):
        job = queues.remove(client, queue, job_id)
        if job is not None:
            statuses.StatusChannel(client, job, ttl_s).send(wire.ERROR, text, kind="cancelled")
            return "removed from the queue"
    # Ask the worker that reports running it (its heartbeat's current_job, or its
    # co-batch), and return on its answer: a broadcast waits out its whole reply timeout.
    runners = [name for name, info in registry.all_workers(client).items() if job_id in registry.running_jobs(info)]
    destination = runners or None  # not reported yet (the job just started): every worker
    started = _running(client, job_id)
    replies = celery_app.control.broadcast("ndif_kill", arguments={"job_id": job_id, "text": text},
                                           destination=destination,
                                           reply=True, timeout=KILL_REPLY_S, limit=len(runners) or None)
    for reply in replies or []:
        for worker, answer in reply.items():
            if answer.get("ok") == "cancelling":
                if not started:
                    # Taken off the queue by a worker as its next job, not begun: that worker
                    # answered its client, and skips it when it comes to it; nothing is interrupted.
                    return f"cancelled before it started: {worker} had taken it from the queue and skips it"
                return f"cancelling on {worker}"
    # Nobody replied. A job still RUNNING has a worker held by its code (or one
    # the beat already buried for its silence): answer for it.
    worker = runners[0] if runners else "its worker"
    if _running(client, job_id) and statuses.answer_for_worker(
            client, job_id, ttl_s, f"kill@{time.time():.3f}", messages.cancelled_unanswered(worker, text),
            "cancelled"):
        return f"ended: {worker} did not reply; it restarts at the job's deadline"
    raise FarmError(f"no job {job_id} is waiting or running")


def _running(client: redis.Redis, job_id: str) -> bool:
    latest = jobs.latest_status(client, job_id)
    return latest is not None and wire.frame_status(latest) == wire.RUNNING


