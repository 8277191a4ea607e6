"""Deadlines that always fire, and ``ndif-celery kill`` by the same road.

Why a watchdog thread, and not a timer that only interrupts the job's thread:
an exception raised in a thread (``PyThreadState_SetAsyncExc``) lands at that
thread's next Python instruction, so user code blocked in C (``time.sleep``, a
long torch op, a ``read`` on a pipe, ``libc.pause``) kept the worker, and its
client, waiting far past ``NDIF_EXECUTION_TIMEOUT_S``. Here the *answer* no
longer depends on the job's thread:

1. at the deadline (or when the operator kills the job) the :class:`DeadlineWatchdog`,
   a thread of its own, publishes the job's ERROR itself, at once;
2. then it raises :class:`~workers.job.executors.JobTimedOut` (or
   ``JobCancelled``) in the job's thread, again every :data:`RETRY_S` (user
   code may swallow one);
3. if that thread has not left the executor within ``NDIF_DEADLINE_GRACE_S``,
   the worker replaces itself (``WorkerState.replace``): it lets go of what it
   holds in Redis and its children, logs ``replacing this worker: job X did
   not unwind``, counts it (``ndif_worker_replacements_total``) and exits with
   ``exit_codes.REPLACE_EXIT_CODE``, which ``ndif-celery up``'s supervisor (and
   the deploy recipes' restart policies) answers with a fresh process at once.
   The fresh process loads the model again when the controller places it.

Exactly one final status: a job's ``channel.FinalChannel`` lets the first of
its two possible authors (the job's own thread, the watchdog) send COMPLETED
or ERROR and drops the other's, so a job that unwinds late publishes no
second status and no result. Nothing queued is lost by the replacement: the worker runs one
job at a time with a prefetch of one (``celery_app.worker_argv``), so the only
message it holds unacknowledged is the stuck job's; after the visibility
timeout the broker hands it out again and ``life.start`` drops it, because the
job has ended.

Both executors arm a watch (``executors``): the trusted one at the limit
(this is its deadline), the isolated one at the limit plus
:data:`ISOLATED_MARGIN_S`, a backstop behind the isolation policy's own
deadline, which kills the child and normally answers first.

User code that *holds the GIL* in C (``sum(range(10**15))``, a catastrophic
regex) starves every thread of this process, the watchdog included: no
Python runs until that call returns. Two things need no Python here:

* the watch records its deadline in Redis (``jobs.DEADLINES``), and the beat's
  watchdog (``ndif_celery.farm.watchdog``) answers a job still running
  :data:`~ndif_celery.farm.watchdog.OVERDUE_S` past it with the timeout ERROR;
* a trusted job arms :func:`backstop`, ``faulthandler``'s C-level timer, at
  the deadline plus the grace plus :data:`BACKSTOP_MARGIN_S`: if the process
  is still there (the replacement above could not run), it dumps every
  thread's stack to the worker's log ("Timeout (...)!") and exits with
  status 1, and the supervisor starts a fresh process.

Exactly one final status across processes too: every author claims it in
Redis first (``StatusChannel.claim_final``), so a worker that answers late
drops its answer there as it does here.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

from ndif_celery import messages, statuses, wire
from ndif_celery.state import jobs
from workers import metrics

log = logging.getLogger("ndif_celery.worker")

#: How often the interruption is raised again while the job's thread has not unwound.
RETRY_S = 0.5
#: The isolated path's backstop comes this long after the isolation policy's own deadline.
ISOLATED_MARGIN_S = 2.0
#: What the worker may spend letting go of its children and its registry entry before it exits.
CLEANUP_S = 3.0
#: The process's last resort comes this long after the grace (the replacement's cleanup fits before it).
BACKSTOP_MARGIN_S = CLEANUP_S + 2.0
#: The ERROR of a job the operator killed while it ran.
CANCELLED = messages.CANCELLED

@dataclass
class Watch:
    """The job being watched: one at a time per worker (one pool thread), or
    one co-batch (``workers.job.gather``): its lead and ``others``, one thread, one
    deadline, every job answered at it."""

    job_id: str
    channel: statuses.StatusChannel
    meta: dict
    thread: int
    deadline: float  # time.monotonic()
    fired: Optional[type] = None  # the exception raised in the job's thread, once fired
    stuck_at: float = 0.0  # monotonic: not unwound by then, the worker is replaced
    retry_at: float = 0.0
    started: float = field(default_factory=time.monotonic)
    others: tuple = ()  # a co-batch's other jobs: (job id, channel, meta) each
    cancelled: set = field(default_factory=set)  # jobs of a co-batch killed (and answered) alone

    def members(self) -> list[tuple]:
        """(job id, channel, meta) of every job still to be answered here."""
        return [m for m in ((self.job_id, self.channel, self.meta), *self.others) if m[0] not in self.cancelled]


class DeadlineWatchdog:
    """One thread per worker process, watching the job its pool thread runs.

    ``errors``: (timed out, cancelled) exception classes to raise in the job's
    thread (``executors.JobTimedOut``, ``JobCancelled``, passed in so this
    module imports no executor). ``on_stuck(job_id)`` replaces the worker; it
    does not return."""

    def __init__(self, timeout_s: float, grace_s: float, errors: tuple,
                 on_stuck: Callable[[str, str], None]) -> None:
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.timed_out_error, self.cancelled_error = errors
        self.on_stuck = on_stuck
        self._cond = threading.Condition()
        self._watch: Optional[Watch] = None
        self._thread: Optional[threading.Thread] = None

    @contextlib.contextmanager
    def watch(self, job_id: str, channel: statuses.StatusChannel, meta: dict, seconds: float, others: tuple = ()):
        """Watch the calling thread's job for ``seconds`` (its deadline), until
        the block exits; with ``others`` ((job id, channel, meta) each), a
        co-batch led by ``job_id``, under the same deadline."""
        watch = Watch(job_id, channel, meta, threading.get_ident(), time.monotonic() + seconds, others=tuple(others))
        with self._cond:
            self._ensure_thread()
            self._watch = watch
            self._cond.notify()
        try:
            # For the beat, in case this process cannot answer (user code holding the GIL);
            # after the watch is set, so a job the beat can see is one a kill here finds.
            channel.redis.zadd(jobs.DEADLINES, {m[0]: time.time() + seconds for m in watch.members()})
            yield watch
        finally:
            self._unwatch(watch)

    def _unwatch(self, watch: Watch) -> None:
        """Disarm ``watch``, even if an interruption lands meanwhile: one raised
        just before the block ended may land here, and must not leave the job
        armed (its worker would be replaced for a job that unwound). Raised
        again once disarmed: ``job.run`` answers it (or drops it, answered)."""
        landed = None
        while True:
            try:
                with self._cond:
                    if self._watch is watch:
                        self._watch = None
                    self._cond.notify()
                break
            except (self.timed_out_error, self.cancelled_error) as error:
                landed = error
        try:
            watch.channel.redis.zrem(jobs.DEADLINES, watch.job_id, *(m[0] for m in watch.others))
        except Exception:  # noqa: BLE001 - the beat finds the job answered, and drops the entry itself
            log.warning("job %s: could not clear its deadline", watch.job_id, exc_info=True)
        if landed is not None:
            raise landed

    def kill(self, job_id: str, text: str = CANCELLED) -> bool:
        """``ndif-celery kill``: the job's ERROR (``text``) now, then the interruption and
        the grace period, as at a deadline. False when this worker does not
        watch that job (it is not in its executor). One job of a co-batch whose
        other jobs still run is answered alone and not interrupted (the thread
        runs the others too); its result is dropped by its channel."""
        with self._cond:
            watch = self._watch
            members = [] if watch is None or watch.fired else watch.members()
            member = next((m for m in members if m[0] == job_id), None)
            if member is None:
                return False
            alone = len(members) == 1
            if not alone:
                watch.cancelled.add(job_id)
        if alone:
            self.fire(watch, self.cancelled_error, text)
        else:
            self._answer(member, text, "cancelled", watch.started)
        return True

    def fire(self, watch: Watch, error: type, cancelled_text: str = CANCELLED) -> None:
        """Answer the job (every job of a co-batch) with its ERROR (unless its
        thread answered first), then interrupt its thread and start the grace period."""
        with self._cond:
            if watch.fired is not None or self._watch is not watch:
                return  # fired already, or the job has left its executor
            watch.fired = error
            watch.stuck_at = time.monotonic() + self.grace_s
            members = watch.members()
        cancelled = error is self.cancelled_error
        text = cancelled_text if cancelled else messages.timed_out(self.timeout_s)
        kind = "cancelled" if cancelled else "timeout"
        for member in members:
            self._answer(member, text, kind, watch.started)
        self._interrupt(watch)
        with self._cond:
            self._cond.notify()
        try:
            metrics.deadline_fired(kind)
        except Exception:  # noqa: BLE001 - metrics never fail a job
            log.warning("worker metrics failed", exc_info=True)

    def _answer(self, member: tuple, text: str, kind: str, started: float) -> None:
        job_id, channel, meta = member
        try:
            answered = channel.answer(wire.ERROR, text, meta, kind)
        except Exception:  # noqa: BLE001 - the broker away: the job's own thread may still answer
            log.exception("job %s: could not publish its %s ERROR", job_id, kind)
            answered = False
        if answered:
            log.warning("job %s: %s after %.1f s; its ERROR sent", job_id,
                        "cancelled" if kind == "cancelled" else "past its deadline",
                        time.monotonic() - started)

    def _interrupt(self, watch: Watch) -> None:
        with self._cond:
            if self._watch is not watch:
                return  # unwound meanwhile: raising now would land in the next step
            watch.retry_at = time.monotonic() + RETRY_S
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(watch.thread), ctypes.py_object(watch.fired))

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="ndif-deadline", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                watch = self._watch
                now = time.monotonic()
                if watch is None:
                    self._cond.wait()
                    continue
                if watch.fired is None:
                    if now < watch.deadline:
                        self._cond.wait(watch.deadline - now)
                        continue
                    action = "fire"
                elif now >= watch.stuck_at:
                    action = "stuck"
                elif now >= watch.retry_at:
                    action = "retry"
                else:
                    self._cond.wait(min(watch.stuck_at, watch.retry_at) - now)
                    continue
            if action == "fire":
                self.fire(watch, self.timed_out_error)
            elif action == "retry":
                self._interrupt(watch)
            else:
                self.on_stuck(watch.job_id, f"{self.grace_s:g} s after its "
                              f"{'cancel' if watch.fired is self.cancelled_error else 'deadline'}; its thread "
                              f"is at:\n{where(watch.thread)}")
                return  # on_stuck does not return; in tests it may


@contextlib.contextmanager
def backstop(seconds: float):
    """The trusted path's last resort: exit this process after ``seconds``
    unless the block ends first, even if no Python can run (``faulthandler``'s
    timer is a C thread that needs no GIL). It writes every thread's stack to
    the worker's stderr (its log) before it exits with status 1."""
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def where(thread: int, frames: int = 12) -> str:
    """The innermost ``frames`` of ``thread``'s stack, for the log."""
    frame = sys._current_frames().get(thread)
    return "".join(traceback.format_stack(frame)[-frames:]) if frame is not None else "(the thread has ended)"
