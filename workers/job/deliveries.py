"""Results delivered off the forward's path: the worker's delivery thread.

Why: once a job's block has run and its result is encoded, what is left
(upload the result or send it inline, publish COMPLETED, count the job,
delete its payload) needs no model. Done in the job's thread, it kept the
model idle for every request; handed to this thread, it runs while the
worker's next job starts and its forward runs. The model still runs one
forward at a time: only the job's thread touches it.

What stays true (docs/reliability.md):

- **Exactly one final status.** A job's status goes through its own
  ``channel.FinalChannel``, which claims the final status in Redis
  (``claim_final``) whoever sends it: this thread's COMPLETED (or the ERROR of
  a store away), the deadline's watchdog, ``ndif-celery kill`` (``cancel``
  below answers a job waiting here at once; its result is then dropped).
- **No job lost.** A job handed here is still this worker's in its registry
  entry (``WorkerState.registration``'s ``delivering``, read by
  ``registry.running_jobs``) until delivered: if the worker dies first, the
  beat's watchdog runs it again once, or ends it, as for any running job.
- **Bounded memory.** At most one hand-off waits while another is delivered
  (:meth:`Deliveries.hand` blocks until the previous one is taken), and a
  result over :data:`MAX_HANDED_BYTES` is delivered in the job's thread, as
  before: a big result is never held twice.
- **In order.** One thread, hand-offs delivered in the order they came.

``answer`` (``deliver`` or ``fail``) and ``close`` are ``workers.job.life``'s own
steps, passed in, so this module only moves them to another thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Optional

from ndif_celery import messages, wire

log = logging.getLogger("ndif_celery.worker")

#: Results up to this size are delivered by the thread; bigger ones in the job's thread.
MAX_HANDED_BYTES = 16 * 1024 * 1024


class Deliveries:
    """The worker's delivery thread and the jobs handed to it.

    ``answer(life, answer)``: the job's result delivered (COMPLETED), or the
    exception that is its answer sent as its ERROR (``job.answer``);
    ``close(life)``: what it leaves behind (metrics, payload deleted). Both
    are called here for every handed job, in order, and nothing a delivery
    raises stops the thread."""

    def __init__(self, answer: Callable, close: Callable) -> None:
        self._answer, self._close = answer, close
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._lock = threading.Lock()
        self._pending: dict = {}  # job id -> life, from hand() until closed
        self._idle = threading.Condition(self._lock)
        self._thread: Optional[threading.Thread] = None

    def takes(self, data: Any) -> bool:
        """Whether a result of this size is handed here (else delivered in the job's thread)."""
        return memoryview(data).nbytes <= MAX_HANDED_BYTES

    def hand(self, answers: list) -> None:
        """Deliver ``answers`` ((life, result bytes or the exception that is its
        answer) each) in this thread, in order; blocks while an earlier hand-off
        still waits to be taken. Each job is :meth:`delivering` from now on."""
        if not answers:
            return
        with self._lock:
            for life, _ in answers:
                self._pending[life.job.id] = life
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ndif-deliveries", daemon=True)
                self._thread.start()
        try:
            self._queue.put(list(answers))
        except BaseException:  # interrupted while waiting (a kill): not handed, the job's thread answers them
            with self._idle:
                for life, _ in answers:
                    self._pending.pop(life.job.id, None)
                self._idle.notify_all()
            raise

    def delivering(self) -> list[str]:
        """The jobs handed here and not yet closed (for the worker's registry entry)."""
        with self._lock:
            return list(self._pending)

    def cancel(self, job_id: str, text: str = messages.CANCELLED) -> bool:
        """``ndif-celery kill`` of a job waiting here: its cancelled ERROR (``text``) now,
        unless its COMPLETED went first (then its channel keeps that); False
        if the job is not here."""
        with self._lock:
            life = self._pending.get(job_id)
        if life is None:
            return False
        if life.channel.answer(wire.ERROR, text, life.meta, "cancelled"):
            log.warning("job %s: cancelled while its result was being delivered", job_id)
        return True

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Block until every handed job is closed (True), or ``timeout`` passes (False)."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    def _run(self) -> None:
        while True:
            answers = self._queue.get()
            for life, answer in answers:
                try:
                    self._one(life, answer)
                except BaseException:  # noqa: BLE001 - the thread outlives any delivery
                    log.exception("job %s: its delivery failed", life.job.id)
                finally:
                    with self._idle:
                        self._pending.pop(life.job.id, None)
                        self._idle.notify_all()

    def _one(self, life, answer) -> None:
        try:
            if isinstance(answer, BaseException) or getattr(life.channel, "answered_by", None) is None:
                self._answer(life, answer)  # (a result answered meanwhile, by a kill or the deadline: dropped)
        finally:
            self._close(life)
