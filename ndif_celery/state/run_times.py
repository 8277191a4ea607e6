"""How long a model's jobs take lately, so a waiting client is told about how long it waits.

A worker records each run it finishes (:func:`record`: its seconds and how
many jobs it ran, a co-batch counting all of its jobs) in a short list per
model key, ``ndif:run_times:<model key>``: the last :data:`RECENT` runs. The
intake and the controller read it with what they read already, and
:func:`wait_s` turns a queue place into seconds: the model's lanes (its
replicas, each free when its job ends, judged by how long that job has run)
take the jobs ahead one by one, each a typical job's time.

An estimate, not a promise: a model with no recent run has none, and a job
that runs much longer than its model's recent ones makes every estimate
behind it short until it ends.
"""

from __future__ import annotations

import heapq
from typing import Optional, Sequence

import redis

PREFIX = "ndif:run_times:"
#: Runs kept per model: enough to smooth one odd job, few enough to follow a change of load.
RECENT = 20
#: A model unused this long forgets its run times (a week: a weekend's pause keeps them).
TTL_S = 7 * 86400
#: Places beyond this are estimated as this one plus a typical job each (no lane walk).
WALK_AT_MOST = 10_000


def key(model_key: str) -> str:
    return PREFIX + model_key


def record(pipe: "redis.Redis | redis.client.Pipeline", model_key: str, seconds: float, jobs_run: int = 1) -> None:
    """One finished run of ``jobs_run`` jobs (a co-batch runs several in one forward)."""
    pipe.lpush(key(model_key), f"{max(seconds, 0.0):.3f}|{max(jobs_run, 1)}")
    pipe.ltrim(key(model_key), 0, RECENT - 1)
    pipe.expire(key(model_key), TTL_S)


def read(pipe: "redis.client.Pipeline", model_key: str) -> None:
    """Queue the read of ``model_key``'s recent runs on ``pipe``; :func:`per_job_s` decodes it."""
    pipe.lrange(key(model_key), 0, RECENT - 1)


def per_job_s(raw: Sequence[bytes]) -> Optional[float]:
    """A typical job's seconds on its lane: the recent runs' time over their jobs; None with no run."""
    seconds = jobs = 0.0
    for item in raw or ():
        try:
            run_s, run_jobs = item.decode().split("|")
            seconds, jobs = seconds + float(run_s), jobs + max(int(run_jobs), 1)
        except ValueError:
            continue
    return seconds / jobs if jobs else None


def wait_s(position: int, per_job: Optional[float], lanes: Sequence[Optional[float]]) -> Optional[float]:
    """About how long the job at ``position`` (1: next) waits to start.

    ``lanes``: one per replica serving the model, how long its current job has
    run (None: idle). A busy lane is free after a typical job less that time
    (never less than a tenth of a job: it is running late, not done). None when
    no estimate is honest: no recent run, or no replica."""
    if per_job is None or not lanes or position < 1:
        return None
    free_at = sorted(0.0 if ran is None else max(per_job - ran, per_job / 10) for ran in lanes)
    walked = min(position - 1, WALK_AT_MOST)
    for _ in range(walked):  # each job ahead takes the lane free first
        heapq.heapreplace(free_at, free_at[0] + per_job)
    beyond = (position - 1 - walked) * per_job / len(lanes)
    return free_at[0] + beyond

