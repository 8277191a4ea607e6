"""Job state in Redis: payloads, the latest status, and the live status channel.

Everything the web needs to answer about a job lives here, written by whoever
moves the job along (the web on intake, the worker afterwards):

- ``ndif:job:<id>:payload``  the serialized nnsight request, until a worker takes it
- ``ndif:job:<id>:status``   the latest non-LOG status as the JSON the client parses,
                              for ``GET /response/<id>`` (non-blocking jobs, lost clients)
- ``ndif:job:<id>:owner``    who submitted it (``key:<id>`` or ``anonymous``)
- ``ndif:job:<id>:message``  its Celery message body, to run it again if its worker dies
- channel ``ndif:session:<session_id>``  every status of a blocking job, forwarded
                              verbatim to its websocket (``...:owner``: who opened it;
                              ``...:jobs``: the jobs submitted to it)

- zset ``ndif:jobs:ended``     job id -> when it ended, for the cleanup (``ndif_celery.cleanup``)
- list ``ndif:ledger``         summaries of ended jobs for the ledger database (``ndif_celery.ledger``);
                              the final status also counts the job in ``ndif:metrics:*`` (``ndif_celery.metrics``)

All keys expire after ``NDIF_JOB_TTL_S``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import redis

from . import bounds, wire

# LOG limits per job when the caller names none (the worker passes its settings).
DEFAULT_LOG_LINES_PER_S = 100.0
DEFAULT_LOG_BYTES_PER_JOB = 4 * 1024 * 1024

ENDED = "ndif:jobs:ended"


def payload_key(job_id: str) -> str:
    return f"ndif:job:{job_id}:payload"


def status_key(job_id: str) -> str:
    return f"ndif:job:{job_id}:status"


def session_channel(session_id: str) -> str:
    return f"ndif:session:{session_id}"


def session_owner_key(session_id: str) -> str:
    return f"ndif:session:{session_id}:owner"


def session_jobs_key(session_id: str) -> str:
    return f"ndif:session:{session_id}:jobs"


def owner_key(job_id: str) -> str:
    return f"ndif:job:{job_id}:owner"


def message_key(job_id: str) -> str:
    """The job's Celery message body, kept so a job lost with its worker can run again."""
    return f"ndif:job:{job_id}:message"


def lost_key(job_id: str) -> str:
    return f"ndif:job:{job_id}:lost"


@dataclass
class Job:
    """What a worker needs to run a job: the Celery message body (JSON only)."""

    id: str
    model_key: str
    session_id: str = ""
    compress: bool = False
    env: dict = field(default_factory=dict)
    received_at: float = 0.0
    payload_bytes: int = 0
    trusted: bool = True  # stamped by the web from the key; never from the client
    owner: str = "anonymous"
    attempt: int = 1  # 2 when re-run after its first worker died
    priority: bool = False  # the key is tagged ``priority``: served before the others

    def to_message(self) -> dict:
        return asdict(self)

    @classmethod
    def from_message(cls, message: dict) -> "Job":
        return cls(**{k: message[k] for k in cls.__dataclass_fields__ if k in message})


