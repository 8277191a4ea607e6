"""Job state in Redis: the key names, the ``Job`` message, and reading the latest status.

This is the bottom layer of job state: it imports nothing of the project but
``wire``, so every other module (limits, queues, ledger, metrics, the status
channel in ``ndif_celery.statuses``) can build on it without a circle. The keys,
written by whoever moves the job along (the web on intake, the worker afterwards,
statuses through ``ndif_celery.statuses.StatusChannel``):

- ``ndif:job:<id>:payload``  the serialized nnsight request, until a worker takes it
- ``ndif:job:<id>:status``   the latest non-LOG status as the JSON the client parses,
                              for ``GET /response/<id>`` (non-blocking jobs, lost clients)
- ``ndif:job:<id>:owner``    who submitted it (``key:<id>`` or ``anonymous``)
- ``ndif:job:<id>:message``  its Celery message body, to run it again if its worker dies
- ``ndif:job:<id>:final``    who sent its final status (set NX: exactly one author across
                              processes, the worker, the beat's watchdog or ``ndif-celery kill``)
- channel ``ndif:session:<session_id>``  every status of a blocking job, forwarded
                              verbatim to its websocket (``...:owner``: who opened it;
                              ``...:jobs``: the jobs submitted to it)

- zset ``ndif:jobs:ended``     job id -> when it ended, for the cleanup (``ndif_celery.state.expiry``)
- zset ``ndif:jobs:open``     job id -> when it was accepted, until its final status: what the
                              beat's reconciler checks is queued, running or ended (``ndif_celery.farm.watchdog``)
- zset ``ndif:jobs:deadlines`` job id -> its execution deadline (epoch seconds) while it runs,
                              so the beat answers a job whose worker cannot (``ndif_celery.farm.watchdog``)
- ``results/<id>.pt``         in the result store, not Redis: a job's stored result (:func:`result_key`),
                              deleted by the cleanup (``ndif_celery.state.expiry``)
- list ``ndif:ledger``         summaries of ended jobs for the ledger database (``ndif_celery.accounts.ledger``);
                              the final status also counts the job in ``ndif:metrics:*`` (``ndif_celery.monitoring.metrics``)

All keys expire after ``NDIF_JOB_TTL_S``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from ndif_celery import wire

ENDED = "ndif:jobs:ended"
DEADLINES = "ndif:jobs:deadlines"
OPEN = "ndif:jobs:open"

# One small function per Redis key, alike on purpose (tools/duplicates sees
# them as a repeat): each name is greppable where it is used, and a key's
# layout changes in exactly one place.


def payload_key(job_id: str) -> str:
    return f"ndif:job:{job_id}:payload"


def status_key(job_id: str) -> str:
    return f"ndif:job:{job_id}:status"


def session_channel(session_id: str) -> str:
    return f"ndif:session:{session_id}"


def session_owner_key(session_id: str) -> str:
    return f"ndif:session:{session_id}:owner"


# A Socket.IO socket's session is recorded with an empty owner when it opens
# (no key on that socket); the first key that submits with it claims it.
_CLAIM = """
local owner = redis.call('get', KEYS[1])
if owner == '' then
  local ttl = redis.call('pttl', KEYS[1])
  if ttl > 0 then redis.call('set', KEYS[1], ARGV[1], 'PX', ttl) else redis.call('set', KEYS[1], ARGV[1]) end
  return ARGV[1]
end
return owner
"""


def claim_session(client: redis.Redis, session_id: str, owner: str) -> Optional[bytes]:
    """The session's owner after ``owner`` tried to claim it: ``owner`` when the
    socket was unclaimed (or already its), another key's, or None (no such socket)."""
    found = client.eval(_CLAIM, 1, session_owner_key(session_id), owner)
    return found if found is None or isinstance(found, bytes) else str(found).encode()


def session_jobs_key(session_id: str) -> str:
    return f"ndif:session:{session_id}:jobs"


def gone_key(job_id: str) -> str:
    """Set while a blocking job's client is away (its websocket closed); its
    key's next poll deletes it; if it is still there at the grace's end, the job is cancelled."""
    return f"ndif:job:{job_id}:gone"


def owner_key(job_id: str) -> str:
    return f"ndif:job:{job_id}:owner"


def message_key(job_id: str) -> str:
    """The job's Celery message body, kept so a job lost with its worker can run again."""
    return f"ndif:job:{job_id}:message"


def lost_key(job_id: str) -> str:
    return f"ndif:job:{job_id}:lost"


def final_key(job_id: str) -> str:
    return f"ndif:job:{job_id}:final"


RESULTS_PREFIX = "results/"  # the result store's folder of results


def result_key(job_id: str) -> str:
    """Where a job's stored result lives in the result store (not Redis)."""
    return f"{RESULTS_PREFIX}{job_id}.pt"


@dataclass
class Job:
    """What a worker needs to run a job: the Celery message body (JSON only)."""

    id: str
    model_key: str
    session_id: str = ""
    compress: bool = False
    env: dict = field(default_factory=dict)
    received_at: float = 0.0  # the request reached the web (epoch seconds)
    queued_at: float = 0.0  # the web's checks done: parked and sent next
    payload_bytes: int = 0
    trusted: bool = True  # stamped by the web from the key; never from the client
    owner: str = "anonymous"
    attempt: int = 1  # 2 when re-run after its first worker died
    priority: bool = False  # the key is tagged ``priority``: served before the others
    queued_position: int = 0  # the place its first QUEUED told (the controller tells a change)
    protocol: str = ""  # how its client waits: "" the farm's own (/subscribe), "socketio" the 0.6/0.7 clients'

    def to_message(self) -> dict:
        return asdict(self)

    @classmethod
    def from_message(cls, message: dict) -> "Job":
        return cls(**{k: message[k] for k in cls.__dataclass_fields__ if k in message})


def connect(url: str, outage_s: float = 0.0, max_connections: int = 0, health_check_s: int = 30) -> redis.Redis:
    """A Redis client; with ``outage_s``, one that rides out a Redis restart.

    The web and the workers pass ``NDIF_REDIS_OUTAGE_S``: a command that finds
    Redis gone is retried with backoff for about that long, so a restart (the
    embedded Redis comes back from its append-only file in a second) delays
    requests and status writes instead of failing them. The CLI passes nothing
    and fails at once, which is what someone typing a command wants.
    """
    retries = int(outage_s / _RETRY_CAP_S) + 4 if outage_s > 0 else 0
    options = dict(
        health_check_interval=health_check_s, socket_keepalive=True, socket_connect_timeout=5,
        retry=Retry(ExponentialBackoff(cap=_RETRY_CAP_S, base=0.05), retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )
    if max_connections:
        # The web: thousands of greenlets may ask at once; they queue for one
        # of max_connections instead of each opening its own (Redis's client
        # count stays independent of how many clients wait).
        pool = redis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=outage_s + 5, **options)
        return redis.Redis(connection_pool=pool)
    return redis.Redis.from_url(url, **options)


_RETRY_CAP_S = 0.5


def job_keys(job_id: str) -> tuple[str, ...]:
    """Every Redis key of one job (the cleanup deletes them together)."""
    return (payload_key(job_id), status_key(job_id), owner_key(job_id), message_key(job_id), final_key(job_id))


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
