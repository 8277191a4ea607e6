"""Every ``NDIF_*`` setting, its type and its default, read in one place.

Each process (web, worker, CLI) calls :func:`load` once and passes the
resulting :class:`Settings` around. Defaults run a whole farm on one host with
nothing else configured: an embedded Redis, a filesystem result store served by
the web app, and SQLite under ``NDIF_HOME``. Point the URLs at real services to
run a farm across hosts.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Mapping, Optional

from .jail_layers import parse_disable, parse_require
from .versions import parse_minimum

MiB = 1024 * 1024
GiB = 1024 * MiB


@dataclass(frozen=True)
class Settings:
    home: Path
    api_host: str
    api_port: int
    api_url: str
    web_workers: int
    web_threads: int
    redis_url: str
    embedded_redis: bool
    embedded_redis_port: int
    object_store_url: str
    object_store_public_url: str
    object_store_access_key: str
    object_store_secret_key: str
    object_store_bucket: str
    object_store_region: str
    object_store_verify: bool
    results_dir: Path
    secret_key: str
    max_inline_bytes: int
    result_url_ttl_s: int
    job_ttl_s: int
    visibility_timeout_s: int
    redis_outage_s: float
    cleanup_interval_s: float
    ledger_retention_days: float
    database_url: str
    flower_port: int
    flower_host: str
    log_level: str
    worker_gpus: str
    worker_name: str
    torch_threads: int
    worker_memory_bytes: int
    padding_factor: float
    padding_bytes: int
    max_replicas: int
    replica_wait_s: float
    replica_idle_s: float
    autoscale_backoff_s: float
    controller_interval_s: float
    auth: bool
    default_trusted: bool
    isolation: str
    jail_waived: tuple
    jail_disabled: tuple
    jail_cgroup_root: str
    verify_untrusted: bool
    auth_cache_s: float
    auth_cache_max: int
    auth_failures_per_min: int
    execution_timeout_s: float
    job_memory_bytes: int
    job_disk_bytes: int
    log_lines_per_s: float
    log_bytes_per_job: int
    max_result_bytes: int
    max_payload_bytes: int
    rate_limit_per_min: int
    max_concurrent_jobs: int
    max_queue_depth: int
    max_websockets_per_key: int
    worker_metrics_port: int
    worker_metrics_host: str
    flower_url: str
    min_nnsight_version: str
    min_python_version: str
    models: str
    trust_remote_code: str

    def secrets(self) -> tuple:
        """Values an untrusted child must not be able to read."""
        return tuple(
            value
            for value in (
                self.secret_key, self.object_store_access_key, self.object_store_secret_key,
                self.redis_url, self.database_url,
            )
            if value
        )

    @property
    def uses_s3(self) -> bool:
        return bool(self.object_store_url)


# The first is the default. Both fork the jailed children from a per-model
# zygote that holds no secret and no job's data: exec'd fresh ("zygote"), or
# forked from the fork server the worker makes of itself at start ("fork").
ISOLATION_MODES = ("zygote", "fork")

# With NDIF_AUTH=1 the farm is shared by people who need not trust each other,
# so these limits replace the single-host defaults (no limit, 4 GiB results,
# 256 MiB payloads) that suit one researcher on their own machine. Why each
# number: docs/configuration.md and docs/security.md "Defaults with auth on".
# A variable that is set, 0 (no limit) included, always wins over these; a
# key's own limits in the database (keys create --rate-limit/--max-concurrent)
# win over both.
AUTH_ON_DEFAULTS = {
    "NDIF_MAX_CONCURRENT_JOBS": 4,
    "NDIF_MAX_QUEUE_DEPTH": 32,
    "NDIF_RATE_LIMIT_PER_MIN": 120,
    "NDIF_MAX_RESULT_BYTES": 1 * GiB,
    "NDIF_MAX_PAYLOAD_BYTES": 64 * MiB,
    "NDIF_MAX_WEBSOCKETS_PER_KEY": 16,
}


def _choice(env: Mapping[str, str], name: str, choices: tuple) -> str:
    value = (env.get(name) or choices[0]).strip().lower()
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _limit(env: Mapping[str, str], name: str, single_host: int, auth: bool) -> int:
    """A limit: the variable when it is set (0 = no limit); when unset, the
    auth-on default if auth is on, else the single-host default."""
    if auth and env.get(name, "") == "":
        return AUTH_ON_DEFAULTS[name]
    return _int(env, name, single_host)


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be a boolean (1/0, true/false), got {raw!r}")


def _secret_key(env: Mapping[str, str], home: Path) -> str:
    """The key that signs result URLs of the filesystem store.

    Taken from ``NDIF_SECRET_KEY`` when set (several web hosts must share it);
    otherwise made once and kept in ``NDIF_HOME/secret_key`` so every process
    of a single-host stack agrees on it without anyone configuring one.
    """
    if env.get("NDIF_SECRET_KEY"):
        return env["NDIF_SECRET_KEY"]
    path = home / "secret_key"
    home.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass  # another process of this stack made it first
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path.read_text().strip()


def _browsable(host: str) -> str:
    """A bind address as a browser can reach it (a wildcard means this host)."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(host, f"[{host}]" if ":" in host else host)


