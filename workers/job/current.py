"""The worker's job slot: the job it runs now, for the watchdog and ``ndif-celery kill``.

Celery keeps its worker's request bookkeeping in a module below the worker
(``celery.worker.state``); this is ours. :class:`CurrentJob` holds the job id,
its thread, its co-batch and the ERROR texts of kills, and writes them into
the worker's registry entry. The worker passes in what it owns: its Redis,
its name, the lock of its registry entry (its heartbeat writes the same
entry) and how to build that entry. So this module never imports
``workers.worker``, and a test drives the slot without a whole worker.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Callable, Optional

import redis

from ndif_celery import statuses
from ndif_celery.state import jobs, queues, registry

log = logging.getLogger("ndif_celery.worker")


class CurrentJob:
    """The job a worker runs now, its thread, its co-batch, and kills' ERROR texts.

    ``entry_lock``: held by every writer of the worker's registry entry.
    ``registration()``: that whole entry, this slot's part (:meth:`entry`) included."""

    def __init__(self, client: redis.Redis, worker_name: str, job_ttl_s: float, entry_lock: threading.Lock,
                 registration: Callable[[], dict]) -> None:
        self.redis = client
        self.worker_name = worker_name
        self.job_ttl_s = job_ttl_s
        self.entry_lock = entry_lock
        self.registration = registration
        self.job_id: Optional[str] = None
        self.thread: Optional[int] = None
        self.batch: tuple = ()  # the current job's co-batch: jobs taken out of the queue with it
        self.cancel_texts: dict = {}  # job id -> the ERROR of a cancel landing in its thread (life.fail)
        self._lock = threading.Lock()

    def entry(self) -> dict:
        """This slot's part of the worker's registry entry: the job, its co-batch."""
        return {"current_job": self.job_id, "batch": list(self.batch)}

    def begin(self, job_id: str, pipe) -> None:
        """Report the job as this worker's (for the watchdog) in ``pipe``, run by
        this thread; a job of the running co-batch is already reported."""
        with self._lock:
            if job_id not in self.batch:
                self.job_id, self.thread, self.batch = job_id, threading.get_ident(), ()
            registry.register_worker(pipe, self.registration())

    def take(self, waiting: list) -> list[jobs.Job]:
        """Take these waiting jobs (``queues.Waiting``) out of their queue as the
        running job's co-batch: removed and reported as this worker's in one
        Redis step (``queues.take``), so none is lost if this process dies."""
        with self.entry_lock:  # the heartbeat writes the same entry
            with self._lock:  # from here on a kill does not interrupt this thread (see cancel)
                self.batch = tuple(entry.job.id for entry in waiting)
            taken = queues.take(self.redis, waiting, self.worker_name, self.registration())
            self.batch = tuple(job.id for job in taken)
        return taken

    def take_next(self, waiting: queues.Waiting) -> Optional[jobs.Job]:
        """Take this waiting job out of its queue as the worker's next current
        job (``gather.next_job``), removed and reported in one Redis step
        (``queues.take``); None when another worker got it first. Until it
        starts (``begin``) it has no thread to interrupt: a kill meanwhile
        answers it from here (``cancel``), and ``life.start`` then skips it."""
        with self.entry_lock:
            with self._lock:
                self.job_id, self.thread, self.batch = waiting.job.id, None, ()
            taken: list = []
            try:
                taken = queues.take(self.redis, [waiting], self.worker_name, self.registration())
            finally:
                if not taken:
                    # Not ours (or the broker went away mid-step: if it was taken, the next
                    # heartbeat stops naming it, and the watchdog finds it lost and sends it again).
                    with self._lock:
                        self.job_id = None
        return taken[0] if taken else None

    def end(self) -> None:
        """The job (and its co-batch) is answered: this worker runs nothing, and
        says so in its registry entry now, not at the next heartbeat (``/status``,
        the watchdog and ``ndif-celery kill`` read it; for up to a heartbeat it
        named a job that had ended)."""
        with self._lock:
            self.job_id, self.thread, self.batch = None, None, ()
        try:
            with self.entry_lock:
                registry.register_worker(self.redis, self.registration())
        except Exception:  # noqa: BLE001 - the next heartbeat writes it; the job is answered
            log.warning("could not clear this worker's current job in its registry entry", exc_info=True)

    def cancel(self, job_id: str, text: str, reason: type) -> bool:
        """Kill ``job_id`` if it is this slot's: ``reason`` raised in its thread at
        its next Python instruction, and ``text`` kept for the ERROR it sends.
        False when the job is not this slot's, or a co-batch is being taken or
        answered (an interruption would land in another user's delivery)."""
        with self._lock:
            thread = self.thread
            taken = self.job_id == job_id and thread is None and not self.batch
            if not taken:
                if self.job_id != job_id or thread is None or self.batch:
                    return False
                self.cancel_texts[job_id] = text  # for life.fail, where the interruption lands
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(reason))
                return True
        # Taken as the next job (take_next) and not started: answered here; it then starts as ended, and is skipped.
        statuses.answer_for_worker(self.redis, job_id, self.job_ttl_s, f"kill@{self.worker_name}",
                                   text, "cancelled")
        return True
