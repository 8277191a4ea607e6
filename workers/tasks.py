"""The Celery worker's entry: the app, its tasks, the control command, the signals.

Three kinds of task, all run by the worker's single pool thread, so a load,
an eviction and a job never overlap on one worker:

- ``run_job`` (on a model's queue): a job's life, as named steps in
  ``workers.job.life`` (start -> execute -> deliver, or fail), its block run by an
  executor (``workers.job.executors``). Nothing a job does may take the worker
  down or leak into the next job.
- ``load_model`` / ``evict_model`` (on this worker's own queue) are sent by the
  controller (``ndif_celery.farm.controller``), which runs in every worker's background
  thread and decides placements for the whole farm; ``cleanup_expired`` by
  ``ndif-celery beat``.

What each does is a method of the worker's state (``workers.worker.WorkerState``);
this module only wires Celery to it. ``celery -A workers.tasks:app`` imports
it in the worker, in beat and in Flower, so importing it loads no settings,
edits no environment and imports no torch: the app is configured when Celery
first needs it (``celery_app.lazy_app``), and the worker sets itself up in
Celery's signals, in the order it needs:

1. ``worker_init``: the settings, the environment torch reads
   (``CUDA_VISIBLE_DEVICES``, ``OMP_NUM_THREADS``), the fork server
   (before any client is opened: ``workers.startup``);
2. ``worker_ready`` (or the first task, if one comes first): the
   :class:`~workers.worker.WorkerState` (clients, models, torch), registration,
   heartbeat, controller;
3. ``worker_shutdown``: let go of the zygotes, the controller, the registration.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any, Optional

from celery.signals import worker_init, worker_ready, worker_shutdown
from celery.worker.control import control_command

from ndif_celery import config, messages
from ndif_celery.celery_app import CLEANUP, EVICT_MODEL, LOAD_MODEL, RUN_JOB, lazy_app
from ndif_celery.state import jobs

from . import startup

app = lazy_app()
log = logging.getLogger("ndif_celery.worker")


class ThisWorker:
    """What this worker process holds, made once, in the order of Celery's
    signals: its settings (and environment) at ``worker_init``, its
    ``WorkerState`` when first needed. An object, so no signal handler sets
    module globals."""

    def __init__(self) -> None:
        self.settings: Optional[config.Settings] = None
        self.state: Any = None  # workers.worker.WorkerState, once made
        self.fork_server: Any = None  # workers.isolation.forkserver.ForkServer (NDIF_ISOLATION=fork)
        self._lock = threading.Lock()

    def configure(self) -> config.Settings:
        """The settings, loaded once; the environment torch reads set with them."""
        with self._lock:
            if self.settings is None:
                self.settings = config.load()
                startup.set_environment(self.settings)
            return self.settings

    def get(self, name: Optional[str] = None):
        """The worker's state, made on first use (``worker_ready``, or a task before it)."""
        settings = self.configure()
        with self._lock:
            if self.state is None:
                # Imported here, not at the top: it imports torch, which must come
                # after configure() set the environment; beat and Flower never get here.
                from .worker import WorkerState

                self.state = WorkerState(name or f"worker@{socket.gethostname()}", settings, app)
            return self.state


this_worker = ThisWorker()


# --- tasks ------------------------------------------------------------------------


@app.task(name=RUN_JOB, bind=True)
def run_job(self, job: dict) -> None:
    this_worker.get(self.request.hostname).run(jobs.Job.from_message(job))


@app.task(name=LOAD_MODEL, bind=True)
def load_model(self, model_key: str, dtype: Optional[str] = None, size_bytes: int = 0, evict: tuple = ()) -> None:
    this_worker.get(self.request.hostname).load_model(model_key, dtype, size_bytes, evict)


@app.task(name=EVICT_MODEL, bind=True)
def evict_model(self, model_key: str) -> None:
    this_worker.get(self.request.hostname).evict(model_key)


@app.task(name=CLEANUP, bind=True)
def cleanup_expired(self) -> dict:
    """Sent by ``ndif-celery beat``: delete results and job state past ``NDIF_JOB_TTL_S``."""
    return this_worker.get(self.request.hostname).cleanup()


@control_command(args=[("job_id", str), ("text", str)], signature="<job_id> [text]")
def ndif_kill(panel, job_id: str, text: str = "") -> dict:
    """Cancel a running job on this worker (``ndif-celery kill``, its owner, its
    client gone); ``text`` is the ERROR its client reads."""
    state = this_worker.state
    cancelled = state is not None and state.cancel(job_id, text or messages.CANCELLED)
    return {"ok": "cancelling" if cancelled else "not running here"}


# --- the worker's life ----------------------------------------------------------


@worker_init.connect
def _on_init(**_) -> None:
    """Settings and environment first, then the fork server, from the main
    thread while this process is still clean (``workers.startup``)."""
    this_worker.fork_server = startup.start_fork_server(this_worker.configure())


@worker_ready.connect
def _on_ready(sender, **_) -> None:
    this_worker.get(sender.hostname).ready()


@worker_shutdown.connect
def _on_shutdown(**_) -> None:
    if this_worker.state is not None:
        this_worker.state.shutdown()
    startup.stop_fork_server(this_worker.fork_server)
