"""The job ledger: one database row per ended job, kept off the hot path.

When a job ends, :class:`ndif_celery.statuses.StatusChannel` pushes a compact JSON
summary (:func:`summary`) onto the Redis list ``ndif:ledger`` in the same
pipeline as its final status, so finishing a job never waits on the
database. A :class:`Drainer` thread in every worker, one of them leading (a
Redis lease, ``ndif_celery.state.leases``), moves the list into the
``job_ledger`` table (:class:`ndif_celery.accounts.db.LedgerEntry`) in
batches, at most every ``EVERY_S``; a row is written once per job id, however
often it is offered. It is a thread of its own, not a step of the farm
controller's tick, so a slow database never delays placement. While the
database is unreachable the summaries stay in Redis (at most
``MAX_PENDING``, the newest kept) and are written once it is back.

``ndif-celery jobs`` and the dashboard read the table and the summaries still
waiting in Redis (``ndif_celery.accounts.ledger_queries``).

Health probes (``ndif_celery.monitoring.probes``) run a real job every few
seconds per model, and would bury the users' jobs. A row is marked ``probe``
when it is written: its owner is the probe key's, as the web recorded it in
Redis (:data:`PROBE_OWNER`). ``jobs``, ``usage`` and the dashboard leave
those rows out unless asked (``--probes``). Rows written before the column
existed are marked once, by the drainer, when it first knows the probe's
owner (:func:`mark_probes`).

Error kinds (``error_kind``, also the ``kind`` label of ``ndif_jobs_total``):
``user`` (the user's code or request failed), ``timeout`` (execution
deadline), ``cancelled`` (``ndif-celery kill``), ``store`` (the result store
was unavailable), ``server`` (a fault of ours), ``deploy`` (the model could not
be placed or loaded), ``worker_lost`` (its worker died twice), and ``error``:
an ERROR sent without a kind. No path of the farm's does that; a count
above 0 names one to fix.

The summary a job leaves and its row in the table have one shape
(:func:`table_row`), which the queries read back too: a change to a column
touches this module and ``ledger_queries``.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from typing import Iterable, Optional

import redis

from ndif_celery import wire
from ndif_celery.state import leases

from . import usage

PENDING = "ndif:ledger"
# The probe key's job owner (key:<id>), written by the web for every probe it
# takes. The same key as ``ndif_celery.monitoring.probes.OWNER``, named here
# because the ledger sits below monitoring (tools/import_graph.py).
PROBE_OWNER = "ndif:probes:owner"
LOCK = "ndif:ledger:lock"
LEADER = "ndif:ledger:leader"  # the lease of the drainer that writes; LOCK guards each drain
LEASE_MS = 10_000
MAX_PENDING = 100_000
BATCH = 500
ERROR_CHARS = 500
# A drainer that cannot reach the database waits this long at most before trying again.
MAX_BACKOFF_S = 8.0

log = logging.getLogger("ndif_celery.ledger")

TIMINGS = ("queue_ms", "deserialize_ms", "run_ms", "upload_ms")


def first_line(description: str) -> str:
    """What an ERROR says in one line: its first line, or for a traceback
    the exception line (the last one), cut to ``ERROR_CHARS``."""
    lines = [line.strip() for line in (description or "").splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[-1] if lines[0].startswith("Traceback (most recent call last)") else lines[0]
    return line[:ERROR_CHARS]


def summary(job, status: str, description: str, meta: Optional[dict], kind: str = "",
            now: Optional[float] = None) -> dict:
    """The ledger's record of a job that just ended (JSON-ready, epoch seconds)."""
    meta = meta or {}
    finished = time.time() if now is None else now
    entry = {
        "job_id": job.id,
        "owner": job.owner,
        "model_key": job.model_key,
        "outcome": status,
        "error_kind": (kind or "error") if status == wire.ERROR else None,
        "error": first_line(description) if status == wire.ERROR else None,
        "worker": meta.get("worker"),
        "isolated": meta.get("isolated"),
        "attempt": job.attempt,
        "received_at": job.received_at or None,
        "finished_at": finished,
        "payload_bytes": meta.get("payload_bytes", job.payload_bytes or None),
        "result_bytes": meta.get("result_bytes"),
    }
    for key in TIMINGS:
        entry[key] = meta.get(key)
    started = None
    if job.received_at and isinstance(meta.get("queue_ms"), (int, float)):
        started = job.received_at + meta["queue_ms"] / 1000.0
    entry["started_at"] = started
    return entry


def push(pipe, entry: dict) -> None:
    """Queue ``entry`` for the database in ``pipe`` (the job's final-status pipeline)."""
    pipe.rpush(PENDING, json.dumps(entry, separators=(",", ":")))
    pipe.ltrim(PENDING, -MAX_PENDING, -1)


# --- into the database ------------------------------------------------------------


def as_datetime(value) -> Optional[datetime.datetime]:
    """Epoch seconds as an aware UTC time; None for a missing or non-positive value."""
    if not isinstance(value, (int, float)) or value <= 0:
        return None
    return datetime.datetime.fromtimestamp(value, datetime.timezone.utc)


