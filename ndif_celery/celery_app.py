"""The Celery app shared by the web (which only sends) and the workers.

Messages are JSON only: a pickle in the broker would be code execution for
anyone who can write to Redis. The nnsight payload travels by reference (a
Redis key) and is unpickled only by the executor.

Every model key gets its own queue, so a worker consumes exactly the models it
holds; every worker also has its own queue (``ndif.worker.<name>``) on which
the controller sends it loads and evictions, in line with its jobs.
"""

from __future__ import annotations

import hashlib
import re
import socket
from typing import Optional

from celery import Celery, signals

from . import config, log_limits

RUN_JOB = "ndif.run_job"
LOAD_MODEL = "ndif.load_model"
EVICT_MODEL = "ndif.evict_model"
CLEANUP = "ndif.cleanup"
# Housekeeping every worker consumes (the beat's cleanup lands on one of them).
MAINTENANCE_QUEUE = "ndif.maintenance"


def queue_for(model_key: str) -> str:
    """The queue name for a model key: readable, short, and unique.

    Model keys are long JSON-bearing strings; the queue name keeps a slug of
    the repo id for people reading Flower and a hash for uniqueness.
    """
    digest = hashlib.sha256(model_key.encode()).hexdigest()[:12]
    match = re.search(r'"repo_id":\s*"([^"]+)"', model_key)
    label = match.group(1) if match else model_key.split(":", 1)[-1]
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-")[:48] or "model"
    return f"ndif.model.{slug}.{digest}"


# Celery's Redis transport keeps one list per priority step of a queue and
# serves the lower number first; a message with no priority is 0. Ordinary
# jobs are sent at NORMAL, jobs of keys tagged ``priority`` at FIRST.
PRIORITY_FIRST = 0
PRIORITY_NORMAL = 6


def send_job(app: Celery, job) -> None:
    """Put ``job`` (a ``jobs.Job``) on its model's queue, at its priority."""
    app.send_task(
        RUN_JOB, kwargs={"job": job.to_message()}, queue=queue_for(job.model_key), task_id=job.id,
        priority=PRIORITY_FIRST if job.priority else PRIORITY_NORMAL,
    )


def make_app(settings: Optional[config.Settings] = None) -> Celery:
    """The app, configured now (the web and the CLI, which only send)."""
    settings = settings or config.load()
    app = Celery("ndif_celery", broker=settings.redis_url, backend=None)
    app.conf.update(celery_conf(settings))
    return app


def lazy_app() -> Celery:
    """The app of a ``celery -A`` command line (the worker, beat, Flower),
    configured from the environment when Celery first needs it, not when its
    module is imported (Celery's ``add_defaults`` promise)."""
    app = Celery("ndif_celery")
    # Celery sets up the logging of the worker and beat; Flower imports the app's modules.
    signals.after_setup_logger.connect(_limit_log_repeats, weak=False, dispatch_uid="ndif-log-limits")
    signals.import_modules.connect(_limit_log_repeats, weak=False, dispatch_uid="ndif-log-limits-import")

    def configure() -> dict:
        settings = config.load()
        return dict(celery_conf(settings), broker_url=settings.redis_url)

    app.add_defaults(configure)
    return app


def _limit_log_repeats(**_) -> None:
    """Every process of a ``celery -A`` command line bounds its repeated log records."""
    settings = config.load()
    log_limits.install(settings.log_repeats, settings.log_repeat_window_s)


def celery_conf(settings: config.Settings) -> dict:
    """Every Celery setting of the farm's app, from ``settings``."""
    return dict(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue="ndif.default",
        task_create_missing_queues=True,
        # Flower lists every task from the worker's events (received, started,
        # succeeded). The web sends no task-sent event: one more Redis publish
        # per request, and its JSON, for a job Flower sees when a worker takes it.
        worker_send_task_events=True,
        task_send_sent_event=False,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            # A job is redelivered only after this long without an ack; it must
            # exceed the longest job, so a slow job is never run twice.
            "visibility_timeout": settings.visibility_timeout_s,
        },
        worker_cancel_long_running_tasks_on_connection_loss=False,
        # Run by `ndif-celery beat` (one per farm); a sweep nobody picked up
        # before the next one is due is dropped rather than piled up.
        beat_schedule={
            "ndif-cleanup": {
                "task": CLEANUP,
                "schedule": settings.cleanup_interval_s,
                "options": {"queue": MAINTENANCE_QUEUE, "expires": settings.cleanup_interval_s},
            },
        },
    )


def worker_queue(name: str) -> str:
    """The queue only the worker ``name`` consumes."""
    return f"ndif.worker.{name}"


def default_worker_name(gpus: str = "", nnsight: str = "") -> str:
    """Named by host and GPUs (and a runtime's nnsight), so a farm's Flower reads like its hardware."""
    devices = "gpu" + "-".join(g.strip() for g in gpus.split(",") if g.strip()) if gpus.strip() else "cpu"
    runtime = f"-nnsight{nnsight}" if nnsight else ""
    return f"{devices}{runtime}@{socket.gethostname()}"


def worker_argv(settings: config.Settings, name: Optional[str] = None) -> list[str]:
    """Arguments for ``celery worker``: one job at a time, in one resident process.

    The thread pool with concurrency 1 keeps the model in the worker's own
    process (so it stays resident between jobs) while the main thread keeps
    answering control commands and sending heartbeats during a long job.
    """
    name = name or settings.worker_name or default_worker_name(settings.worker_gpus, settings.worker_nnsight)
    return [
        "worker",
        "--pool=threads",
        "--concurrency=1",
        "--prefetch-multiplier=1",
        "--without-mingle",
        "-E",
        f"--hostname={name}",
        f"--queues={worker_queue(name)},{MAINTENANCE_QUEUE}",
        f"--loglevel={settings.log_level}",
    ]
