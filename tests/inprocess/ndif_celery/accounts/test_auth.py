"""Defaults with auth on: with ``NDIF_AUTH=1`` a farm is
shared, so the limits default to values that protect it (per-key concurrency,
queue depth, rate, payload and result sizes, open websockets per key), and the
auth cache cannot be grown, nor the key database hammered, by made-up keys.

These tests pin the rules (config, the cache's bound, the database queries
a flood costs); the attacks, by raw HTTP and the real client against a real
stack, are tests/e2e/access/test_auth_defaults.py."""

from __future__ import annotations

import time
import uuid

import pytest
from sqlalchemy import event

from ndif_celery import config
from ndif_celery.accounts import auth, db
from tests.support.stacks.stack import client_on_stack

MiB = 1024 * 1024
LIMITS = ("NDIF_MAX_CONCURRENT_JOBS", "NDIF_MAX_QUEUE_DEPTH", "NDIF_RATE_LIMIT_PER_MIN",
          "NDIF_MAX_RESULT_BYTES", "NDIF_MAX_PAYLOAD_BYTES", "NDIF_MAX_WEBSOCKETS_PER_KEY")
FIELDS = ("max_concurrent_jobs", "max_queue_depth", "rate_limit_per_min",
          "max_result_bytes", "max_payload_bytes", "max_websockets_per_key")


# --- config -----------------------------------------------------------------------


def test_auth_on_defaults_apply_only_with_auth_on_and_only_when_unset(tmp_path):
    home = {"NDIF_HOME": str(tmp_path)}
    off, on = config.load(home), config.load({**home, "NDIF_AUTH": "1"})
    assert [getattr(off, f) for f in FIELDS] == [0, 0, 0, 4 * 1024**3, 256 * MiB, 0], "single-host defaults"
    assert [getattr(on, f) for f in FIELDS] == [4, 32, 120, 1024**3, 64 * MiB, 16]
    assert [getattr(on, f) for f in FIELDS] == [config.AUTH_ON_DEFAULTS[v] for v in LIMITS]
    # A variable that is set wins over the auth-on default, 0 (no limit) included.
    explicit = config.load({**home, "NDIF_AUTH": "1", **{v: "0" for v in LIMITS}})
    assert [getattr(explicit, f) for f in FIELDS] == [0] * len(FIELDS)
    chosen = config.load({**home, "NDIF_AUTH": "1", "NDIF_MAX_CONCURRENT_JOBS": "9", "NDIF_MAX_PAYLOAD_BYTES": "1000"})
    assert (chosen.max_concurrent_jobs, chosen.max_payload_bytes, chosen.max_queue_depth) == (9, 1000, 32)
    # With auth off a set variable is used as before.
    assert config.load({**home, "NDIF_RATE_LIMIT_PER_MIN": "7"}).rate_limit_per_min == 7
    with pytest.raises(ValueError, match="NDIF_MAX_WEBSOCKETS_PER_KEY must be an integer"):
        config.load({**home, "NDIF_AUTH": "1", "NDIF_MAX_WEBSOCKETS_PER_KEY": "many"})


# --- the auth cache ---------------------------------------------------------------


@pytest.fixture
def keys_db(tmp_path):
    settings = config.load({
        "NDIF_HOME": str(tmp_path), "NDIF_AUTH": "1", "NDIF_AUTH_CACHE_MAX": "100",
        "NDIF_DATABASE_URL": f"sqlite:///{tmp_path / 'keys.db'}",
    })
    engine = db.engine_for(settings.database_url)
    return settings, engine


def _counting(authenticator: auth.Authenticator, engine) -> list:
    """Every statement the authenticator's engine runs, recorded."""
    authenticator._engine = engine
    statements: list = []
    event.listen(engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    return statements


def test_made_up_keys_cannot_grow_the_auth_cache(keys_db):
    settings, engine = keys_db
    # No throttle, so every made-up key is looked up; entries fresh for the whole
    # flood, so only eviction (not age) could send the real key back to the database.
    settings = config.load({"NDIF_HOME": str(settings.home), "NDIF_AUTH": "1", "NDIF_AUTH_CACHE_MAX": "100",
                            "NDIF_DATABASE_URL": settings.database_url, "NDIF_AUTH_FAILURES_PER_MIN": "0",
                            "NDIF_AUTH_CACHE_S": "3600"})
    real = db.create_key(engine, "real@example.org")
    authenticator = auth.Authenticator(settings)
    authenticator._engine = engine
    assert authenticator.identify(real, "10.0.0.1").email == "real@example.org"
    for i in range(20000):  # no throttle here: every one is looked up and refused
        with pytest.raises(auth.AuthError) as refused:
            authenticator.identify(str(uuid.uuid4()), f"10.1.{i // 250}.{i % 250}")
        assert refused.value.status == 403 and refused.value.detail == auth.INVALID
    assert authenticator.sizes() == {"known": 1, "unknown": 100, "addresses": 100}
    statements = _counting(authenticator, engine)
    assert authenticator.identify(real, "10.0.0.1").email == "real@example.org"
    assert statements == [], "the flood pushed the real key out of its cache"


def test_a_flood_of_made_up_keys_hits_the_database_a_bounded_number_of_times(keys_db):
    settings, engine = keys_db
    seen, fresh = db.create_key(engine, "seen@example.org"), db.create_key(engine, "fresh@example.org")
    authenticator = auth.Authenticator(settings)
    statements = _counting(authenticator, engine)
    authenticator.identify(seen, "192.0.2.7")
    if time.monotonic() % 60 > 40:  # the throttle's windows are minutes of time.monotonic(): flood inside one
        time.sleep(60.5 - time.monotonic() % 60)
    before, outcomes = len(statements), {}
    for _ in range(20000):
        try:
            authenticator.identify(str(uuid.uuid4()), "192.0.2.7")
        except auth.AuthError as error:
            outcomes[error.status] = outcomes.get(error.status, 0) + 1
    limit = settings.auth_failures_per_min
    assert outcomes == {403: limit, 429: 20000 - limit}
    queries = len(statements) - before
    assert queries <= limit * 3, f"{queries} statements for 20000 made-up keys"  # find_key: key, then its user
    with pytest.raises(auth.AuthError, match="Too many attempts with unknown API keys from this address"):
        authenticator.identify(fresh, "192.0.2.7")  # a never-seen key from the flooding address waits
    authenticator._known.put(seen, (0.0, authenticator._known.get(seen)[1]))  # its cache entry is stale now
    assert authenticator.identify(seen, "192.0.2.7").email == "seen@example.org", "a key seen valid is not locked out"
    assert authenticator.identify(fresh, "198.51.100.1").email == "fresh@example.org", "other addresses unaffected"
    assert max(authenticator.sizes().values()) <= 100


# --- the attacks, against a real stack with auth on and no limit set --------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory, hf_home):
    # The lease of a dead web process's sockets at its shortest (NDIF_SOCKET_LEASE_S, not a
    # limit the auth-on defaults set), so the test of their lapse waits 10 s, not 30.
    with client_on_stack(tmp_path_factory.mktemp("auth-defaults"), hf_home,
                         {"NDIF_AUTH": "1", "NDIF_SOCKET_LEASE_S": "10"}) as stack:
        yield stack


@pytest.fixture(scope="module")
def engine(stack):
    return db.engine_for(config.load(stack.env).database_url)


# --- helpers ----------------------------------------------------------------------
