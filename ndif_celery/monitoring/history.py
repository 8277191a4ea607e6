"""History per model for the dashboard's charts: probe results and job latency over 24 h and 30 d.

- Probes: the beat adds each result to an hourly bucket in Redis
  (``ndif:probes:history:<model key>``: ``<hour>|ok``, ``<hour>|failed``,
  ``<hour>|ms``), kept :data:`KEEP_S`. A bucket costs three fields, so a
  model's month is about 2,200 small fields, whatever the probe interval.
- Jobs: read from the ledger (``job_ledger``: when each job was received and
  finished), at most :data:`MAX_ROWS` of the newest rows in the period, so a busy
  month costs one bounded query.

Both return ``(bucket start, ...)`` rows over ``[start, end)`` in steps of
``step`` seconds (an hour for 24 h, a day for 30 d), oldest first.
"""

from __future__ import annotations

import datetime
import statistics
from typing import Optional

import redis

HISTORY = "ndif:probes:history:"
HOUR = 3600
DAY = 86400
KEEP_S = 31 * DAY
MAX_ROWS = 200_000
PERIODS = {"24h": (DAY, HOUR), "30d": (30 * DAY, DAY)}  # name -> (span, step)


def record_probe(client: redis.Redis, model_key: str, ok: bool, latency_s: Optional[float], at: float) -> None:
    """One probe's result in its hour; the hours past :data:`KEEP_S` go when a new hour starts."""
    key = HISTORY + model_key
    hour = int(at // HOUR * HOUR)
    pipe = client.pipeline(transaction=False)
    pipe.hincrby(key, f"{hour}|{'ok' if ok else 'failed'}", 1)
    if ok and latency_s is not None:
        pipe.hincrbyfloat(key, f"{hour}|ms", round(latency_s * 1000, 3))
    pipe.expire(key, KEEP_S)
    if pipe.execute()[0] == 1:  # the first of its kind this hour: now drop the hours past KEEP_S
        old = [field for field in client.hkeys(key) if int(field.split(b"|", 1)[0]) < at - KEEP_S]
        if old:
            client.hdel(key, *old)


def probe_buckets(client: redis.Redis, model_key: str, start: float, end: float, step: float) -> list[tuple]:
    """``(bucket start, passed, failed, mean latency ms or None)`` per step."""
    sums: dict[int, list] = {}
    for field, value in client.hgetall(HISTORY + model_key).items():
        hour, kind = field.decode().split("|", 1)
        at = int(hour)
        if not start <= at < end:
            continue
        bucket = sums.setdefault(int(start + (at - start) // step * step), [0, 0, 0.0])
        index = {"ok": 0, "failed": 1, "ms": 2}[kind]
        bucket[index] += float(value) if index == 2 else int(value)
    rows = []
    at = start
    while at < end:
        ok, failed, ms = sums.get(int(at), [0, 0, 0.0])
        rows.append((at, ok, failed, ms / ok if ok else None))
        at += step
    return rows


def probed_models(client: redis.Redis) -> list[str]:
    """The model keys with probe history."""
    return sorted(key.decode()[len(HISTORY):] for key in client.scan_iter(match=HISTORY + "*", count=500))


def job_latency(engine, start: float, end: float, step: float) -> dict:
    """``(model repo, nnsight)`` -> ``(bucket start, jobs, errors, p50 ms or None)`` per step,
    from the ledger: each job's time from the web receiving it to its end, per deployment
    (a runtime's deployment of the model apart). The health probes' jobs (marked
    ``probe``) are left out: they have their own chart."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from ndif_celery.accounts.db import LedgerEntry
    from ndif_celery.policy import model_policy

    since = datetime.datetime.fromtimestamp(start, datetime.timezone.utc)
    until = datetime.datetime.fromtimestamp(end, datetime.timezone.utc)
    query = (select(LedgerEntry.model, LedgerEntry.model_key, LedgerEntry.received_at, LedgerEntry.finished_at,
                    LedgerEntry.outcome)
             .where(LedgerEntry.finished_at >= since, LedgerEntry.finished_at < until)
             .order_by(LedgerEntry.finished_at.desc()).limit(MAX_ROWS))
    query = query.where(LedgerEntry.probe.is_not(True))
    buckets: dict[tuple, dict[int, list]] = {}
    runtimes: dict[str, str] = {}
    with Session(engine) as session:
        for model, model_key, received, finished, outcome in session.execute(query):
            finished_at = _epoch(finished)
            if model_key not in runtimes:
                runtimes[model_key] = model_policy.runtime_of(model_key or "")
            deployment = (model, runtimes[model_key])
            bucket = buckets.setdefault(deployment, {}).setdefault(
                int(start + (finished_at - start) // step * step), [0, 0, []])
            bucket[0] += 1
            bucket[1] += outcome != "COMPLETED"
            if received is not None:
                bucket[2].append((finished_at - _epoch(received)) * 1000)
    out = {}
    for model, by_start in buckets.items():
        rows, at = [], start
        while at < end:
            jobs, errors, times = by_start.get(int(at), [0, 0, []])
            rows.append((at, jobs, errors, statistics.median(times) if times else None))
            at += step
        out[model] = rows
    return out


def _epoch(when: datetime.datetime) -> float:
    if when.tzinfo is None:  # SQLite drops the zone; the ledger writes UTC
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when.timestamp()


def period(name: str, now: float) -> tuple[float, float, float]:
    """``(start, end, step)`` of a chart period ending with the current bucket."""
    span, step = PERIODS[name]
    end = (now // step + 1) * step
    return end - span, end, step
