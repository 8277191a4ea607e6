"""Per-key and per-model limits, checked by the web before a job is accepted.

Counters live in Redis so every web process (and host) shares them:

- ``ndif:rate:<owner>:<minute>``  requests this key made in this minute (fixed window)
- ``ndif:handshakes:<owner>:<minute>``  its ``/subscribe`` handshakes this minute (twice the rate)
- ``ndif:active:<owner>``         the key's jobs queued or running (a sorted set by
                                   start time; a job leaves it when it ends)
- ``ndif:sockets:<owner>``        the key's open /subscribe websockets (session id ->
                                   lease deadline; see claim_socket)
- ``ndif:uploads:<owner>``        the request bodies it is sending (upload id -> the
                                   body's deadline; see claim_upload)

A key's own limits (``ndif-celery keys create --rate-limit --max-concurrent``)
override the farm-wide ``NDIF_*`` defaults; 0 means no limit.
"""

from __future__ import annotations

import time

import redis

from ndif_celery import config
from ndif_celery.errors import Refused
from ndif_celery.state import byte_quotas, jobs, queues

from . import auth


class LimitError(Refused):
    """A limit reached: 413 payload size, 429 rate, concurrency or sockets, 503 queue full."""


def _active_key(owner: str) -> str:
    return f"ndif:active:{owner}"


def check_payload(size: int, settings: config.Settings) -> None:
    limit = settings.max_payload_bytes
    if limit and size > limit:
        raise LimitError(
            f"Request payload is {size} bytes; this server accepts at most {limit} bytes "
            "(NDIF_MAX_PAYLOAD_BYTES). Save less inside the trace, or pass large inputs by reference.",
            413,
        )


def _rate(identity: auth.Identity, settings: config.Settings) -> int:
    """The key's requests per minute: its own limit, else NDIF_RATE_LIMIT_PER_MIN (0: none)."""
    return identity.rate_limit_per_min if identity.rate_limit_per_min is not None else settings.rate_limit_per_min


HANDSHAKES_PER_REQUEST = 2  # a key's handshakes a minute, per request its rate allows


def count_handshake(client: redis.Redis, identity: auth.Identity, settings: config.Settings) -> None:
    """Count a ``/subscribe`` handshake against the key's rate, or refuse it
    (429). A blocking trace is one handshake and one request, so sockets opened
    and never submitted on are bounded as requests are; at twice the rate, so
    a client within its rate meets the request's refusal (its RemoteError), not
    the handshake's."""
    rate = _rate(identity, settings)
    if not rate:
        return
    allowed = HANDSHAKES_PER_REQUEST * rate
    now = time.time()
    window = f"ndif:handshakes:{identity.owner}:{int(now // 60)}"
    pipe = client.pipeline(transaction=False)
    pipe.incr(window)
    pipe.expire(window, 120)
    made, _ = pipe.execute()
    if made > allowed:
        raise LimitError(
            f"Too many /subscribe handshakes: at most {allowed} per minute for this key (twice its "
            f"NDIF_RATE_LIMIT_PER_MIN). Try again in {60 - int(now % 60)} s.",
            429,
        )


def _concurrent(identity: auth.Identity, settings: config.Settings) -> int:
    """The key's jobs queued or running at once: its own limit, else NDIF_MAX_CONCURRENT_JOBS (0: none)."""
    return identity.max_concurrent_jobs if identity.max_concurrent_jobs is not None else settings.max_concurrent_jobs


def _check_rate_and_concurrency(identity: auth.Identity, settings: config.Settings, made: int, active: int,
                                now: float) -> None:
    """Refuse when ``made`` requests this minute are over the key's rate or ``active`` jobs at its cap."""
    rate = _rate(identity, settings)
    if rate and made > rate:
        raise LimitError(
            f"Rate limit reached: at most {rate} requests per minute for this key (NDIF_RATE_LIMIT_PER_MIN). "
            f"Try again in {60 - int(now % 60)} s.",
            429,
        )
    concurrent = _concurrent(identity, settings)
    if concurrent and active >= concurrent:
        raise LimitError(
            f"Too many jobs at once: this key may have at most {concurrent} queued or running "
            "(NDIF_MAX_CONCURRENT_JOBS). Wait for one to finish.",
            429,
        )


def check_headroom(client: redis.Redis, identity: auth.Identity, settings: config.Settings) -> None:
    """Refuse a request its key's rate or concurrency would refuse, counting
    nothing: the web asks before it reads a body (``web/uploads.py``), and
    counts with :func:`check_and_count` once the body is in."""
    if not _rate(identity, settings) and not _concurrent(identity, settings):
        return
    now = time.time()
    pipe = client.pipeline(transaction=False)
    pipe.get(f"ndif:rate:{identity.owner}:{int(now // 60)}")
    pipe.zcount(_active_key(identity.owner), now - settings.job_ttl_s, "+inf")
    made, active = pipe.execute()
    _check_rate_and_concurrency(identity, settings, int(made or 0) + 1, active, now)


def check_and_count(client: redis.Redis, identity: auth.Identity, queue: str, settings: config.Settings) -> list[int]:
    """Refuse a request over any limit; otherwise count it against the key's
    rate and return the lengths of the queue's lists (``queues.lists``)."""
    now = time.time()
    window = f"ndif:rate:{identity.owner}:{int(now // 60)}"
    pipe = client.pipeline(transaction=False)
    pipe.incr(window)
    pipe.expire(window, 120)
    pipe.zremrangebyscore(_active_key(identity.owner), 0, now - settings.job_ttl_s)
    pipe.zcard(_active_key(identity.owner))
    for name in queues.lists(queue):
        pipe.llen(name)
    made, _, _, active, *depths = pipe.execute()
    depth = sum(depths)
    _check_rate_and_concurrency(identity, settings, made, active, now)
    if settings.max_queue_depth and depth >= settings.max_queue_depth:
        raise LimitError(
            f"The queue for this model is full ({depth} jobs waiting; NDIF_MAX_QUEUE_DEPTH="
            f"{settings.max_queue_depth}). Try again shortly.",
            503,
        )
    return depths