def table_row(entry: dict, emails: dict) -> dict:
    """A summary as the ``job_ledger`` row it becomes; ``emails``: owner -> the key's email."""
    model_key = str(entry.get("model_key") or "")
    return {
        "job_id": str(entry["job_id"])[:64],
        "owner": str(entry.get("owner") or "anonymous")[:64],
        "email": emails.get(entry.get("owner")),
        "model": str(wire.repo_fields(model_key).get("repo_id") or model_key)[:300],
        "model_key": model_key,
        "outcome": str(entry.get("outcome") or ""),
        "error_kind": entry.get("error_kind") and str(entry["error_kind"])[:32],
        "error": (entry.get("error") or None) and str(entry["error"])[:ERROR_CHARS],
        "worker": entry.get("worker") and str(entry["worker"])[:200],
        "isolated": entry.get("isolated"),
        "attempt": int(entry.get("attempt") or 1),
        "received_at": as_datetime(entry.get("received_at")),
        "started_at": as_datetime(entry.get("started_at")),
        "finished_at": as_datetime(entry.get("finished_at")) or datetime.datetime.now(datetime.timezone.utc),
        **{key: entry.get(key) for key in TIMINGS},
        "payload_bytes": entry.get("payload_bytes"),
        "result_bytes": entry.get("result_bytes"),
        "devices": entry.get("devices") if isinstance(entry.get("devices"), int) else None,
        "probe": bool(entry.get("probe")),
    }


def probe_owner(client: redis.Redis) -> Optional[str]:
    """The health probe's job owner (``key:<id>``), or None when no probe was
    taken with auth on in the last day (with auth off everyone is anonymous)."""
    raw = client.get(PROBE_OWNER)
    return raw.decode() if raw else None


def _devices(client: redis.Redis, entries: list[dict]) -> None:
    """Each entry's ``devices``: the GPUs of the worker that ran it, as registered
    (drained within seconds of the job's end, so its worker is still there)."""
    from ndif_celery.state import registry

    workers = registry.all_workers(client)
    for entry in entries:
        info = workers.get(entry.get("worker") or "")
        if info is not None and "devices" not in entry:
            entry["devices"] = len(info.get("gpus") or [])


def _emails(session, owners: Iterable[str]) -> dict:
    """owner ("key:<id>") -> the key's email, for the owners that are keys."""
    from sqlalchemy import select

    from .db import ApiKey, User

    ids = {}
    for owner in owners:
        if isinstance(owner, str) and owner.startswith("key:") and owner[4:].isdigit():
            ids[int(owner[4:])] = owner
    if not ids:
        return {}
    rows = session.execute(select(ApiKey.id, User.email).join(User).where(ApiKey.id.in_(list(ids))))
    return {ids[key_id]: email for key_id, email in rows}


