"""Expiry of finished jobs: results and job state older than ``NDIF_JOB_TTL_S``.

Every job's Redis keys carry a TTL and vanish on their own; stored results do
not, so ``ndif-celery beat`` runs :func:`sweep` every ``NDIF_CLEANUP_INTERVAL_S``
on one worker. A job that ended is listed in :data:`jobs.ENDED` with its end
time; the sweep deletes its result and keys and moves it to :data:`EXPIRED`, so
a poll that comes too late is told the job expired instead of getting a 404
(which the nnsight client reads as "not started yet" and polls forever).
Results whose job record is gone (say, Redis lost its data) are deleted by age.
"""

from __future__ import annotations

import time
from typing import Optional

import redis

from ndif_celery import wire

from . import byte_quotas, jobs

EXPIRED = "ndif:jobs:expired"  # zset: job id -> when the sweep removed it
# How long an expired job is remembered as such (a few bytes each).
REMEMBER_EXPIRED_S = 30 * 24 * 3600
BATCH = 500


def sweep(client: redis.Redis, store, ttl_s: float, now: Optional[float] = None) -> dict:
    """Delete what belongs to jobs that ended more than ``ttl_s`` ago.

    Idempotent, so two sweeps at once (two beats by mistake) do no harm; a
    store outage raises and leaves the rest for the next sweep.
    """
    now = time.time() if now is None else now
    cutoff = now - ttl_s
    swept = 0
    while True:
        ids = [raw.decode() for raw in client.zrangebyscore(jobs.ENDED, 0, cutoff, start=0, num=BATCH)]
        if not ids:
            break
        for job_id in ids:
            store.delete(jobs.result_key(job_id))
        byte_quotas.RESULTS.release(client, ids)  # each key's quotas have room again
        byte_quotas.PARKED.release(client, [byte_quotas.records_entry(job_id) for job_id in ids])
        pipe = client.pipeline(transaction=False)
        for job_id in ids:
            pipe.delete(*jobs.job_keys(job_id))
            pipe.zadd(EXPIRED, {job_id: now})
            pipe.zrem(jobs.ENDED, job_id)
        pipe.execute()
        swept += len(ids)
    orphans = store.older_than(jobs.RESULTS_PREFIX, cutoff)
    for key in orphans:
        store.delete(key)
    client.zremrangebyscore(EXPIRED, 0, now - REMEMBER_EXPIRED_S)
    return {"jobs": swept, "orphan_results": len(orphans)}


def expired(client: redis.Redis, job_id: str, ttl_s: float) -> bool:
    """Whether ``job_id`` ended longer than ``ttl_s`` ago (swept or about to be)."""
    if client.zscore(EXPIRED, job_id) is not None:
        return True
    ended = client.zscore(jobs.ENDED, job_id)
    return ended is not None and ended <= time.time() - ttl_s


def expired_response(job_id: str, ttl_s: float) -> str:
    """The status a late poll gets: an ERROR, so the client stops and says why."""
    return wire.response_json(
        job_id, wire.ERROR,
        f"Job {job_id} has expired: results and statuses are kept for {ttl_s:g} s (NDIF_JOB_TTL_S) "
        "after a job ends, then deleted. Please run it again.",
    )
