"""A job's statuses, published where its client sees them: the status channel.

Why a module of its own, above ``jobs``: a terminal status does more than
publish. In the same Redis pipeline it frees the key's concurrency slot
(``limits``), queues the job's summary for the ledger (``ledger``) and counts it
in the farm's metrics (``metrics``); those modules build on ``jobs`` (key names,
``Job``), so publishing sits above all of them and the imports go one way:
``statuses -> limits, ledger, metrics -> jobs``.

Every status is PUBLISHed to the job's session channel (blocking jobs) and every
non-LOG status is stored as the job's latest (``jobs.status_key``), which
``GET /response/<id>`` returns.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

import redis

from . import output_bounds
from . import socketio_wire, wire
from .accounts import ledger, limits
from .monitoring import metrics
from .state import byte_quotas, jobs

# LOG limits per job when the caller names none (the worker passes its settings).
DEFAULT_LOG_LINES_PER_S = 100.0
DEFAULT_LOG_BYTES_PER_JOB = 4 * 1024 * 1024


class StatusChannel:
    """Publishes a job's statuses where its client can see them.

    A blocking client listens on its session channel; a non-blocking client
    polls the latest-status key. Both are written for every non-LOG status, so a
    blocking client that lost its socket can still poll.
    """

    def __init__(self, client: redis.Redis, job: jobs.Job, ttl_s: int, log_lines_per_s: float = DEFAULT_LOG_LINES_PER_S,
                 log_bytes_per_job: int = DEFAULT_LOG_BYTES_PER_JOB) -> None:
        self.redis = client
        self.job = job
        self.ttl_s = ttl_s
        self.logs = output_bounds.LogLimiter(log_lines_per_s, log_bytes_per_job)

    def claim_final(self, token: str) -> bool:
        """Whether ``token``'s author may send the job's final status: the first
        to ask, across processes (SET NX), or the one that already holds it.

        A job's final status has up to three authors in three processes: the
        worker (the job's thread, or its deadline watchdog), the beat's
        watchdog (a job past its deadline whose worker cannot answer: user code
        holding the GIL) and ``ndif-celery kill`` (a worker that does not reply).
        The first claim wins; the others drop what they had."""
        key = jobs.final_key(self.job.id)
        if self.redis.set(key, token, nx=True, ex=self.ttl_s):
            return True
        return self.redis.get(key) == token.encode()

    def send(
        self,
        status: str,
        description: str = "",
        data: Any = None,
        meta: Optional[dict] = None,
        kind: str = "",
        pipe=None,
    ) -> None:
        """``kind``: what sort of ERROR this is, for the ledger and metrics
        (see ``ndif_celery.accounts.ledger``). With ``pipe`` (a pipeline the caller
        executes), the writes join it: one round trip with the caller's own.

        Every description is bounded (``bounds.truncate``): user code chooses
        what it prints and what its errors say, and a status is published,
        stored for ``NDIF_JOB_TTL_S`` and copied into the ledger."""
        description = output_bounds.truncate(description or "", output_bounds.DESCRIPTION_BYTES)
        if self.job.protocol:  # a 0.6/0.7 client crashes on a status its enum lacks (DEPLOYING)
            status = socketio_wire.status(status)
        message = wire.response_json(self.job.id, status, description, data, meta)
        own = pipe is None
        pipe = self.redis.pipeline(transaction=False) if own else pipe
        if status in wire.TERMINAL:
            self._log_note(pipe, final=True)  # what LOG output was dropped, before the job's last word
        if status != wire.LOG:
            pipe.set(jobs.status_key(self.job.id), message, ex=self.ttl_s)
        if status in wire.TERMINAL:
            _release(pipe, self.job, self.ttl_s, len(message))
            _record(pipe, self.job, status, description, meta, kind)
        if self.job.session_id:
            pipe.publish(jobs.session_channel(self.job.session_id), message)
        if own:
            pipe.execute()

    def send_binary(self, frame: bytes, latest: str) -> bool:
        """Publish a pickled COMPLETED frame (inline result) to the websocket;
        False if nobody was listening (the client went away), and nothing is
        recorded. ``latest`` is the JSON stored for pollers, who cannot
        receive bytes."""
        note = self.logs.note(final=True)
        if note:
            self.redis.publish(jobs.session_channel(self.job.session_id), wire.response_json(self.job.id, wire.LOG, note))
        if not self.redis.publish(jobs.session_channel(self.job.session_id), frame):
            return False
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(jobs.status_key(self.job.id), latest, ex=self.ttl_s)
        _release(pipe, self.job, self.ttl_s, len(latest))
        stored = json.loads(latest)
        _record(pipe, self.job, stored["status"], stored.get("description") or "", stored.get("meta"), "")
        pipe.execute()
        return True

    def log(self, line: str) -> None:
        """One LOG line (a print of the user's code), bounded in length and
        rate-limited per job (``bounds.LogLimiter``): over the limits lines
        are dropped, and one note says how many."""
        line = output_bounds.truncate(line, output_bounds.LOG_LINE_BYTES)
        if not self.logs.admit(len(line)):
            return
        pipe = self.redis.pipeline(transaction=False)
        self._log_note(pipe)
        self.send(wire.LOG, line, pipe=pipe)
        pipe.execute()

    def _log_note(self, pipe, final: bool = False) -> None:
        note = self.logs.note(final)
        if note and self.job.session_id:  # LOG is never stored: only a listener can see it
            pipe.publish(jobs.session_channel(self.job.session_id), wire.response_json(self.job.id, wire.LOG, note))


def answer_for_worker(client: redis.Redis, job_id: str, ttl_s: int, token: str, description: str,
                      kind: str) -> bool:
    """A running job's ERROR sent from outside its worker, which cannot answer
    (the beat past its deadline, ``ndif-celery kill`` of a worker that does not
    reply): claimed like every final status (:meth:`StatusChannel.claim_final`),
    so never twice. False when the job ended (or expired), or another author
    claimed it first."""
    raw = client.get(jobs.message_key(job_id))
    if raw is None or jobs.finished(client, job_id):
        return False
    channel = StatusChannel(client, jobs.Job.from_message(json.loads(raw)), ttl_s)
    if not channel.claim_final(token):
        return False
    channel.send(wire.ERROR, description, kind=kind)
    return True


def _release(pipe, job: jobs.Job, ttl_s: int, status_bytes: int) -> None:
    """What a terminal status also does: free the key's concurrency slot and
    its payload (a job cancelled unrun keeps no bytes), count the stored status
    among its key's parked bytes, note when the job ended (for the cleanup),
    and keep its owner as long as its status."""
    limits.release(pipe, job)
    pipe.delete(jobs.payload_key(job.id))
    byte_quotas.PARKED.release(pipe, [byte_quotas.payload_entry(job.id)])
    byte_quotas.PARKED.add(pipe, job.owner, byte_quotas.records_entry(job.id), status_bytes)
    pipe.zadd(jobs.ENDED, {job.id: time.time()})
    pipe.zrem(jobs.OPEN, job.id)
    pipe.expire(jobs.owner_key(job.id), ttl_s)


def _record(pipe, job: jobs.Job, status: str, description: str, meta: Optional[dict], kind: str) -> None:
    """What else a terminal status does, off the hot path: queue the job's
    summary for the ledger database and count it in the farm's metrics."""
    entry = ledger.summary(job, status, description, meta, kind)
    ledger.push(pipe, entry)
    metrics.record_job(pipe, entry)