def reserve_parked(client: redis.Redis, identity: auth.Identity, job: jobs.Job, settings: config.Settings) -> None:
    """Count the job's payload among the bytes its key parks in Redis, or
    refuse it (429) past ``NDIF_MAX_PARKED_BYTES_PER_KEY``: no key can fill the broker."""
    quota = settings.max_parked_bytes_per_key
    held = byte_quotas.PARKED.reserve(client, identity.owner, byte_quotas.payload_entry(job.id), job.payload_bytes, quota)
    if held is not None:
        raise LimitError(
            f"This key's jobs hold {held} bytes in the job broker (payloads waiting to run, statuses kept "
            f"for NDIF_JOB_TTL_S); with this payload of {job.payload_bytes} bytes that is over its "
            f"{quota} (NDIF_MAX_PARKED_BYTES_PER_KEY). Wait for queued jobs to run, then try again.",
            429,
        )


def track(pipe, job: jobs.Job) -> None:
    """Count ``job`` as active for its key (in the intake pipeline)."""
    pipe.zadd(_active_key(job.owner), {job.id: job.received_at})


def release(pipe, job: jobs.Job) -> None:
    pipe.zrem(_active_key(job.owner), job.id)


# Leased slots: what a key holds open on the web, counted in Redis across every
# web process as a sorted set per key (member -> lease deadline, epoch seconds).
# A web process that dies holding slots (SIGKILL, OOM, host lost) stops renewing
# them; they lapse at their deadline and the next claim drops them, so nothing leaks.
#
# - ``ndif:sockets:<owner>``  open /subscribe websockets (session id), renewed every
#   few seconds while open, lapsing after NDIF_SOCKET_LEASE_S
# - ``ndif:uploads:<owner>``  request bodies being read (one id each), leased until
#   the body's own deadline (web/uploads.py)


def _claim_slot(client: redis.Redis, key: str, member: str, limit: int, lease_s: float) -> bool:
    """Hold one of ``limit`` slots in ``key`` for ``lease_s``; False when all are held.
    Add first, then count: two web processes racing for the last slot may
    both be refused, but never both admitted."""
    now = time.time()
    pipe = client.pipeline(transaction=True)
    pipe.zremrangebyscore(key, "-inf", now)
    pipe.zadd(key, {member: now + lease_s})
    pipe.zcard(key)
    pipe.expire(key, int(lease_s * 2) + 1)
    _, _, held, _ = pipe.execute()
    if held > limit:
        client.zrem(key, member)
        return False
    return True


def _sockets_key(owner: str) -> str:
    return f"ndif:sockets:{owner}"


def claim_socket(client: redis.Redis, identity: auth.Identity, session_id: str, settings: config.Settings) -> bool:
    """Count a new socket for the key, or refuse it (429) when the key already
    holds ``NDIF_MAX_WEBSOCKETS_PER_KEY``. False when there is no limit (nothing counted)."""
    limit = settings.max_websockets_per_key
    if not limit:
        return False
    if not _claim_slot(client, _sockets_key(identity.owner), session_id, limit, settings.socket_lease_s):
        raise LimitError(
            f"Too many open connections: this API key already holds {limit} /subscribe websockets "
            f"(NDIF_MAX_WEBSOCKETS_PER_KEY), each one a running blocking trace or an open session. "
            "Let some finish (or close them), or use blocking=False, then try again.",
            429,
        )
    return True


def renew_sockets(client: redis.Redis, leases, lease_s: float) -> None:
    """Keep live sockets counted for ``lease_s`` (``NDIF_SOCKET_LEASE_S``) more,
    many (identity, session id) pairs in one round trip: a web process renews
    all its counted sockets at once (``web/hub.py``)."""
    deadline = time.time() + lease_s
    pipe = client.pipeline(transaction=False)
    for identity, session_id in leases:
        key = _sockets_key(identity.owner)
        # XX: only a socket still counted; one released meanwhile stays released.
        pipe.zadd(key, {session_id: deadline}, xx=True)
        pipe.expire(key, int(lease_s * 2))
    pipe.execute()


def release_socket(client: redis.Redis, identity: auth.Identity, session_id: str) -> None:
    client.zrem(_sockets_key(identity.owner), session_id)


def sockets_held(client: redis.Redis, identity: auth.Identity) -> int:
    """Live sockets the key holds now (lapsed leases not counted)."""
    return client.zcount(_sockets_key(identity.owner), time.time(), "+inf")


def _uploads_key(owner: str) -> str:
    return f"ndif:uploads:{owner}"


def claim_upload(client: redis.Redis, identity: auth.Identity, upload_id: str, lease_s: float,
                 settings: config.Settings) -> bool:
    """Count a request body the key is sending, until it is read or ``lease_s``
    (its deadline) passes; refuse it (429) when the key is already sending
    ``NDIF_UPLOADS_PER_KEY``. False when there is no limit (nothing counted)."""
    limit = settings.uploads_per_key
    if not limit:
        return False
    if not _claim_slot(client, _uploads_key(identity.owner), upload_id, limit, lease_s):
        raise LimitError(
            f"Too many uploads at once: this API key is already sending {limit} request bodies "
            "(NDIF_UPLOADS_PER_KEY). Wait for them to arrive, then try again.",
            429,
        )
    return True


def release_upload(client: redis.Redis, identity: auth.Identity, upload_id: str) -> None:
    client.zrem(_uploads_key(identity.owner), upload_id)
