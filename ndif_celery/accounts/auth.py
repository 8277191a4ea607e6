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
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from ndif_celery import config
from ndif_celery.errors import Refused

from . import db

HEADER = "ndif-api-key"
_KEY_FORMAT = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")

MISSING = (
    "Missing or invalid API key. Set one with nnsight.CONFIG.set_default_api_key(...) or the "
    "NDIF_API_KEY environment variable; ask this server's operator for a key."
)
INVALID = "Invalid API key."
MALFORMED = ("Invalid API key format: the key sent is not one this server issues. API keys must be in the "
             "format: xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx")
UNAVAILABLE = "Auth backend unavailable."


class AuthError(Refused):
    """A key refused (``errors.Refused``): 401 missing, 400 malformed, 403 unknown or revoked,
    429 throttled, 503 the key database unreachable."""


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


THROTTLED = (
    "Too many attempts with unknown API keys from this address; new keys from it are refused "
    "for up to a minute (NDIF_AUTH_FAILURES_PER_MIN). Check the key you set."
)


class BoundedCache:
    """A least-recently-used map that never holds more than ``size`` entries.

    Every table the web fills from what a client sends (keys it presented, the
    addresses they came from) is one of these: whatever a flood of made-up
    keys does, a web process keeps at most ``size`` entries per table."""

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self._data: OrderedDict = OrderedDict()

    def get(self, key, default=None):
        value = self._data.get(key, default)
        if key in self._data:
            self._data.move_to_end(key)
        return value

    def put(self, key, value) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.size:
            self._data.popitem(last=False)

    def pop(self, key) -> None:
        self._data.pop(key, None)

    def __contains__(self, key) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)


class Authenticator:
    """Resolves keys to identities, with a short cache so a busy client does not
    cost a database query per request (a revoked key stops within the cache time).

    Made-up keys can neither grow the web nor hammer the database: known and
    unknown keys are cached in separate LRU tables of ``NDIF_AUTH_CACHE_MAX``
    entries each (so a flood of unknown keys never pushes a real key out), and
    a client address whose never-seen keys failed ``NDIF_AUTH_FAILURES_PER_MIN``
    times this minute gets 429 for its next never-seen keys without a lookup.
    A key this process has seen valid is always looked up, so a flood from a
    shared address (a NAT, a proxy) does not lock out its real users' keys."""

    def __init__(self, settings: config.Settings) -> None:
        self.settings = settings
        self._engine = None
        self._known = BoundedCache(settings.auth_cache_max)  # key -> (looked up at, row)
        self._unknown = BoundedCache(settings.auth_cache_max)  # key -> looked up at
        self._failures = BoundedCache(settings.auth_cache_max)  # address -> (minute, failed lookups)
        self._lock = threading.Lock()

    @property
    def engine(self):
        if self._engine is None:
            self._engine = db.engine_for(self.settings.database_url)
        return self._engine

    def identify(self, key: Optional[str], address: Optional[str] = None) -> Identity:
        """``address``: the client's address, for the failed-lookup throttle."""
        if not self.settings.auth:
            return Identity(trusted=self.settings.default_trusted)
        if not key:
            raise AuthError(MISSING, 401)
        if not _KEY_FORMAT.match(key):
            raise AuthError(MALFORMED, 400)  # never echoed: behind a proxy it may hold another key
        row = self._lookup(key, address or "")
        if row is None:
            raise AuthError(INVALID, 403)
        return Identity(
            key_id=row["key_id"], email=row["email"], tags=tuple(row["tags"]), trusted="trusted" in row["tags"],
            rate_limit_per_min=row["rate_limit_per_min"], max_concurrent_jobs=row["max_concurrent_jobs"],
        )

    def _lookup(self, key: str, address: str) -> Optional[dict]:
        now = time.monotonic()
        fresh = self.settings.auth_cache_s
        minute = int(now // 60)
        with self._lock:
            known = self._known.get(key)
            if known is not None and now - known[0] < fresh:
                return known[1]
            unknown = self._unknown.get(key)
            if unknown is not None and now - unknown < fresh:
                return None
            if known is None and self._throttled(address, minute):
                raise AuthError(THROTTLED, 429)
        try:
            row = db.find_key(self.engine, key)
        except Exception as error:  # noqa: BLE001 - any database failure fails closed
            self._engine = None
            raise AuthError(
                f"{UNAVAILABLE} (the key database cannot be reached: {type(error).__name__}; "
                "please retry shortly)", 503,
            ) from None
        with self._lock:
            if row is not None:
                self._known.put(key, (now, row))
                self._unknown.pop(key)
            else:
                self._known.pop(key)  # revoked
                self._unknown.put(key, now)
                if known is None:
                    seen_minute, failed = self._failures.get(address, (minute, 0))
                    self._failures.put(address, (minute, failed + 1 if seen_minute == minute else 1))
        return row

    def _throttled(self, address: str, minute: int) -> bool:
        limit = self.settings.auth_failures_per_min
        if not limit:
            return False
        seen_minute, failed = self._failures.get(address, (minute, 0))
        return seen_minute == minute and failed >= limit

    def sizes(self) -> dict:
        """How many entries each table holds (for tests and operators)."""
        with self._lock:
            return {"known": len(self._known), "unknown": len(self._unknown), "addresses": len(self._failures)}
