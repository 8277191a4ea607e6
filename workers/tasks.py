"""The Celery worker: one job at a time against models that stay resident.

``run_job`` is the short story of a job's life on a worker: make sure the model
is here (DEPLOYING), fetch the payload, RUNNING, execute, then COMPLETED with
the result inline or as a URL, or ERROR with the user's own traceback. Nothing
a job does may take the worker down or leak into the next job.

torch and nnsight are imported only inside the worker process, never at import
time, so Flower and the web can import this module cheaply.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Optional

from celery.signals import worker_ready, worker_shutdown

from ndif_celery import config, jobs, registry, wire
from ndif_celery.celery_app import RUN_JOB, make_app

settings = config.load()
app = make_app(settings)
log = logging.getLogger("ndif_celery.worker")


class WorkerState:
    """What lives for the whole worker process: connections, store, resident models."""

    def __init__(self, name: str) -> None:
        from ndif_celery.store import open_store

        from .resident import ResidentModels

        self.name = name
        self.redis = jobs.connect(settings.redis_url)
        self.store = open_store(settings)
        self.models = ResidentModels(self.redis, name)


_state: Optional[WorkerState] = None
_state_lock = threading.Lock()


def state(name: Optional[str] = None) -> WorkerState:
    global _state
    with _state_lock:
        if _state is None:
            _state = WorkerState(name or f"worker@{socket.gethostname()}")
        return _state


@app.task(name=RUN_JOB, bind=True)
def run_job(self, job: dict) -> None:
    run(state(self.request.hostname), jobs.Job.from_message(job))


def run(worker: WorkerState, job: jobs.Job) -> None:
    from . import execute, results

    channel = jobs.StatusChannel(worker.redis, job, settings.job_ttl_s)
    started = time.time()
    meta = {"job_id": job.id, "worker": worker.name, "queue_ms": round((started - job.received_at) * 1000, 1)}
    try:
        model = worker.models.get(job.model_key, lambda text: channel.send(wire.DEPLOYING, text))
        blob = worker.redis.get(jobs.payload_key(job.id))
        if blob is None:
            raise execute.RequestError(
                f"The payload of job {job.id} is gone (it expires after {settings.job_ttl_s} s); please resend."
            )
        channel.send(wire.RUNNING, "Your job has started running.")
        run_started = time.perf_counter()
        with execute.request_scope(model):
            try:
                tracer = execute.deserialize(model, blob, job.compress, job.env)
                meta["deserialize_ms"] = _ms_since(run_started)
                saved = execute.run(tracer, channel.log)
            except Exception as error:  # noqa: BLE001 - user code may raise anything
                # Formatted inside the scope: linecache still holds the user's source.
                raise execute.RequestError(execute.format_user_error(error)) from None
        meta["run_ms"] = _ms_since(run_started)
        data = results.encode(saved, job.compress)
        meta["result_bytes"] = len(data)
        meta["payload_bytes"] = job.payload_bytes
        _deliver(worker, channel, job, data, meta)
    except execute.RequestError as error:
        channel.send(wire.ERROR, str(error), meta=meta)
    except Exception as error:  # noqa: BLE001 - a server fault still ends the job visibly
        log.exception("job %s failed on the server", job.id)
        channel.send(wire.ERROR, f"Server error while running your job: {type(error).__name__}: {error}", meta=meta)
    finally:
        worker.redis.delete(jobs.payload_key(job.id))


def _deliver(worker: WorkerState, channel: jobs.StatusChannel, job: jobs.Job, data: bytes, meta: dict) -> None:
    """Inline on the websocket when small, else through the store as a URL."""
    from . import results

    description = "Your job has been completed."
    if job.session_id and len(data) <= settings.max_inline_bytes:
        meta["inline"] = True
        latest = wire.response_json(
            job.id, wire.COMPLETED, description + " Its result was delivered over the websocket.", meta=meta
        )
        channel.send_binary(results.completed_frame(job.id, description, data, meta), latest)
        return
    key = f"results/{job.id}.pt"
    upload_started = time.perf_counter()
    worker.store.put(key, data)
    meta["upload_ms"] = _ms_since(upload_started)
    meta["inline"] = False
    channel.send(wire.COMPLETED, description, data=worker.store.url(key), meta=meta)


def _ms_since(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 1)


# --- worker lifecycle -----------------------------------------------------------


@worker_ready.connect
def _on_ready(sender, **_) -> None:
    """Register, consume every known model queue, and keep a heartbeat."""
    worker = state(sender.hostname)
    # Import the heavy stack now, not during the first job.
    import nnsight.modeling.transformers  # noqa: F401
    import torch  # noqa: F401

    for queue in worker.redis.smembers(registry.QUEUES):
        sender.add_task_queue(queue.decode())
    worker.redis.set(registry.ENV, _env_json())
    info = {
        "name": worker.name,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started_at": time.time(),
    }
    registry.register_worker(worker.redis, info)
    thread = threading.Thread(target=_heartbeat, args=(worker, info), name="ndif-heartbeat", daemon=True)
    thread.start()
    log.info("worker %s ready", worker.name)


def _heartbeat(worker: WorkerState, info: dict) -> None:
    while True:
        time.sleep(registry.HEARTBEAT_S)
        try:
            registry.register_worker(worker.redis, dict(info, models=worker.models.keys()))
        except Exception:  # noqa: BLE001 - a broker blip must not kill the heartbeat
            log.warning("heartbeat failed", exc_info=True)


@worker_shutdown.connect
def _on_shutdown(**_) -> None:
    if _state is not None:
        registry.unregister_worker(_state.redis, _state.name)


def _env_json() -> str:
    import json

    from ndif_celery.environment import local_env

    return json.dumps(local_env())
