"""Users and API keys (SQLAlchemy): SQLite on one host, PostgreSQL in production.

A key is shown once, when it is made, and stored only as its SHA-256: a
leaked database does not leak working keys. Tags on a key say what its
requests may do: ``trusted`` (run in the worker's process), ``priority`` and
``admin`` (may open the dashboard). Per-key limits override the farm-wide
``NDIF_*`` defaults where set.

The same metadata holds the job ledger (:class:`LedgerEntry`, one row per
ended job), written in batches by the ledger's drainer (``ndif_celery.accounts.ledger``),
and the operators' audit log (:class:`AuditEntry`, ``ndif_celery.accounts.audit``).
"""

from __future__ import annotations

import datetime
import hashlib
import uuid
from typing import Optional

from sqlalchemy import BigInteger, Boolean, DateTime, Float, ForeignKey, Integer, String, Text, create_engine, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship

TAGS = ("trusted", "priority", "admin")


class Base(DeclarativeBase):
    pass


class User(Base):
    __tablename__ = "users"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    email: Mapped[str] = mapped_column(String(320), unique=True, index=True)
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=lambda: _now())
    keys: Mapped[list["ApiKey"]] = relationship(back_populates="user")


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    prefix: Mapped[str] = mapped_column(String(8))  # for operators to tell keys apart
    tags: Mapped[str] = mapped_column(String(200), default="")
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=lambda: _now())
    revoked_at: Mapped[Optional[datetime.datetime]] = mapped_column(DateTime(timezone=True), nullable=True)
    rate_limit_per_min: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    max_concurrent_jobs: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    user: Mapped[User] = relationship(back_populates="keys")

    @property
    def tag_list(self) -> list[str]:
        return [t for t in self.tags.split(",") if t]


class LedgerEntry(Base):
    """One ended job: who, what, how it ended, where it ran and what each phase cost."""

    __tablename__ = "job_ledger"

    job_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(64), index=True)  # key:<id> or anonymous
    email: Mapped[Optional[str]] = mapped_column(String(320), nullable=True, index=True)
    model: Mapped[str] = mapped_column(String(300), index=True)  # repo id
    model_key: Mapped[str] = mapped_column(Text)
    outcome: Mapped[str] = mapped_column(String(16))  # COMPLETED or ERROR
    error_kind: Mapped[Optional[str]] = mapped_column(String(32), nullable=True)
    error: Mapped[Optional[str]] = mapped_column(String(500), nullable=True)
    worker: Mapped[Optional[str]] = mapped_column(String(200), nullable=True)
    isolated: Mapped[Optional[bool]] = mapped_column(Boolean, nullable=True)
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    received_at: Mapped[Optional[datetime.datetime]] = mapped_column(DateTime(timezone=True), nullable=True)
    started_at: Mapped[Optional[datetime.datetime]] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), index=True)
    queue_ms: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    deserialize_ms: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    run_ms: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    upload_ms: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    payload_bytes: Mapped[Optional[int]] = mapped_column(BigInteger, nullable=True)
    result_bytes: Mapped[Optional[int]] = mapped_column(BigInteger, nullable=True)
    # GPUs of the worker that ran it (0: a CPU worker), for GPU-seconds (``ndif_celery.accounts.usage``).
    devices: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    # A health probe's job (its owner was the probe key's, ``NDIF_PROBE_API_KEY``): left out of
    # ``jobs``, ``usage`` and the dashboard unless asked for. NULL: written before the column was.
    probe: Mapped[Optional[bool]] = mapped_column(Boolean, nullable=True)


