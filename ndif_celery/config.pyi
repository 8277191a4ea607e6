# The stub of config.py, written by tools/config_stub.py: edit config.py and run it, never this file.
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

MiB: int

GiB: int

ISOLATION_MODES: tuple[str, ...]

def _text(name: str, raw: str) -> str: ...

def _stripped(name: str, raw: str) -> str: ...

def _upper(name: str, raw: str) -> str: ...

def _url(name: str, raw: str) -> str: ...

def _path(name: str, raw: str) -> Path: ...

def _home(name: str, raw: str) -> Path: ...

def _int(name: str, raw: str) -> int: ...

def _positive(name: str, raw: str) -> int: ...

def _non_negative(name: str, raw: str) -> int: ...

def _float(name: str, raw: str) -> float: ...

def _positive_float(name: str, raw: str) -> float: ...

def _socket_lease(name: str, raw: str) -> float: ...

def _bool(name: str, raw: str) -> bool: ...

def _gib(name: str, raw: str) -> int: ...

def _mb(name: str, raw: str) -> int: ...

def _isolation(name: str, raw: str) -> str: ...

def _float_dtype(name: str, raw: str) -> str: ...

WEB_WORKER_CLASSES: tuple[str, ...]

LAUNCHERS: tuple[str, ...]

def _launcher(name: str, raw: str) -> str: ...

def _web_worker_class(name: str, raw: str) -> str: ...

def _runtime_ports(name: str, raw: str) -> dict: ...

def _versions(name: str, raw: str) -> tuple: ...

def _jail_require(name: str, raw: str) -> tuple: ...

def _jail_disable(name: str, raw: str) -> tuple: ...

def check_alert_webhook_url(url: str) -> None: ...

def _secret_key(read: dict) -> str: ...

def _browsable(host: str) -> str: ...

@dataclass(frozen=True)
class Var:
    name: str
    attr: str
    default: Any
    parse: Callable[[str, str], Any]
    doc: str
    auth_on: Optional[int] = ...
    shown: Optional[str] = ...
    empty_is_value: bool = ...

VARIABLES: tuple[Var, ...]

AUTH_ON_DEFAULTS: dict[str, int]

