"""A job's one final status, claimed in this process and across processes.

A job's final status (COMPLETED or ERROR) has two possible authors in its
worker: the job's own thread, and the deadline's watchdog
(``workers.job.deadline``), which answers a job that overran or was killed
without waiting for its thread. :class:`FinalChannel` lets the first send it
and drops the other's, so a job that unwinds late publishes no second status
and no result. Other processes may answer too (the beat's watchdog,
``ndif-celery kill``): every author claims the final status in Redis first
(``StatusChannel.claim_final``), so the one that comes second drops its answer.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Optional

from ndif_celery import statuses, wire

log = logging.getLogger("ndif_celery.worker")

JOB, DEADLINE = "job", "deadline"  # the two authors of a final status in this process
ELSEWHERE = "elsewhere"  # the beat's watchdog or `ndif-celery kill` claimed it first


class FinalChannel(statuses.StatusChannel):
    """A job's status channel whose final status (COMPLETED or ERROR) is sent
    once: by the job's own thread, or by the watchdog, whichever comes first."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._answer_lock = threading.Lock()
        self.answered_by: Optional[str] = None
        self.token = uuid.uuid4().hex  # this worker's claim on the final status in Redis

    def claim(self, by: str) -> bool:
        """True if ``by`` may send the final status (it is first, or already sent it)."""
        with self._answer_lock:
            if self.answered_by is None:
                self.answered_by = by if self.claim_final(self.token) else ELSEWHERE
            return self.answered_by == by

    def send(self, status: str, description: str = "", data=None, meta: Optional[dict] = None, kind: str = "",
             pipe=None) -> None:
        if status in wire.TERMINAL and not self.claim(JOB):
            log.info("job %s: its %s came after the deadline's answer; dropped", self.job.id, status)
            return
        super().send(status, description, data, meta, kind, pipe)

    def send_binary(self, frame: bytes, latest: str) -> bool:
        if not self.claim(JOB):
            log.info("job %s: its result came after the deadline's answer; dropped", self.job.id)
            return True  # answered: nothing to store either
        return super().send_binary(frame, latest)

    def answer(self, status: str, description: str, meta: Optional[dict], kind: str) -> bool:
        """The watchdog's final status; False when the job's thread answered first."""
        if not self.claim(DEADLINE):
            return False
        try:
            super().send(status, description, meta=meta, kind=kind)
        except BaseException:
            with self._answer_lock:
                self.answered_by = None  # not sent: the job's own thread may still answer
            raise
        return True
