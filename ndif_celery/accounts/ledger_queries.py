"""The job ledger read back: ended jobs and ``--since`` times for ``ndif-celery jobs``, ``usage`` and the dashboard.

The rows are the ones ``ndif_celery.accounts.ledger`` writes (its
:func:`~ndif_celery.accounts.ledger.table_row`); :func:`waiting` reads the
summaries still in Redis as rows of the same shape, marked ``pending``.
"""

from __future__ import annotations

import datetime
import re
from typing import Optional

import redis

from . import ledger

_SPAN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str, now: Optional[datetime.datetime] = None) -> datetime.datetime:
    """``1h``, ``30m``, ``2d``, ``1w``, ``45s`` ago, or an ISO date/time (UTC unless it says)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    match = _SPAN.match(text)
    if match:
        return now - datetime.timedelta(seconds=float(match.group(1)) * _UNIT_S[match.group(2)])
    try:
        when = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--since must be like 30m, 1h, 2d or an ISO date/time, got {text!r}") from None
    return when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)


def _iso(value) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        value = ledger.as_datetime(value)
    if value.tzinfo is None:  # SQLite keeps no offset; we wrote UTC
        value = value.replace(tzinfo=datetime.timezone.utc)
    return value.isoformat()


def _seconds(start, end) -> Optional[float]:
    if start is None or end is None:
        return None
    if isinstance(start, datetime.datetime):
        start, end = (v if v.tzinfo else v.replace(tzinfo=datetime.timezone.utc) for v in (start, end))
        return round((end - start).total_seconds(), 3)
    return round(end - start, 3)


def as_dict(row) -> dict:
    """A ledger row as JSON-ready data (times in ISO 8601, UTC)."""
    return {
        "job_id": row.job_id, "owner": row.owner, "email": row.email, "model": row.model,
        "model_key": row.model_key, "outcome": row.outcome, "error_kind": row.error_kind, "error": row.error,
        "worker": row.worker, "isolated": row.isolated, "attempt": row.attempt,
        "received_at": _iso(row.received_at), "started_at": _iso(row.started_at),
        "finished_at": _iso(row.finished_at), "duration_s": _seconds(row.received_at, row.finished_at),
        **{key: getattr(row, key) for key in ledger.TIMINGS},
        "payload_bytes": row.payload_bytes, "result_bytes": row.result_bytes, "devices": row.devices,
        "probe": bool(row.probe),
    }


def recent(engine, user: Optional[str] = None, since: Optional[datetime.datetime] = None,
           limit: int = 50, probes: bool = False) -> list[dict]:
    """The newest ended jobs, newest first: of one user (an email, ``key:<id>``
    or ``anonymous``), since a time; the health probes' only with ``probes``."""
    from sqlalchemy import or_, select
    from sqlalchemy.orm import Session

    from .db import LedgerEntry

    query = select(LedgerEntry).order_by(LedgerEntry.finished_at.desc(), LedgerEntry.job_id).limit(limit)
    if user is not None:
        query = query.where(or_(LedgerEntry.email == user, LedgerEntry.owner == user))
    if since is not None:
        # In UTC, as written (SQLite keeps no offset and compares the text).
        query = query.where(LedgerEntry.finished_at >= since.astimezone(datetime.timezone.utc))
    if not probes:
        query = query.where(LedgerEntry.probe.is_not(True))  # NULL (not marked yet) is shown
    with Session(engine) as session:
        return [as_dict(row) for row in session.scalars(query)]


def waiting(client: redis.Redis, limit: int = 50, probes: bool = False) -> list[dict]:
    """The newest summaries not yet in the database, as rows (``pending``: true),
    newest first; the health probes' only with ``probes``."""
    rows = []
    owner = ledger.probe_owner(client)
    for raw in reversed(client.lrange(ledger.PENDING, -limit, -1) if limit else []):
        entry = ledger.parse_summary(raw)
        if entry is None:
            continue
        entry["probe"] = owner is not None and entry.get("owner") == owner
        if entry["probe"] and not probes:
            continue
        row = ledger.table_row(entry, {})
        rows.append({
            **{key: row[key] for key in ("job_id", "owner", "email", "model", "model_key", "outcome", "error_kind",
                                         "error", "worker", "isolated", "attempt", *ledger.TIMINGS, "payload_bytes",
                                         "result_bytes", "probe")},
            "received_at": _iso(row["received_at"]), "started_at": _iso(row["started_at"]),
            "finished_at": _iso(row["finished_at"]),
            "duration_s": _seconds(entry.get("received_at"), entry.get("finished_at")),
            "pending": True,
        })
    return rows