@dataclass(frozen=True)
class Settings:
    home: Path
    """NDIF_HOME: state, logs, the embedded Redis's data, the filesystem store, SQLite"""
    api_host: str
    """NDIF_API_HOST: address the web binds"""
    api_port: int
    """NDIF_API_PORT: port the web binds"""
    runtime_ports: dict
    """NDIF_RUNTIME_PORTS: more ports the web binds, one per runtime: `VERSION=PORT,...`; there `/env` and `/status` are that runtime's"""
    api_url: str
    """NDIF_API_URL: the URL clients reach the web at (used in signed result URLs)"""
    web_workers: int
    """NDIF_WEB_WORKERS: gunicorn worker processes"""
    web_worker_class: str
    """NDIF_WEB_WORKER_CLASS: gunicorn worker class: `gevent` (a waiting websocket is a few KiB, no thread) or `gthread` (a thread each)"""
    web_connections: int
    """NDIF_WEB_CONNECTIONS: open connections (websockets included) per web process under `gevent`"""
    web_threads: int
    """NDIF_WEB_THREADS: threads per web process under `gthread`; a blocking client holds one while its job runs"""
    web_redis_connections: int
    """NDIF_WEB_REDIS_CONNECTIONS: Redis connections per web process for requests (plus one shared pub/sub for all its websockets)"""
    websockets_per_address: int
    """NDIF_WEBSOCKETS_PER_ADDRESS: websockets (`/subscribe` and Socket.IO) one client address may hold open on one web process (0: none)"""
    unclaimed_sockets: int
    """NDIF_UNCLAIMED_SOCKETS: Socket.IO sockets no request has claimed yet that one web process holds at once (0: none)"""
    socketio_connect_s: float
    """NDIF_SOCKETIO_CONNECT_S: seconds a Socket.IO connection has to send its namespace CONNECT before it is closed"""
    web_uploads: int
    """NDIF_WEB_UPLOADS: request bodies one web process reads at once"""
    uploads_per_address: int
    """NDIF_UPLOADS_PER_ADDRESS: request bodies one client address (an IPv6 /64) may be sending to one web process at once (0: none)"""
    upload_first_byte_s: float
    """NDIF_UPLOAD_FIRST_BYTE_S: seconds a request body may take to begin arriving before it is cut"""
    upload_grace_s: float
    """NDIF_UPLOAD_GRACE_S: seconds a request body may lag behind its minimum rate before it is cut"""
    upload_min_bytes_per_s: int
    """NDIF_UPLOAD_MIN_BYTES_PER_S: the slowest a request body may arrive, after the grace (bytes per second)"""
    model_files: bool
    """NDIF_MODEL_FILES: serve cached models' config and tokenizer files under /hub (HF_ENDPOINT), never weights"""
    model_file_max_bytes: int
    """NDIF_MODEL_FILE_MAX_MB: the largest model file /hub serves (MiB)"""
    model_files_per_address: int
    """NDIF_MODEL_FILES_PER_ADDRESS: model files one client address may be downloading from one web process at once (0: none)"""
    embedded_redis_port: int
    """NDIF_EMBEDDED_REDIS_PORT: port of the embedded Redis"""
    embedded_redis_max_memory_mb: int
    """NDIF_EMBEDDED_REDIS_MAX_MEMORY_MB: the embedded Redis's memory bound (MiB); when full it refuses writes and evicts nothing"""
    redis_url: str
    """NDIF_REDIS_URL: the broker and job-state Redis; unset: `ndif-celery up` runs an embedded one"""
    object_store_url: str
    """NDIF_OBJECT_STORE_URL: MinIO/S3 endpoint; unset keeps results on disk, served by the web"""
    object_store_public_url: str
    """NDIF_OBJECT_STORE_PUBLIC_URL: the host clients download from; presigned URLs are signed for it"""
    object_store_access_key: str
    """NDIF_OBJECT_STORE_ACCESS_KEY: object store access key"""
    object_store_secret_key: str
    """NDIF_OBJECT_STORE_SECRET_KEY: object store secret key"""
    object_store_bucket: str
    """NDIF_OBJECT_STORE_BUCKET: bucket, created on first use"""
    object_store_region: str
    """NDIF_OBJECT_STORE_REGION: region the URLs are signed for"""
    object_store_verify: bool
    """NDIF_OBJECT_STORE_VERIFY: verify the object store's TLS certificate"""
    results_dir: Path
    """NDIF_RESULTS_DIR: where the filesystem store keeps results"""
    secret_key: str
    """NDIF_SECRET_KEY: signs filesystem-store URLs; the same on every web host"""
    max_inline_bytes: int
    """NDIF_MAX_INLINE_BYTES: largest result sent inline on the websocket"""
    result_url_ttl_s: int
    """NDIF_RESULT_URL_TTL_S: lifetime of a result URL"""
    job_ttl_s: int
    """NDIF_JOB_TTL_S: how long payloads and statuses stay in Redis"""
    disconnect_grace_s: float
    """NDIF_DISCONNECT_GRACE_S: how long a blocking job outlives its client's closed websocket before it is cancelled (0: never)"""
    visibility_timeout_s: int
    """NDIF_VISIBILITY_TIMEOUT_S: broker redelivery timeout; must exceed the longest job"""
    redis_outage_s: float
    """NDIF_REDIS_OUTAGE_S: how long the web and workers wait for Redis to come back"""
    ledger_retention_days: float
    """NDIF_LEDGER_RETENTION_DAYS: age at which the cleanup deletes ledger rows (0: never)"""
    cleanup_interval_s: float
    """NDIF_CLEANUP_INTERVAL_S: how often `ndif-celery beat` runs the cleanup"""
    database_url: str
    """NDIF_DATABASE_URL: the database (keys and the job ledger)"""
    flower_port: int
    """NDIF_FLOWER_PORT: Flower's port; 0: no Flower on this host"""
    flower_host: str
    """NDIF_FLOWER_HOST: the address Flower listens on"""
    flower_url: str
    """NDIF_FLOWER_URL: where the dashboard links to Flower"""
    worker_metrics_port: int
    """NDIF_WORKER_METRICS_PORT: each worker's Prometheus `/metrics` port (0: off)"""
    worker_metrics_host: str
    """NDIF_WORKER_METRICS_HOST: address the workers' metrics endpoints bind"""
    log_level: str
    """NDIF_LOG_LEVEL: log level of every process"""
    log_repeats: int
    """NDIF_LOG_REPEATS: records of one source (logger, message, exception type) logged per window; the rest are counted (0: all)"""
    log_repeat_window_s: float
    """NDIF_LOG_REPEAT_WINDOW_S: the window of NDIF_LOG_REPEATS"""
    log_max_bytes: int
    """NDIF_LOG_MAX_BYTES: size at which a log under `$NDIF_HOME/logs` is rotated (0: never)"""
    log_backups: int
    """NDIF_LOG_BACKUPS: rotated copies kept of each log"""
    probe_interval_s: float
    """NDIF_PROBE_INTERVAL_S: how often the beat probes each HOT model with a real trace (0: off)"""
    probe_timeout_s: float
    """NDIF_PROBE_TIMEOUT_S: a probe that has no answer this long fails"""
    probe_api_key: str
    """NDIF_PROBE_API_KEY: the API key the probes send (an admin key, with auth on)"""
    metrics_token: str
    """NDIF_METRICS_TOKEN: a bearer token that shows a scraper /metrics' per-key series (with auth on; an admin key does too)"""
    alert_webhook_url: str
    """NDIF_ALERT_WEBHOOK_URL: where the beat POSTs a probe's alert and its resolution"""
    usage_top_keys: int
    """NDIF_USAGE_TOP_KEYS: keys with their own `ndif_usage_*` series; the rest are `other`"""
    up_worker: bool
    """NDIF_UP_WORKER: `ndif-celery up` starts a worker of the farm's own nnsight (false: the workers come from elsewhere, e.g. NDIF_LAUNCHER)"""
    worker_gpus: str
    """NDIF_WORKER_GPUS: GPUs of the worker `ndif-celery up` starts (unset: all visible)"""
    worker_name: str
    """NDIF_WORKER_NAME: name of the worker `ndif-celery up` starts; unique per farm"""
    runtimes: tuple
    """NDIF_RUNTIMES: runtimes whose workers `ndif-celery up` starts too, one each (`ndif-celery runtime add` each first)"""
    worker_memory_share: float
    """NDIF_WORKER_MEMORY_SHARE: the part of the measured memory budget a worker takes (`up` splits it between its workers)"""
    worker_nnsight: str
    """NDIF_WORKER_NNSIGHT: the nnsight runtime a worker runs (`ndif-celery runtime add`; docs/versions.md)"""
    worker_idle_exit_s: float
    """NDIF_WORKER_IDLE_EXIT_S: a worker leaves the farm after this long with nothing to run (0: never; a launched worker gets NDIF_LAUNCH_IDLE_S)"""
    launcher: str
    """NDIF_LAUNCHER: the cluster scheduler the beat asks for a worker when jobs wait: `slurm` (unset: none)"""
    launch_after_s: float
    """NDIF_LAUNCH_AFTER_S: a model's oldest job waits this long, with no launched worker on its way, before one is launched"""
    launch_max_workers: int
    """NDIF_LAUNCH_MAX_WORKERS: most launched workers at once, pending ones included (0: launch none)"""
    launch_idle_s: float
    """NDIF_LAUNCH_IDLE_S: a launched worker leaves after this long with nothing to run, and its allocation ends"""
    launch_gpus: int
    """NDIF_LAUNCH_GPUS: GPUs a launched worker asks for (0: a CPU worker)"""
    slurm_partition: str
    """NDIF_SLURM_PARTITION: the SLURM partition launched workers run in"""
    slurm_account: str
    """NDIF_SLURM_ACCOUNT: the SLURM account launched workers are charged to"""
    slurm_time_limit: str
    """NDIF_SLURM_TIME_LIMIT: a launched worker's time limit (`sbatch --time`); it leaves warm 2 minutes before"""
    slurm_script: Path
    """NDIF_SLURM_SCRIPT: the batch script a launch submits"""
    torch_threads: int
    """NDIF_TORCH_THREADS: intra-op threads of a worker's torch (0: measured per model at load)"""
    fair_turns: bool
    """NDIF_FAIR_TURNS: keys with waiting jobs take turns on a model's queue (false: first in, first out)"""
    cobatch_max: int
    """NDIF_COBATCH_MAX: most rows (prompts) one co-batched forward holds (1: off)"""
    cobatch_pad: bool
    """NDIF_COBATCH_PAD: co-batch requests of different token lengths (left-padded)"""
    worker_memory_bytes: int
    """NDIF_WORKER_MEMORY_GIB: the worker's memory budget for models"""
    default_dtype: str
    """NDIF_DEFAULT_DTYPE: the float type a model deployed by its first request is loaded as"""
    padding_factor: float
    """NDIF_PADDING_FACTOR: a model is placed as its weights' size times (1 + this) ..."""
    padding_bytes: int
    """NDIF_PADDING_BYTES: ... plus this (activations, CUDA context)"""
    max_replicas: int
    """NDIF_MAX_REPLICAS: most workers that hold one model at once under queue pressure"""
    replica_wait_s: float
    """NDIF_REPLICA_WAIT_S: add a replica when a model's oldest waiting job waited this long"""
    replica_idle_s: float
    """NDIF_REPLICA_IDLE_S: remove an extra replica unused for this long"""
    autoscale_backoff_s: float
    """NDIF_AUTOSCALE_BACKOFF_S: wait after adding a replica before adding another"""
    controller_interval_s: float
    """NDIF_CONTROLLER_INTERVAL_S: how often the farm controller looks"""
    deployments: str
    """NDIF_DEPLOYMENTS: a deployments file (YAML/JSON) or an inline list the controller keeps deployed"""
    auth: bool
    """NDIF_AUTH: require an API key on every request"""
    models: str
    """NDIF_MODELS: the repos this farm serves (fnmatch patterns; empty: see the docs)"""
    trust_remote_code: str
    """NDIF_TRUST_REMOTE_CODE: repos whose own code may run (fnmatch patterns)"""
    default_trusted: bool
    """NDIF_DEFAULT_TRUSTED: with auth off, run requests in the worker's process"""
    isolation: str
    """NDIF_ISOLATION: how an untrusted job's jailed child comes to be"""
    jail_waived: tuple
    """NDIF_JAIL_REQUIRE: the jail layers an untrusted job needs (`all,-layer` waives)"""
    jail_disabled: tuple
    """NDIF_JAIL_DISABLE: waivable jail layers a child must not even try"""
    jail_cgroup_root: str
    """NDIF_JAIL_CGROUP_ROOT: the pids cgroup under which each untrusted job gets its own"""
    verify_untrusted: bool
    """NDIF_VERIFY_UNTRUSTED: keyed weight check after every untrusted job"""
    trusted_check_every: int
    """NDIF_TRUSTED_CHECK_EVERY: whole weight check after every Nth trusted job at least (cheap stamps after each; 1: every job)"""
    auth_cache_s: float
    """NDIF_AUTH_CACHE_S: how long the web remembers a key lookup"""
    auth_cache_max: int
    """NDIF_AUTH_CACHE_MAX: entries in each of a web process's auth tables"""
    auth_failures_per_min: int
    """NDIF_AUTH_FAILURES_PER_MIN: failed lookups of never-seen keys per address per minute"""
    execution_timeout_s: float
    """NDIF_EXECUTION_TIMEOUT_S: a job's deadline for deserialize + run"""
    deadline_grace_s: float
    """NDIF_DEADLINE_GRACE_S: how long a timed-out or killed job may take to unwind before its worker replaces itself"""
    job_memory_bytes: int
    """NDIF_JOB_MEMORY_GIB: address space an isolated job may add"""
    job_disk_bytes: int
    """NDIF_JOB_DISK_MB: size of an isolated job's private tmpfs"""
    log_lines_per_s: float
    """NDIF_LOG_LINES_PER_S: LOG lines one job may publish per second (0: no limit)"""
    log_bytes_per_job: int
    """NDIF_LOG_BYTES_PER_JOB: LOG output one job may publish in all (0: no limit)"""
    max_result_bytes: int
    """NDIF_MAX_RESULT_BYTES: largest result a job may return"""
    result_quota_bytes: int
    """NDIF_RESULT_QUOTA_BYTES: bytes of stored results one key may keep until they expire (0: none)"""
    max_payload_bytes: int
    """NDIF_MAX_PAYLOAD_BYTES: largest request payload"""
    rate_limit_per_min: int
    """NDIF_RATE_LIMIT_PER_MIN: requests per minute per key (0: none)"""
    max_concurrent_jobs: int
    """NDIF_MAX_CONCURRENT_JOBS: jobs queued or running at once per key (0: none)"""
    max_queue_depth: int
    """NDIF_MAX_QUEUE_DEPTH: jobs waiting per model (0: none)"""
    max_parked_bytes_per_key: int
    """NDIF_MAX_PARKED_BYTES_PER_KEY: bytes one key's jobs may hold in Redis: payloads until they run, statuses until they expire (0: none)"""
    max_websockets_per_key: int
    """NDIF_MAX_WEBSOCKETS_PER_KEY: `/subscribe` websockets per key (0: none)"""
    uploads_per_key: int
    """NDIF_UPLOADS_PER_KEY: request bodies one key may be sending at once (0: none)"""
    web_uploads_per_key: int
    """NDIF_WEB_UPLOADS_PER_KEY: request bodies one key may be sending to one web process at once (0: none)"""
    max_running_per_key: int
    """NDIF_MAX_RUNNING_PER_KEY: jobs of one key running at once on one model, across its replicas (0: none)"""
    socket_lease_s: float
    """NDIF_SOCKET_LEASE_S: how long a counted socket of a web process that stopped renewing stays counted"""
    min_nnsight_version: str
    """NDIF_MIN_NNSIGHT_VERSION: oldest nnsight client served"""
    min_python_version: str
    """NDIF_MIN_PYTHON_VERSION: oldest client Python served (major.minor)"""
    embedded_redis: bool
    def secrets(self) -> tuple: ...
    @property
    def uses_s3(self) -> bool: ...

def _unset(var: Var, raw: Optional[str]) -> bool: ...

def load(env: Optional[Mapping[str, str]] = ...) -> Settings: ...
