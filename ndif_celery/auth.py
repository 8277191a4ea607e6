"""Who is asking: the API key in the ``ndif-api-key`` header, and what it may do.

With ``NDIF_AUTH`` off (the single-host default) everyone is anonymous and,
as on NDIF, trusted, unless ``NDIF_DEFAULT_TRUSTED=0`` sends every request
down the isolated path. With auth on, a request needs a known, unrevoked key;
the key decides trust, priority and limits, and owns the jobs it submits. The
refusals use NDIF's client-visible messages. A database that cannot be reached
refuses (fails closed) with 503.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from . import config, db

HEADER = "ndif-api-key"
_KEY_FORMAT = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")

MISSING = (
    "Missing or invalid API key. Set one with nnsight.CONFIG.set_default_api_key(...) or the "
    "NDIF_API_KEY environment variable; ask this server's operator for a key."
)
INVALID = "Invalid API key."
UNAVAILABLE = "Auth backend unavailable."


class AuthError(Exception):
    def __init__(self, detail: str, status: int) -> None:
        super().__init__(detail)
        self.detail = detail
        self.status = status


@dataclass(frozen=True)
class Identity:
    key_id: Optional[int] = None  # None: anonymous (auth off)
    email: Optional[str] = None
    tags: tuple = field(default_factory=tuple)
    trusted: bool = True
    rate_limit_per_min: Optional[int] = None
    max_concurrent_jobs: Optional[int] = None

    @property
    def owner(self) -> str:
        """What a job records as its owner; compared on every later read."""
        return f"key:{self.key_id}" if self.key_id is not None else "anonymous"


class Authenticator:
    """Resolves keys to identities, with a short cache so a busy client does not
    cost a database query per request (a revoked key stops within the cache time)."""

    def __init__(self, settings: config.Settings) -> None:
        self.settings = settings
        self._engine = None
        self._cache: dict[str, tuple[float, Optional[dict]]] = {}
        self._lock = threading.Lock()

    @property
    def engine(self):
        if self._engine is None:
            self._engine = db.engine_for(self.settings.database_url)
        return self._engine

    def identify(self, key: Optional[str]) -> Identity:
        if not self.settings.auth:
            return Identity(trusted=self.settings.default_trusted)
        if not key:
            raise AuthError(MISSING, 401)
        if not _KEY_FORMAT.match(key):
            raise AuthError(
                f"Invalid API key format: {key[:64]!r}. API keys must be in the format: "
                "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx",
                400,
            )
        row = self._lookup(key)
        if row is None:
            raise AuthError(INVALID, 403)
        return Identity(
            key_id=row["key_id"], email=row["email"], tags=tuple(row["tags"]), trusted="trusted" in row["tags"],
            rate_limit_per_min=row["rate_limit_per_min"], max_concurrent_jobs=row["max_concurrent_jobs"],
        )

    def _lookup(self, key: str) -> Optional[dict]:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None and now - hit[0] < self.settings.auth_cache_s:
            return hit[1]
        try:
            row = db.find_key(self.engine, key)
        except Exception as error:  # noqa: BLE001 - any database failure fails closed
            self._engine = None
            raise AuthError(
                f"{UNAVAILABLE} (the key database cannot be reached: {type(error).__name__}; "
                "please retry shortly)", 503,
            ) from None
        with self._lock:
            self._cache[key] = (now, row)
        return row