def _insert(engine, entries: list[dict]) -> None:
    """Write ``entries``; a job id already there is left as it is."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from .db import LedgerEntry

    with Session(engine) as session, session.begin():
        emails = _emails(session, (entry.get("owner") for entry in entries))
        rows = {}
        for entry in entries:
            rows.setdefault(str(entry["job_id"]), table_row(entry, emails))
        dialect = engine.dialect.name
        if dialect in ("sqlite", "postgresql"):
            if dialect == "sqlite":
                from sqlalchemy.dialects.sqlite import insert
            else:
                from sqlalchemy.dialects.postgresql import insert
            session.execute(insert(LedgerEntry).on_conflict_do_nothing(index_elements=["job_id"]), list(rows.values()))
            return
        there = set(session.scalars(select(LedgerEntry.job_id).where(LedgerEntry.job_id.in_(list(rows)))))
        new = [row for job_id, row in rows.items() if job_id not in there]
        if new:
            session.execute(LedgerEntry.__table__.insert(), new)


def _refused(error: Exception) -> bool:
    """Whether the database refused the values (as opposed to being unreachable)."""
    from sqlalchemy.exc import DataError, IntegrityError, OperationalError, ProgrammingError, StatementError

    if isinstance(error, (DataError, IntegrityError, ProgrammingError)):
        return True
    # A value that could not even be bound (no database involved).
    return (isinstance(error, StatementError) and not isinstance(error, OperationalError)
            and isinstance(error.orig, (TypeError, ValueError)))


def _insert_or_skip(engine, entries: list[dict]) -> None:
    """``_insert``, except that an entry the database refuses (not an outage:
    a value it cannot store) is logged and dropped instead of blocking the rest."""
    try:
        _insert(engine, entries)
        return
    except Exception as error:  # noqa: BLE001 - sorted below
        if not _refused(error):
            raise
    for entry in entries:
        try:
            _insert(engine, [entry])
        except Exception as error:  # noqa: BLE001
            if not _refused(error):
                raise
            log.warning("ledger: dropping job %s, which the database refuses: %s",
                        entry.get("job_id"), str(error).splitlines()[0][:300])


def parse_summary(raw: bytes) -> Optional[dict]:
    """A summary as pushed to ``PENDING``; None for one that is malformed."""
    try:
        entry = json.loads(raw)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) and entry.get("job_id") else None


def drain(client: redis.Redis, engine, batch: int = BATCH, wait_s: float = 0.0, max_batches: int = 20) -> int:
    """Move waiting summaries into the database, oldest first; return how many
    were written. One drainer at a time (a Redis lock; ``wait_s`` is how long to
    wait for another one to finish, 0: don't). A database error propagates and
    leaves the batch in Redis."""
    lock = client.lock(LOCK, timeout=120)
    if not lock.acquire(blocking=wait_s > 0, blocking_timeout=wait_s or None):
        return 0
    written = 0
    try:
        for _ in range(max_batches):
            raw = client.lrange(PENDING, 0, batch - 1)
            if not raw:
                break
            entries = []
            for item in raw:
                entry = parse_summary(item)
                if entry is None:
                    log.warning("dropping a malformed ledger entry: %.200r", item)
                else:
                    entries.append(entry)
            if entries:
                _devices(client, entries)
                owner = probe_owner(client)
                for entry in entries:
                    entry["probe"] = owner is not None and entry.get("owner") == owner
                _insert_or_skip(engine, entries)
            pipe = client.pipeline()
            usage.count(pipe, entries)  # the per-key series of /metrics, once per job written
            pipe.ltrim(PENDING, len(raw), -1)
            pipe.execute()
            written += len(entries)
            if len(raw) < batch:
                break
    finally:
        try:
            lock.release()
        except redis.exceptions.LockError:
            pass
    return written


EVERY_S = 2.0
# How often the leading drainer looks for waiting summaries.
POLL_S = 0.5


class Drainer(threading.Thread):
    """One per worker, leading by a lease: writes the waiting summaries into the
    database. Cheap when nothing waits, quiet while the database is down (one
    warning, then one line when it is back), and backing off between failed
    tries so a dead database costs little. A thread of its own: a slow
    database never holds up the farm controller."""

    def __init__(self, name: str, redis_client: redis.Redis, database_url: str) -> None:
        super().__init__(name="ndif-ledger-drainer", daemon=True)
        self.redis = redis_client
        self.database_url = database_url
        self.lease = leases.Lease(redis_client, LEADER, name, LEASE_MS)
        self.stopping = threading.Event()
        self.engine = None
        self.down_since: Optional[float] = None
        self.failures = 0
        self.next_try = 0.0
        self.probes_marked = False

    def run(self) -> None:
        self.lease.lead(self.tick, self.stopping, POLL_S, log, "ledger drain")

    def stop(self) -> None:
        self.stopping.set()
        self.lease.release()

    def tick(self) -> int:
        """Drain once if summaries wait and no backoff holds it; return how many were written."""
        from sqlalchemy.exc import SQLAlchemyError

        from . import db

        client = self.redis
        now = time.monotonic()
        if now < self.next_try or not client.llen(PENDING):
            return 0
        try:
            if self.engine is None:
                self.engine = db.engine_for(self.database_url)
            written = drain(client, self.engine)
            owner = None if self.probes_marked else probe_owner(client)
            if owner:
                mark_probes(self.engine, owner)
                self.probes_marked = True
        except (SQLAlchemyError, OSError) as error:
            self.failures += 1
            self.next_try = now + min(MAX_BACKOFF_S, 0.5 * 2 ** self.failures)
            if self.down_since is None:
                self.down_since = time.time()
                log.warning(
                    "ledger: the database cannot be reached (%s: %s); ended jobs wait in Redis (%s) "
                    "and are written when it is back", type(error).__name__, str(error).splitlines()[0][:200], PENDING,
                )
            return 0
        if self.down_since is not None:
            log.warning("ledger: the database is back after %.0f s; %d waiting jobs written",
                        time.time() - self.down_since, written)
        self.down_since, self.failures = None, 0
        # Batched: at most one database transaction per EVERY_S.
        self.next_try = now + EVERY_S
        return written


def mark_probes(engine, owner: str) -> int:
    """Mark the rows written before the ``probe`` column existed (NULL there):
    a probe's when ``owner`` (the probe key's) ran it. Once per drainer: later
    rows are marked as they are written. Returns how many rows were marked."""
    from sqlalchemy import update
    from sqlalchemy.orm import Session

    from .db import LedgerEntry

    with Session(engine) as session, session.begin():
        result = session.execute(update(LedgerEntry).where(LedgerEntry.probe.is_(None))
                                 .values(probe=LedgerEntry.owner == owner))
        return result.rowcount or 0


def prune(engine, retention_days: float, now: Optional[datetime.datetime] = None) -> int:
    """Delete rows of jobs that finished more than ``retention_days`` ago (run
    by the beat's cleanup); 0 days keeps everything. Returns how many went."""
    from sqlalchemy import delete
    from sqlalchemy.orm import Session

    from .db import LedgerEntry

    if retention_days <= 0:
        return 0
    now = now or datetime.datetime.now(datetime.timezone.utc)
    cutoff = now - datetime.timedelta(days=retention_days)
    with Session(engine) as session, session.begin():
        return session.execute(delete(LedgerEntry).where(LedgerEntry.finished_at < cutoff)).rowcount or 0