def load(env: Optional[Mapping[str, str]] = None) -> Settings:
    """Read the settings from ``env`` (default: the process environment)."""
    env = os.environ if env is None else env
    home = Path(env.get("NDIF_HOME") or "~/.ndif-celery").expanduser().resolve()
    api_host = env.get("NDIF_API_HOST") or "127.0.0.1"
    api_port = _int(env, "NDIF_API_PORT", 8001)
    redis_port = _int(env, "NDIF_EMBEDDED_REDIS_PORT", 6380)
    redis_url = env.get("NDIF_REDIS_URL", "")
    object_store_url = env.get("NDIF_OBJECT_STORE_URL", "")
    auth = _bool(env, "NDIF_AUTH", False)
    settings = Settings(
        home=home,
        api_host=api_host,
        api_port=api_port,
        api_url=(env.get("NDIF_API_URL") or f"http://{api_host}:{api_port}").rstrip("/"),
        web_workers=_int(env, "NDIF_WEB_WORKERS", 2),
        web_threads=_int(env, "NDIF_WEB_THREADS", 64),
        redis_url=redis_url or f"redis://127.0.0.1:{redis_port}/0",
        embedded_redis=not redis_url,
        embedded_redis_port=redis_port,
        object_store_url=object_store_url,
        object_store_public_url=env.get("NDIF_OBJECT_STORE_PUBLIC_URL", "") or object_store_url,
        object_store_access_key=env.get("NDIF_OBJECT_STORE_ACCESS_KEY", "minioadmin"),
        object_store_secret_key=env.get("NDIF_OBJECT_STORE_SECRET_KEY", "minioadmin"),
        object_store_bucket=env.get("NDIF_OBJECT_STORE_BUCKET", "ndif-results"),
        object_store_region=env.get("NDIF_OBJECT_STORE_REGION", "us-east-1"),
        object_store_verify=_bool(env, "NDIF_OBJECT_STORE_VERIFY", True),
        results_dir=Path(env.get("NDIF_RESULTS_DIR") or home / "results").expanduser(),
        secret_key=_secret_key(env, home),
        max_inline_bytes=_int(env, "NDIF_MAX_INLINE_BYTES", 4 * MiB),
        result_url_ttl_s=_int(env, "NDIF_RESULT_URL_TTL_S", 3600),
        job_ttl_s=_int(env, "NDIF_JOB_TTL_S", 24 * 3600),
        visibility_timeout_s=_int(env, "NDIF_VISIBILITY_TIMEOUT_S", 6 * 3600),
        redis_outage_s=_float(env, "NDIF_REDIS_OUTAGE_S", 30.0),
        cleanup_interval_s=_float(env, "NDIF_CLEANUP_INTERVAL_S", 300.0),
        ledger_retention_days=_float(env, "NDIF_LEDGER_RETENTION_DAYS", 90.0),
        database_url=env.get("NDIF_DATABASE_URL") or f"sqlite:///{home / 'ndif.db'}",
        flower_port=_int(env, "NDIF_FLOWER_PORT", 5555),
        # Loopback by default: Flower has no authentication of its own.
        flower_host=env.get("NDIF_FLOWER_HOST") or "127.0.0.1",
        log_level=(env.get("NDIF_LOG_LEVEL") or "INFO").upper(),
        worker_gpus=env.get("NDIF_WORKER_GPUS", ""),
        worker_name=env.get("NDIF_WORKER_NAME", ""),
        # 0 = torch's default (every core); see docs/performance.md.
        torch_threads=_int(env, "NDIF_TORCH_THREADS", 0),
        # 0 = measure: the GPUs' memory, or half the host's RAM on a CPU worker.
        worker_memory_bytes=int(_float(env, "NDIF_WORKER_MEMORY_GIB", 0) * GiB),
        padding_factor=_float(env, "NDIF_PADDING_FACTOR", 0.15),
        padding_bytes=_int(env, "NDIF_PADDING_BYTES", 256 * MiB),
        max_replicas=_int(env, "NDIF_MAX_REPLICAS", 3),
        replica_wait_s=_float(env, "NDIF_REPLICA_WAIT_S", 30.0),
        replica_idle_s=_float(env, "NDIF_REPLICA_IDLE_S", 600.0),
        autoscale_backoff_s=_float(env, "NDIF_AUTOSCALE_BACKOFF_S", 30.0),
        controller_interval_s=_float(env, "NDIF_CONTROLLER_INTERVAL_S", 0.5),
        auth=auth,
        default_trusted=_bool(env, "NDIF_DEFAULT_TRUSTED", True),
        # How untrusted jobs are isolated: see docs/security.md.
        isolation=_choice(env, "NDIF_ISOLATION", ISOLATION_MODES),
        # Jail layers: all required unless waived ("all,-seccomp"); see ndif_celery.jail_layers.
        jail_waived=parse_require(env.get("NDIF_JAIL_REQUIRE", "")),
        jail_disabled=parse_disable(env.get("NDIF_JAIL_DISABLE", "")),
        jail_cgroup_root=env.get("NDIF_JAIL_CGROUP_ROOT", ""),
        # The keyed weight check after every untrusted job on every model (always on GPU models).
        verify_untrusted=_bool(env, "NDIF_VERIFY_UNTRUSTED", False),
        auth_cache_s=_float(env, "NDIF_AUTH_CACHE_S", 5.0),
        # Entries in each of the web's auth tables (known keys, unknown keys,
        # addresses that failed): made-up keys cannot grow a web process.
        auth_cache_max=_int(env, "NDIF_AUTH_CACHE_MAX", 10000),
        # Database lookups of never-seen keys that fail, per client address per
        # minute per web process, before that address's new keys are refused (0 = off).
        auth_failures_per_min=_int(env, "NDIF_AUTH_FAILURES_PER_MIN", 60),
        execution_timeout_s=_float(env, "NDIF_EXECUTION_TIMEOUT_S", 3600.0),
        job_memory_bytes=int(_float(env, "NDIF_JOB_MEMORY_GIB", 8) * GiB),
        job_disk_bytes=_int(env, "NDIF_JOB_DISK_MB", 256) * MiB,
        log_lines_per_s=_float(env, "NDIF_LOG_LINES_PER_S", 100.0),
        log_bytes_per_job=_int(env, "NDIF_LOG_BYTES_PER_JOB", 4 * MiB),
        # Limits: single-host defaults here, AUTH_ON_DEFAULTS when auth is on.
        max_result_bytes=_limit(env, "NDIF_MAX_RESULT_BYTES", 4 * GiB, auth),
        max_payload_bytes=_limit(env, "NDIF_MAX_PAYLOAD_BYTES", 256 * MiB, auth),
        rate_limit_per_min=_limit(env, "NDIF_RATE_LIMIT_PER_MIN", 0, auth),
        max_concurrent_jobs=_limit(env, "NDIF_MAX_CONCURRENT_JOBS", 0, auth),
        max_queue_depth=_limit(env, "NDIF_MAX_QUEUE_DEPTH", 0, auth),
        max_websockets_per_key=_limit(env, "NDIF_MAX_WEBSOCKETS_PER_KEY", 0, auth),
        # 0 = no metrics endpoint on the worker; a taken port moves to the next few.
        worker_metrics_port=_int(env, "NDIF_WORKER_METRICS_PORT", 9108),
        worker_metrics_host=env.get("NDIF_WORKER_METRICS_HOST") or "127.0.0.1",
        flower_url=(env.get("NDIF_FLOWER_URL") or f"http://{_browsable(api_host)}:{_int(env, 'NDIF_FLOWER_PORT', 5555)}").rstrip("/"),
        # "" = no gate; see ndif_celery.versions.
        min_nnsight_version=parse_minimum("NDIF_MIN_NNSIGHT_VERSION", env.get("NDIF_MIN_NNSIGHT_VERSION", "")),
        min_python_version=parse_minimum("NDIF_MIN_PYTHON_VERSION", env.get("NDIF_MIN_PYTHON_VERSION", "")),
        # Which repos may be loaded, and which may run their own code: ndif_celery.model_policy.
        models=env.get("NDIF_MODELS", "").strip(),
        trust_remote_code=env.get("NDIF_TRUST_REMOTE_CODE", "").strip(),
    )
    for field in fields(Settings):
        value = getattr(settings, field.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"{field.name} must not be negative, got {value}")
    return settings