def connect(url: str, outage_s: float = 0.0) -> redis.Redis:
    """A Redis client; with ``outage_s``, one that rides out a Redis restart.

    The web and the workers pass ``NDIF_REDIS_OUTAGE_S``: a command that finds
    Redis gone is retried with backoff for about that long, so a restart (the
    embedded Redis comes back from its append-only file in a second) delays
    requests and status writes instead of failing them. The CLI passes nothing
    and fails at once, which is what someone typing a command wants.
    """
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    retries = int(outage_s / _RETRY_CAP_S) + 4 if outage_s > 0 else 0
    return redis.Redis.from_url(
        url, health_check_interval=30, socket_keepalive=True, socket_connect_timeout=5,
        retry=Retry(ExponentialBackoff(cap=_RETRY_CAP_S, base=0.05), retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )


_RETRY_CAP_S = 0.5


class StatusChannel:
    """Publishes a job's statuses where its client can see them.

    A blocking client listens on its session channel; a non-blocking client
    polls the latest-status key. Both are written for every non-LOG status, so a
    blocking client that lost its socket can still poll.
    """

    def __init__(self, client: redis.Redis, job: Job, ttl_s: int, log_lines_per_s: float = DEFAULT_LOG_LINES_PER_S,
                 log_bytes_per_job: int = DEFAULT_LOG_BYTES_PER_JOB) -> None:
        self.redis = client
        self.job = job
        self.ttl_s = ttl_s
        self.logs = bounds.LogLimiter(log_lines_per_s, log_bytes_per_job)

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
        (see ``ndif_celery.ledger``). With ``pipe`` (a pipeline the caller
        executes), the writes join it: one round trip with the caller's own.

        Every description is bounded (``bounds.truncate``): user code chooses
        what it prints and what its errors say, and a status is published,
        stored for ``NDIF_JOB_TTL_S`` and copied into the ledger."""
        description = bounds.truncate(description or "", bounds.DESCRIPTION_BYTES)
        message = wire.response_json(self.job.id, status, description, data, meta)
        own = pipe is None
        pipe = self.redis.pipeline(transaction=False) if own else pipe
        if status in wire.TERMINAL:
            self._log_note(pipe, final=True)  # what LOG output was dropped, before the job's last word
        if status != wire.LOG:
            pipe.set(status_key(self.job.id), message, ex=self.ttl_s)
        if status in wire.TERMINAL:
            _release(pipe, self.job, self.ttl_s)
            _record(pipe, self.job, status, description, meta, kind)
        if self.job.session_id:
            pipe.publish(session_channel(self.job.session_id), message)
        if own:
            pipe.execute()

    def send_binary(self, frame: bytes, latest: str) -> bool:
        """Publish a pickled COMPLETED frame (inline result) to the websocket;
        False if nobody was listening (the client went away), and nothing is
        recorded. ``latest`` is the JSON stored for pollers, who cannot
        receive bytes."""
        note = self.logs.note(final=True)
        if note:
            self.redis.publish(session_channel(self.job.session_id), wire.response_json(self.job.id, wire.LOG, note))
        if not self.redis.publish(session_channel(self.job.session_id), frame):
            return False
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(status_key(self.job.id), latest, ex=self.ttl_s)
        _release(pipe, self.job, self.ttl_s)
        stored = json.loads(latest)
        _record(pipe, self.job, stored["status"], stored.get("description") or "", stored.get("meta"), "")
        pipe.execute()
        return True

    def log(self, line: str) -> None:
        """One LOG line (a print of the user's code), bounded in length and
        rate-limited per job (``bounds.LogLimiter``): over the limits lines
        are dropped, and one note says how many."""
        line = bounds.truncate(line, bounds.LOG_LINE_BYTES)
        if not self.logs.admit(len(line)):
            return
        pipe = self.redis.pipeline(transaction=False)
        self._log_note(pipe)
        self.send(wire.LOG, line, pipe=pipe)
        pipe.execute()

    def _log_note(self, pipe, final: bool = False) -> None:
        note = self.logs.note(final)
        if note and self.job.session_id:  # LOG is never stored: only a listener can see it
            pipe.publish(session_channel(self.job.session_id), wire.response_json(self.job.id, wire.LOG, note))


def _release(pipe, job: "Job", ttl_s: int) -> None:
    """What a terminal status also does: free the key's concurrency slot, note
    when the job ended (for the cleanup), and keep its owner as long as its status."""
    from .limits import release

    release(pipe, job)
    pipe.zadd(ENDED, {job.id: time.time()})
    pipe.expire(owner_key(job.id), ttl_s)


def _record(pipe, job: "Job", status: str, description: str, meta: Optional[dict], kind: str) -> None:
    """What else a terminal status does, off the hot path: queue the job's
    summary for the ledger database and count it in the farm's metrics."""
    from . import ledger, metrics

    entry = ledger.summary(job, status, description, meta, kind)
    ledger.push(pipe, entry)
    metrics.record_job(pipe, entry)


def job_keys(job_id: str) -> tuple[str, ...]:
    """Every Redis key of one job (the cleanup deletes them together)."""
    return (payload_key(job_id), status_key(job_id), owner_key(job_id), message_key(job_id))


def latest_status(client: redis.Redis, job_id: str) -> Optional[bytes]:
    return client.get(status_key(job_id))


def ended(latest: Optional[bytes]) -> bool:
    """Whether a stored latest status is COMPLETED or ERROR."""
    return latest is not None and wire.frame_status(latest) in wire.TERMINAL


def finished(client: redis.Redis, job_id: str) -> bool:
    """Whether the job already ended (COMPLETED or ERROR)."""
    return ended(latest_status(client, job_id))


def now() -> float:
    return time.time()


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