class AuditEntry(Base):
    """One operator action taken from the dashboard: who, what, on what, and how it ended."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), index=True, default=lambda: _now())
    actor: Mapped[str] = mapped_column(String(64))  # key:<id> of the admin key
    email: Mapped[Optional[str]] = mapped_column(String(320), nullable=True)
    action: Mapped[str] = mapped_column(String(32))
    target: Mapped[str] = mapped_column(String(300))  # a repo, a job id, a schedule id
    detail: Mapped[str] = mapped_column(Text, default="")  # the action's other fields, as sent (JSON)
    outcome: Mapped[str] = mapped_column(String(16))  # done, refused or failed
    message: Mapped[str] = mapped_column(String(1000), default="")
    address: Mapped[Optional[str]] = mapped_column(String(64), nullable=True)  # the client's IP


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def engine_for(url: str) -> Engine:
    if url.startswith("sqlite:///"):
        from pathlib import Path

        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, pool_pre_ping=True, future=True)
    Base.metadata.create_all(engine)
    _add_columns(engine)
    return engine


# Columns added to a table after it first shipped: create_all makes missing tables, not columns.
_ADDED_COLUMNS = {"job_ledger": {"devices": "INTEGER", "probe": "BOOLEAN"}}


def _add_columns(engine: Engine) -> None:
    """Add the :data:`_ADDED_COLUMNS` an older database lacks (several processes may race: each re-checks)."""
    from sqlalchemy import inspect, text
    from sqlalchemy.exc import DBAPIError

    for table, columns in _ADDED_COLUMNS.items():
        have = {column["name"] for column in inspect(engine).get_columns(table)}
        for name, kind in columns.items():
            if name in have:
                continue
            try:
                with engine.begin() as connection:
                    connection.execute(text(f"ALTER TABLE {table} ADD COLUMN {name} {kind}"))
            except DBAPIError:
                if name not in {column["name"] for column in inspect(engine).get_columns(table)}:
                    raise


def create_key(
    engine: Engine,
    email: str,
    tags: tuple[str, ...] = (),
    rate_limit_per_min: Optional[int] = None,
    max_concurrent_jobs: Optional[int] = None,
) -> str:
    """Make a key for ``email`` (creating the user if new); return the key itself."""
    unknown = set(tags) - set(TAGS)
    if unknown:
        raise ValueError(f"unknown tags {sorted(unknown)}; known: {', '.join(TAGS)}")
    key = str(uuid.uuid4())
    with Session(engine) as session, session.begin():
        user = session.scalar(select(User).where(User.email == email))
        if user is None:
            user = User(email=email)
            session.add(user)
        session.add(
            ApiKey(
                user=user, key_hash=hash_key(key), prefix=key[:8], tags=",".join(sorted(set(tags))),
                rate_limit_per_min=rate_limit_per_min, max_concurrent_jobs=max_concurrent_jobs,
            )
        )
    return key


def list_keys(engine: Engine) -> list[dict]:
    with Session(engine) as session:
        rows = session.scalars(select(ApiKey).order_by(ApiKey.id)).all()
        return [
            {
                "id": row.id, "prefix": row.prefix, "email": row.user.email, "tags": row.tag_list,
                "created_at": row.created_at.isoformat(), "revoked": row.revoked_at is not None,
                "rate_limit_per_min": row.rate_limit_per_min, "max_concurrent_jobs": row.max_concurrent_jobs,
            }
            for row in rows
        ]


def revoke_key(engine: Engine, key_or_prefix: str) -> int:
    """Revoke by the key itself or its 8-character prefix; return how many."""
    with Session(engine) as session, session.begin():
        match = ApiKey.prefix == key_or_prefix if len(key_or_prefix) == 8 else ApiKey.key_hash == hash_key(key_or_prefix)
        rows = session.scalars(select(ApiKey).where(match)).all()
        for row in rows:
            row.revoked_at = row.revoked_at or _now()
        return len(rows)


def find_key(engine: Engine, key: str) -> Optional[dict]:
    """The identity behind a presented key, or None if unknown or revoked."""
    with Session(engine) as session:
        row = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key)))
        if row is None or row.revoked_at is not None:
            return None
        return {
            "key_id": row.id, "email": row.user.email, "tags": row.tag_list,
            "rate_limit_per_min": row.rate_limit_per_min, "max_concurrent_jobs": row.max_concurrent_jobs,
        }
