"""The audit log: every operator action taken from the dashboard, allowed or not.

Written by ``web.admin`` before it answers, read by ``ndif-celery audit`` and
the dashboard. In the database (:class:`~ndif_celery.accounts.db.AuditEntry`),
beside the keys and the ledger, so it outlives Redis and is kept like them.
"""

from __future__ import annotations

import datetime
import json
from typing import Optional

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from .db import AuditEntry

DONE, REFUSED, FAILED = "done", "refused", "failed"
MAX_MESSAGE = 1000


def record(engine: Engine, actor: str, email: Optional[str], action: str, target: str, detail: dict,
           outcome: str, message: str, address: Optional[str]) -> int:
    """One action, as it ended; its row id."""
    with Session(engine) as session:
        entry = AuditEntry(actor=actor[:64], email=(email or None) and email[:320], action=action[:32],
                           target=(target or "")[:300], detail=json.dumps(detail, sort_keys=True)[:4000],
                           outcome=outcome, message=(message or "")[:MAX_MESSAGE], address=(address or None) and address[:64])
        session.add(entry)
        session.commit()
        return entry.id


def recent(engine: Engine, limit: int = 50, since: Optional[datetime.datetime] = None) -> list[dict]:
    """The newest actions first."""
    query = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
    if since is not None:
        query = query.where(AuditEntry.at >= since)
    with Session(engine) as session:
        return [_row(entry) for entry in session.scalars(query)]


def get(engine: Engine, entry_id: int) -> Optional[dict]:
    with Session(engine) as session:
        entry = session.get(AuditEntry, entry_id)
        return _row(entry) if entry is not None else None


def _row(entry: AuditEntry) -> dict:
    at = entry.at if entry.at.tzinfo else entry.at.replace(tzinfo=datetime.timezone.utc)  # SQLite drops the zone
    return {"id": entry.id, "at": at.isoformat(), "actor": entry.actor, "email": entry.email, "action": entry.action,
            "target": entry.target, "detail": json.loads(entry.detail or "{}"), "outcome": entry.outcome,
            "message": entry.message, "address": entry.address}
