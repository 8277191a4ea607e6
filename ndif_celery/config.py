"""Every ``NDIF_*`` setting, its type and its default, declared once.

Each process (web, worker, CLI) calls :func:`load` once and passes the
resulting :class:`Settings` around. Defaults run a whole farm on one host with
nothing else configured: an embedded Redis, a filesystem result store served by
the web app, and SQLite under ``NDIF_HOME``. Point the URLs at real services to
run a farm across hosts.

:data:`VARIABLES` is the one table: a row per variable with its name, the
``Settings`` attribute, its default, its parser and a line of doc. Why one
table: the ``Settings`` field, its line in ``load()`` and its row in
docs/configuration.md would otherwise be written by hand three times, and
drift. So ``Settings`` takes its fields from the table, :func:`load` is a loop over
it, and ``tests/unit/ndif_celery/test_config.py`` checks docs/configuration.md against
it both ways, names and defaults. The docs stay hand-written (their meanings
are paragraphs with links, in three topic tables with prose between), checked
rather than generated, so this file keeps one line of doc per variable.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Mapping, Optional
from urllib.parse import urlsplit

from .policy import held_formats
from .policy.client_versions import RELEASE, RUNTIME_NAME, parse_minimum
from .policy.jail_layers import parse_disable, parse_require

MiB = 1024 * 1024
GiB = 1024 * MiB

# The first is the default. Both fork the jailed children from a per-model
# zygote that holds no secret and no job's data: exec'd fresh ("zygote"), or
# forked from the fork server the worker makes of itself at start ("fork").
ISOLATION_MODES = ("zygote", "fork")


# --- parsers: (variable name, text) -> value; errors name the variable ------------


def _text(name: str, raw: str) -> str:
    return raw


def _stripped(name: str, raw: str) -> str:
    return raw.strip()


def _upper(name: str, raw: str) -> str:
    return raw.upper()


def _url(name: str, raw: str) -> str:
    return raw.rstrip("/")


def _path(name: str, raw: str) -> Path:
    return Path(raw).expanduser()


def _home(name: str, raw: str) -> Path:
    return Path(raw).expanduser().resolve()


def _int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _positive(name: str, raw: str) -> int:
    value = _int(name, raw)
    if value < 1:
        raise ValueError(f"{name} must be an integer of at least 1, got {raw!r}")
    return value


def _non_negative(name: str, raw: str) -> int:
    value = _int(name, raw)
    if value < 0:
        raise ValueError(f"{name} must be an integer of at least 0, got {raw!r}")
    return value


def _float(name: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None


def _positive_float(name: str, raw: str) -> float:
    value = _float(name, raw)
    if not value > 0:
        raise ValueError(f"{name} must be a number above 0, got {raw!r}")
    return value


def _socket_lease(name: str, raw: str) -> float:
    """At least 10 s: every web process renews its sockets' leases every 5 s
    (``web/hub.py`` RESYNC_S), and a lease must outlive a late renewal."""
    value = _float(name, raw)
    if value < 10:
        raise ValueError(f"{name} must be at least 10 (seconds; web processes renew every 5 s), got {raw!r}")
    return value


def _bool(name: str, raw: str) -> bool:
    raw = raw.strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be a boolean (1/0, true/false), got {raw!r}")


def _gib(name: str, raw: str) -> int:
    """A size given in GiB (fractions allowed), kept in bytes."""
    return int(_float(name, raw) * GiB)


def _mb(name: str, raw: str) -> int:
    """A size given in whole MiB, kept in bytes."""
    return _int(name, raw) * MiB


def _isolation(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if value not in ISOLATION_MODES:
        raise ValueError(f"{name} must be one of {', '.join(ISOLATION_MODES)}, got {value!r}")
    return value


def _float_dtype(name: str, raw: str) -> str:
    value = raw.strip()
    if value and value not in held_formats.FLOATS:
        raise ValueError(f"{name} must be empty (the checkpoint's) or one of {', '.join(held_formats.FLOATS)}, got "
                         f"{value!r}; a quantization is a deployment of its own (ndif-celery deploy --dtype nf4)")
    return value


WEB_WORKER_CLASSES = ("gevent", "gthread")


LAUNCHERS = ("slurm",)


def _launcher(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if value and value not in LAUNCHERS:
        raise ValueError(f"{name} names a cluster scheduler this farm launches workers on ({', '.join(LAUNCHERS)}), "
                         f"got {raw!r}")
    return value


def _web_worker_class(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if value not in WEB_WORKER_CLASSES:
        raise ValueError(f"{name} must be one of {', '.join(WEB_WORKER_CLASSES)}, got {value!r}")
    return value




def _runtime_ports(name: str, raw: str) -> dict:
    """``0.7.0=8007,0.6.3=8006``: a port of the web per runtime (docs/versions.md)."""
    ports: dict = {}
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            continue
        version, _, port = part.partition("=")
        version = version.strip()
        if not RELEASE.fullmatch(version) or not port.strip().isdigit():
            raise ValueError(f"{name} lists VERSION=PORT pairs such as 0.7.0=8007, got {part!r}")
        if not 0 < int(port) < 65536 or int(port) in ports.values():
            raise ValueError(f"{name}: port {port.strip()} is not a free TCP port number of its own")
        ports[version] = int(port)
    return ports


def _versions(name: str, raw: str) -> tuple:
    """``0.7.0,0.5.15+py3.12``: runtimes by name (an exact nnsight release), each once."""
    versions = tuple(dict.fromkeys(part.strip() for part in raw.split(",") if part.strip()))
    for version in versions:
        if not RUNTIME_NAME.fullmatch(version):
            raise ValueError(f"{name} lists runtimes by their exact nnsight release such as 0.7.0 "
                             f"(0.5.15+py3.12 on another Python), got {version!r}")
    return versions


def _jail_require(name: str, raw: str) -> tuple:
    # Jail layers: all required unless waived ("all,-seccomp"); see ndif_celery.policy.jail_layers.
    return parse_require(raw)


def _jail_disable(name: str, raw: str) -> tuple:
    return parse_disable(raw)


def check_alert_webhook_url(url: str) -> None:
    """Raise ValueError, naming ``NDIF_ALERT_WEBHOOK_URL`` and what is wrong, unless
    ``url`` is empty (no webhook) or an http(s) URL with a host.

    Not the variable's parser: a bad URL must stop ``ndif-celery up`` and fail
    ``doctor``, not every command (``down`` must still work). The beat checks it
    too before each delivery. The message never repeats the value: its path
    and query often hold a token, and even a mistyped scheme may be one.
    """
    if not url:
        return
    name = "NDIF_ALERT_WEBHOOK_URL"
    if re.search(r"[\s\x00-\x1f\x7f]", url):
        raise ValueError(f"{name} holds a space or a control character; a URL has none (percent-encode them)")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(f"{name} is not a URL (its host or port cannot be read)") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError(f"{name} must begin with http:// or https:// (the beat POSTs alerts over HTTP)")
    host = parts.hostname or ""
    if not host or not re.fullmatch(r"[\w.-]+|[0-9a-fA-F:.]+(%\w+)?", host):
        raise ValueError(f"{name} names no host: expected http(s)://host[:port]/path")
    if port == 0:
        raise ValueError(f"{name}'s port must be from 1 to 65535")


# --- defaults that depend on settings read before them ----------------------------


def _secret_key(read: dict) -> str:
    """The key that signs result URLs of the filesystem store, when
    ``NDIF_SECRET_KEY`` is unset (several web hosts must set and share it).

    Made once and kept in ``NDIF_HOME/secret_key`` so every process of a
    single-host stack agrees on it without anyone configuring one.
    """
    home = read["home"]
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


# --- the table --------------------------------------------------------------------


@dataclass(frozen=True)
class Var:
    """One ``NDIF_*`` variable.

    ``default`` is what an unset (or empty) variable means, written as one
    would set it (``8``, not ``8 * GiB``, for ``NDIF_JOB_MEMORY_GIB``), and
    goes through ``parse`` like a set value; a callable default is computed
    from the settings read before it (rows above it in the table), as a dict by
    attribute. ``auth_on``, for the limits, replaces ``default`` when
    ``NDIF_AUTH`` is on (:data:`AUTH_ON_DEFAULTS`). ``shown`` is how
    docs/configuration.md's default column begins when the default is not a
    plain value (derived, or what empty means); the docs test holds it to that.
    """

    name: str
    attr: str
    default: Any
    parse: Callable[[str, str], Any]
    doc: str
    auth_on: Optional[int] = None
    shown: Optional[str] = None
    # An empty value is a value, not "unset": an anonymous MinIO has empty keys.
    empty_is_value: bool = False


# Grouped as docs/configuration.md is. A callable default may use only rows above it.
VARIABLES: tuple = (
    # The stack on one host, and where its parts are.
    Var("NDIF_HOME", "home", "~/.ndif-celery", _home, "state, logs, the embedded Redis's data, the filesystem store, SQLite"),
    Var("NDIF_API_HOST", "api_host", "127.0.0.1", _text, "address the web binds"),
    Var("NDIF_API_PORT", "api_port", 8001, _int, "port the web binds"),
    Var("NDIF_RUNTIME_PORTS", "runtime_ports", "", _runtime_ports,
        "more ports the web binds, one per runtime: `VERSION=PORT,...`; there `/env` and `/status` are that "
        "runtime's", shown="none"),
    Var("NDIF_API_URL", "api_url", lambda read: f"http://{read['api_host']}:{read['api_port']}", _url,
        "the URL clients reach the web at (used in signed result URLs)", shown="`http://<host>:<port>`"),
    Var("NDIF_WEB_WORKERS", "web_workers", 2, _int, "gunicorn worker processes"),
    Var("NDIF_WEB_WORKER_CLASS", "web_worker_class", "gevent", _web_worker_class,
        "gunicorn worker class: `gevent` (a waiting websocket is a few KiB, no thread) or `gthread` (a thread each)"),
    Var("NDIF_WEB_CONNECTIONS", "web_connections", 20000, _int,
        "open connections (websockets included) per web process under `gevent`"),
    Var("NDIF_WEB_THREADS", "web_threads", 64, _int, "threads per web process under `gthread`; a blocking client holds one while its job runs"),
    Var("NDIF_WEB_REDIS_CONNECTIONS", "web_redis_connections", 32, _int,
        "Redis connections per web process for requests (plus one shared pub/sub for all its websockets)"),
    # Websockets (web/open_sockets.py, web/sio.py): bounded per address and, before a key claims them, per process.
    Var("NDIF_WEBSOCKETS_PER_ADDRESS", "websockets_per_address", 64, _int,
        "websockets (`/subscribe` and Socket.IO) one client address may hold open on one web process (0: none)"),
    Var("NDIF_UNCLAIMED_SOCKETS", "unclaimed_sockets", 512, _int,
        "Socket.IO sockets no request has claimed yet that one web process holds at once (0: none)"),
    Var("NDIF_SOCKETIO_CONNECT_S", "socketio_connect_s", 5.0, _positive_float,
        "seconds a Socket.IO connection has to send its namespace CONNECT before it is closed"),
    # Request bodies (web/uploads.py): each must begin at once and keep up with a minimum rate
    # after a grace; a web process reads a bounded number at once, a bounded share per address.
    Var("NDIF_WEB_UPLOADS", "web_uploads", 64, _positive, "request bodies one web process reads at once"),
    Var("NDIF_UPLOADS_PER_ADDRESS", "uploads_per_address", 8, _int,
        "request bodies one client address (an IPv6 /64) may be sending to one web process at once (0: none)"),
    Var("NDIF_UPLOAD_FIRST_BYTE_S", "upload_first_byte_s", 2.0, _positive_float,
        "seconds a request body may take to begin arriving before it is cut"),
    Var("NDIF_UPLOAD_GRACE_S", "upload_grace_s", 10.0, _positive_float,
        "seconds a request body may lag behind its minimum rate before it is cut"),
    Var("NDIF_UPLOAD_MIN_BYTES_PER_S", "upload_min_bytes_per_s", 64 * 1024, _positive,
        "the slowest a request body may arrive, after the grace (bytes per second)"),
    # Model metadata for clients without the hub (web/model_files.py): config and tokenizer files only.
    Var("NDIF_MODEL_FILES", "model_files", True, _bool,
        "serve cached models' config and tokenizer files under /hub (HF_ENDPOINT), never weights"),
    Var("NDIF_MODEL_FILE_MAX_MB", "model_file_max_bytes", 64, _mb, "the largest model file /hub serves (MiB)"),
    Var("NDIF_MODEL_FILES_PER_ADDRESS", "model_files_per_address", 8, _int,
        "model files one client address may be downloading from one web process at once (0: none)"),
    Var("NDIF_EMBEDDED_REDIS_PORT", "embedded_redis_port", 6380, _int, "port of the embedded Redis"),
    Var("NDIF_EMBEDDED_REDIS_MAX_MEMORY_MB", "embedded_redis_max_memory_mb", 4096, _positive,
        "the embedded Redis's memory bound (MiB); when full it refuses writes and evicts nothing"),
    Var("NDIF_REDIS_URL", "redis_url", lambda read: f"redis://127.0.0.1:{read['embedded_redis_port']}/0", _text,
        "the broker and job-state Redis; unset: `ndif-celery up` runs an embedded one", shown="unset: embedded"),
    Var("NDIF_OBJECT_STORE_URL", "object_store_url", "", _text, "MinIO/S3 endpoint; unset keeps results on disk, served by the web"),
    Var("NDIF_OBJECT_STORE_PUBLIC_URL", "object_store_public_url", lambda read: read["object_store_url"], _text,
        "the host clients download from; presigned URLs are signed for it", shown="the endpoint"),
    Var("NDIF_OBJECT_STORE_ACCESS_KEY", "object_store_access_key", "minioadmin", _text, "object store access key",
        empty_is_value=True),
    Var("NDIF_OBJECT_STORE_SECRET_KEY", "object_store_secret_key", "minioadmin", _text, "object store secret key",
        empty_is_value=True),
    Var("NDIF_OBJECT_STORE_BUCKET", "object_store_bucket", "ndif-results", _text, "bucket, created on first use",
        empty_is_value=True),
    Var("NDIF_OBJECT_STORE_REGION", "object_store_region", "us-east-1", _text, "region the URLs are signed for",
        empty_is_value=True),
    Var("NDIF_OBJECT_STORE_VERIFY", "object_store_verify", True, _bool, "verify the object store's TLS certificate"),
    Var("NDIF_RESULTS_DIR", "results_dir", lambda read: str(read["home"] / "results"), _path,
        "where the filesystem store keeps results", shown="`$NDIF_HOME/results`"),
    Var("NDIF_SECRET_KEY", "secret_key", _secret_key, _text,
        "signs filesystem-store URLs; the same on every web host", shown="generated in `$NDIF_HOME/secret_key`"),
    Var("NDIF_MAX_INLINE_BYTES", "max_inline_bytes", 4 * MiB, _int, "largest result sent inline on the websocket"),
    Var("NDIF_RESULT_URL_TTL_S", "result_url_ttl_s", 3600, _int, "lifetime of a result URL"),
    Var("NDIF_JOB_TTL_S", "job_ttl_s", 24 * 3600, _int, "how long payloads and statuses stay in Redis"),
    Var("NDIF_DISCONNECT_GRACE_S", "disconnect_grace_s", 10.0, _float,
        "how long a blocking job outlives its client's closed websocket before it is cancelled (0: never)"),
    Var("NDIF_VISIBILITY_TIMEOUT_S", "visibility_timeout_s", 6 * 3600, _int, "broker redelivery timeout; must exceed the longest job"),
    Var("NDIF_REDIS_OUTAGE_S", "redis_outage_s", 30.0, _float, "how long the web and workers wait for Redis to come back"),
    Var("NDIF_LEDGER_RETENTION_DAYS", "ledger_retention_days", 90.0, _float, "age at which the cleanup deletes ledger rows (0: never)"),
    Var("NDIF_CLEANUP_INTERVAL_S", "cleanup_interval_s", 300.0, _float, "how often `ndif-celery beat` runs the cleanup"),
    Var("NDIF_DATABASE_URL", "database_url", lambda read: f"sqlite:///{read['home'] / 'ndif.db'}", _text,
        "the database (keys and the job ledger)", shown="`sqlite:///$NDIF_HOME/ndif.db`"),
    Var("NDIF_FLOWER_PORT", "flower_port", 5555, _int, "Flower's port; 0: no Flower on this host"),
    # Loopback by default: Flower has no authentication of its own.
    Var("NDIF_FLOWER_HOST", "flower_host", "127.0.0.1", _text, "the address Flower listens on"),
    Var("NDIF_FLOWER_URL", "flower_url",
        lambda read: f"http://{_browsable(read['api_host'])}:{read['flower_port']}" if read["flower_port"] else "", _url,
        "where the dashboard links to Flower", shown="`http://<NDIF_API_HOST>:<NDIF_FLOWER_PORT>`"),
    # 0 = no metrics endpoint on the worker; a taken port moves to the next few.
    Var("NDIF_WORKER_METRICS_PORT", "worker_metrics_port", 9108, _int, "each worker's Prometheus `/metrics` port (0: off)"),
    Var("NDIF_WORKER_METRICS_HOST", "worker_metrics_host", "127.0.0.1", _text, "address the workers' metrics endpoints bind"),
    Var("NDIF_LOG_LEVEL", "log_level", "INFO", _upper, "log level of every process"),
    # Bounds on what the farm writes to disk (ndif_celery.log_limits, ndif_celery.host.log_rotation).
    Var("NDIF_LOG_REPEATS", "log_repeats", 5, _non_negative,
        "records of one source (logger, message, exception type) logged per window; the rest are counted (0: all)"),
    Var("NDIF_LOG_REPEAT_WINDOW_S", "log_repeat_window_s", 60.0, _positive_float, "the window of NDIF_LOG_REPEATS"),
    Var("NDIF_LOG_MAX_BYTES", "log_max_bytes", 50 * MiB, _non_negative,
        "size at which a log under `$NDIF_HOME/logs` is rotated (0: never)"),
    Var("NDIF_LOG_BACKUPS", "log_backups", 3, _non_negative, "rotated copies kept of each log"),
    # Synthetic health probes and usage (ndif_celery.monitoring.probes, ndif_celery.accounts.usage; docs/monitoring.md).
    Var("NDIF_PROBE_INTERVAL_S", "probe_interval_s", 0.0, _float, "how often the beat probes each HOT model with a real trace (0: off)"),
    Var("NDIF_PROBE_TIMEOUT_S", "probe_timeout_s", 60.0, _float, "a probe that has no answer this long fails"),
    Var("NDIF_PROBE_API_KEY", "probe_api_key", "", _stripped, "the API key the probes send (an admin key, with auth on)"),
    Var("NDIF_METRICS_TOKEN", "metrics_token", "", _stripped,
        "a bearer token that shows a scraper /metrics' per-key series (with auth on; an admin key does too)"),
    Var("NDIF_ALERT_WEBHOOK_URL", "alert_webhook_url", "", _stripped, "where the beat POSTs a probe's alert and its resolution"),
    Var("NDIF_USAGE_TOP_KEYS", "usage_top_keys", 10, _int, "keys with their own `ndif_usage_*` series; the rest are `other`"),
    # The farm: workers, placement, replicas.
    Var("NDIF_UP_WORKER", "up_worker", True, _bool,
        "`ndif-celery up` starts a worker of the farm's own nnsight (false: the workers come from elsewhere, "
        "e.g. NDIF_LAUNCHER)"),
    Var("NDIF_WORKER_GPUS", "worker_gpus", "", _text, "GPUs of the worker `ndif-celery up` starts (unset: all visible)"),
    Var("NDIF_WORKER_NAME", "worker_name", "", _text, "name of the worker `ndif-celery up` starts; unique per farm",
        shown="`gpu<ids>@<host>`, or `cpu@<host>`"),
    Var("NDIF_RUNTIMES", "runtimes", "", _versions,
        "runtimes whose workers `ndif-celery up` starts too, one each (`ndif-celery runtime add` each first)",
        shown="none"),
    Var("NDIF_WORKER_MEMORY_SHARE", "worker_memory_share", 1.0, _positive_float,
        "the part of the measured memory budget a worker takes (`up` splits it between its workers)"),
    Var("NDIF_WORKER_NNSIGHT", "worker_nnsight", "", _stripped,
        "the nnsight runtime a worker runs (`ndif-celery runtime add`; docs/versions.md)", shown="the farm's own"),
    Var("NDIF_WORKER_IDLE_EXIT_S", "worker_idle_exit_s", 0.0, _float,
        "a worker leaves the farm after this long with nothing to run (0: never; a launched worker gets "
        "NDIF_LAUNCH_IDLE_S)"),
    # Elastic workers: a cluster's scheduler starts them while jobs wait (ndif_celery.farm.elastic; docs/deploy.md).
    Var("NDIF_LAUNCHER", "launcher", "", _launcher,
        "the cluster scheduler the beat asks for a worker when jobs wait: `slurm` (unset: none)", shown="none"),
    Var("NDIF_LAUNCH_AFTER_S", "launch_after_s", 30.0, _positive_float,
        "a model's oldest job waits this long, with no launched worker on its way, before one is launched"),
    Var("NDIF_LAUNCH_MAX_WORKERS", "launch_max_workers", 2, _non_negative,
        "most launched workers at once, pending ones included (0: launch none)"),
    Var("NDIF_LAUNCH_IDLE_S", "launch_idle_s", 300.0, _positive_float,
        "a launched worker leaves after this long with nothing to run, and its allocation ends"),
    Var("NDIF_LAUNCH_GPUS", "launch_gpus", 1, _non_negative, "GPUs a launched worker asks for (0: a CPU worker)"),
    Var("NDIF_SLURM_PARTITION", "slurm_partition", "", _stripped,
        "the SLURM partition launched workers run in", shown="the cluster's default"),
    Var("NDIF_SLURM_ACCOUNT", "slurm_account", "", _stripped, "the SLURM account launched workers are charged to",
        shown="the submitting user's default"),
    Var("NDIF_SLURM_TIME_LIMIT", "slurm_time_limit", "04:00:00", _stripped,
        "a launched worker's time limit (`sbatch --time`); it leaves warm 2 minutes before"),
    Var("NDIF_SLURM_SCRIPT", "slurm_script", str(Path(__file__).resolve().parents[1] / "deploy/slurm/ndif-worker.sbatch"),
        _path, "the batch script a launch submits", shown="`deploy/slurm/ndif-worker.sbatch` of this checkout"),
    # 0 = torch's default (every core); see docs/performance.md.
    Var("NDIF_TORCH_THREADS", "torch_threads", 0, _int, "intra-op threads of a worker's torch (0: measured per model at load)"),
    # Co-batching trusted requests of one model into one forward (workers.cobatch; docs/cobatching.md).
    Var("NDIF_FAIR_TURNS", "fair_turns", True, _bool,
        "keys with waiting jobs take turns on a model's queue (false: first in, first out)"),
    Var("NDIF_COBATCH_MAX", "cobatch_max", 16, _int, "most rows (prompts) one co-batched forward holds (1: off)"),
    Var("NDIF_COBATCH_PAD", "cobatch_pad", True, _bool, "co-batch requests of different token lengths (left-padded)"),
    # 0 = measure: the GPUs' memory, or half the host's RAM on a CPU worker.
    Var("NDIF_WORKER_MEMORY_GIB", "worker_memory_bytes", 0, _gib, "the worker's memory budget for models",
        shown="unset: measured"),
    Var("NDIF_DEFAULT_DTYPE", "default_dtype", "", _float_dtype,
        "the float type a model deployed by its first request is loaded as", shown="unset: the checkpoint's"),
    Var("NDIF_PADDING_FACTOR", "padding_factor", 0.15, _float, "a model is placed as its weights' size times (1 + this) ..."),
    Var("NDIF_PADDING_BYTES", "padding_bytes", 256 * MiB, _int, "... plus this (activations, CUDA context)"),
    Var("NDIF_MAX_REPLICAS", "max_replicas", 3, _int, "most workers that hold one model at once under queue pressure"),
    Var("NDIF_REPLICA_WAIT_S", "replica_wait_s", 30.0, _float, "add a replica when a model's oldest waiting job waited this long"),
    Var("NDIF_REPLICA_IDLE_S", "replica_idle_s", 600.0, _float, "remove an extra replica unused for this long"),
    Var("NDIF_AUTOSCALE_BACKOFF_S", "autoscale_backoff_s", 30.0, _float, "wait after adding a replica before adding another"),
    Var("NDIF_CONTROLLER_INTERVAL_S", "controller_interval_s", 0.5, _float, "how often the farm controller looks"),
    # Declarative deployments (ndif_celery.farm.deployments): applied at start and when a worker joins.
    Var("NDIF_DEPLOYMENTS", "deployments", "", _stripped, "a deployments file (YAML/JSON) or an inline list the controller keeps deployed"),
    # Users, isolation and limits.
    Var("NDIF_AUTH", "auth", False, _bool, "require an API key on every request"),
    # Which repos may be loaded, and which may run their own code: ndif_celery.policy.model_policy.
    Var("NDIF_MODELS", "models", "", _stripped, "the repos this farm serves (fnmatch patterns; empty: see the docs)"),
    Var("NDIF_TRUST_REMOTE_CODE", "trust_remote_code", "", _stripped, "repos whose own code may run (fnmatch patterns)"),
    Var("NDIF_DEFAULT_TRUSTED", "default_trusted", True, _bool, "with auth off, run requests in the worker's process"),
    # How untrusted jobs are isolated: see docs/security.md.
    Var("NDIF_ISOLATION", "isolation", ISOLATION_MODES[0], _isolation, "how an untrusted job's jailed child comes to be"),
    Var("NDIF_JAIL_REQUIRE", "jail_waived", "all", _jail_require, "the jail layers an untrusted job needs (`all,-layer` waives)"),
    Var("NDIF_JAIL_DISABLE", "jail_disabled", "", _jail_disable, "waivable jail layers a child must not even try"),
    Var("NDIF_JAIL_CGROUP_ROOT", "jail_cgroup_root", "", _text, "the pids cgroup under which each untrusted job gets its own"),
    # The keyed weight check after every untrusted job on every model (always on GPU models).
    Var("NDIF_VERIFY_UNTRUSTED", "verify_untrusted", False, _bool, "keyed weight check after every untrusted job"),
    Var("NDIF_TRUSTED_CHECK_EVERY", "trusted_check_every", 32, _positive,
        "whole weight check after every Nth trusted job at least (cheap stamps after each; 1: every job)"),
    Var("NDIF_AUTH_CACHE_S", "auth_cache_s", 5.0, _float, "how long the web remembers a key lookup"),
    # Entries in each of the web's auth tables (known keys, unknown keys,
    # addresses that failed): made-up keys cannot grow a web process.
    Var("NDIF_AUTH_CACHE_MAX", "auth_cache_max", 10000, _int, "entries in each of a web process's auth tables"),
    # Database lookups of never-seen keys that fail, per client address per
    # minute per web process, before that address's new keys are refused (0 = off).
    Var("NDIF_AUTH_FAILURES_PER_MIN", "auth_failures_per_min", 60, _int, "failed lookups of never-seen keys per address per minute"),
    Var("NDIF_EXECUTION_TIMEOUT_S", "execution_timeout_s", 3600.0, _float, "a job's deadline for deserialize + run"),
    # After a deadline or a kill has answered the job, how long its thread may take to
    # unwind before the worker replaces itself (workers.job.deadline).
    Var("NDIF_DEADLINE_GRACE_S", "deadline_grace_s", 5.0, _float, "how long a timed-out or killed job may take to unwind before its worker replaces itself"),
    Var("NDIF_JOB_MEMORY_GIB", "job_memory_bytes", 8, _gib, "address space an isolated job may add"),
    Var("NDIF_JOB_DISK_MB", "job_disk_bytes", 256, _mb, "size of an isolated job's private tmpfs"),
    Var("NDIF_LOG_LINES_PER_S", "log_lines_per_s", 100.0, _float, "LOG lines one job may publish per second (0: no limit)"),
    Var("NDIF_LOG_BYTES_PER_JOB", "log_bytes_per_job", 4 * MiB, _int, "LOG output one job may publish in all (0: no limit)"),
    # Limits: single-host defaults, and with auth on the AUTH_ON_DEFAULTS (why: there).
    Var("NDIF_MAX_RESULT_BYTES", "max_result_bytes", 4 * GiB, _int, "largest result a job may return", auth_on=1 * GiB),
    Var("NDIF_RESULT_QUOTA_BYTES", "result_quota_bytes", 0, _int,
        "bytes of stored results one key may keep until they expire (0: none)", auth_on=8 * GiB),
    Var("NDIF_MAX_PAYLOAD_BYTES", "max_payload_bytes", 256 * MiB, _int, "largest request payload", auth_on=64 * MiB),
    Var("NDIF_RATE_LIMIT_PER_MIN", "rate_limit_per_min", 0, _int, "requests per minute per key (0: none)", auth_on=120),
    Var("NDIF_MAX_CONCURRENT_JOBS", "max_concurrent_jobs", 0, _int, "jobs queued or running at once per key (0: none)", auth_on=4),
    Var("NDIF_MAX_QUEUE_DEPTH", "max_queue_depth", 0, _int, "jobs waiting per model (0: none)", auth_on=32),
    Var("NDIF_MAX_PARKED_BYTES_PER_KEY", "max_parked_bytes_per_key", 1 * GiB, _int,
        "bytes one key's jobs may hold in Redis: payloads until they run, statuses until they expire (0: none)",
        auth_on=256 * MiB),
    Var("NDIF_MAX_WEBSOCKETS_PER_KEY", "max_websockets_per_key", 0, _int, "`/subscribe` websockets per key (0: none)", auth_on=16),
    Var("NDIF_UPLOADS_PER_KEY", "uploads_per_key", 0, _int, "request bodies one key may be sending at once (0: none)", auth_on=16),
    Var("NDIF_WEB_UPLOADS_PER_KEY", "web_uploads_per_key", 0, _int,
        "request bodies one key may be sending to one web process at once (0: none)", auth_on=8),
    Var("NDIF_MAX_RUNNING_PER_KEY", "max_running_per_key", 0, _int,
        "jobs of one key running at once on one model, across its replicas (0: none)", auth_on=2),
    Var("NDIF_SOCKET_LEASE_S", "socket_lease_s", 30.0, _socket_lease,
        "how long a counted socket of a web process that stopped renewing stays counted"),
    # The client version gate: "" = no gate; see ndif_celery.policy.client_versions.
    Var("NDIF_MIN_NNSIGHT_VERSION", "min_nnsight_version", "", parse_minimum, "oldest nnsight client served"),
    Var("NDIF_MIN_PYTHON_VERSION", "min_python_version", "", parse_minimum, "oldest client Python served (major.minor)"),
)

# With NDIF_AUTH=1 the farm is shared by people who need not trust each other,
# so these limits (the rows above with ``auth_on``) replace the single-host
# defaults (no limit, 4 GiB results, 256 MiB payloads) that suit one researcher
# on their own machine. Why each number: docs/configuration.md and
# docs/security.md "Defaults with auth on". A variable that is set, 0 (no
# limit) included, always wins over these; a key's own limits in the database
# (keys create --rate-limit/--max-concurrent) win over both.
AUTH_ON_DEFAULTS = {var.name: var.auth_on for var in VARIABLES if var.auth_on is not None}


@dataclass(frozen=True)
class Settings:
    """The settings of one process: an attribute per :data:`VARIABLES` row
    (its ``attr``), plus ``embedded_redis`` (no ``NDIF_REDIS_URL`` given).

    The fields come from the table, so a setting is declared in one place;
    each field's type is its parser's return type. Editors read them from
    ``config.pyi``, which ``tools/config_stub.py`` writes from the table."""

    __annotations__ = {**{var.attr: var.parse.__annotations__.get("return", "Any") for var in VARIABLES},
                       "embedded_redis": "bool"}

    def secrets(self) -> tuple:
        """Values an untrusted child must not be able to read."""
        return tuple(
            value
            for value in (
                self.secret_key, self.object_store_access_key, self.object_store_secret_key,
                self.redis_url, self.database_url, self.probe_api_key, self.alert_webhook_url, self.metrics_token,
            )
            if value
        )

    @property
    def uses_s3(self) -> bool:
        return bool(self.object_store_url)


def _unset(var: Var, raw: Optional[str]) -> bool:
    """Missing, or empty (blank for a boolean, which ignores spaces); an empty
    value is kept as given where it means something (``empty_is_value``)."""
    if raw is None:
        return True
    if var.empty_is_value:
        return False
    return (raw.strip() if var.parse is _bool else raw) == ""


def load(env: Optional[Mapping[str, str]] = None) -> Settings:
    """Read the settings from ``env`` (default: the process environment):
    each variable in table order, its default when unset (parsed like a set
    value), then the values derived from several."""
    env = os.environ if env is None else env
    read: dict = {}
    for var in VARIABLES:
        raw = env.get(var.name)
        if _unset(var, raw):
            if var.auth_on is not None and read["auth"]:
                default = var.auth_on
            elif callable(var.default):
                default = var.default(read)
            else:
                default = var.default
            raw = str(default)
        read[var.attr] = var.parse(var.name, raw)
    read["embedded_redis"] = not env.get("NDIF_REDIS_URL")
    settings = Settings(**read)
    for field in fields(Settings):
        value = getattr(settings, field.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"{field.name} must not be negative, got {value}")
    return settings
