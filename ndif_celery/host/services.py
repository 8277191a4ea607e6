"""The services of a farm: what each one runs, in what environment.

One table for every way a service is started: ``ndif-celery up`` (through
:mod:`ndif_celery.host.stack`, which owns their processes), and ``ndif-celery
web|worker|beat|flower|redis`` in the foreground for a Procfile, systemd or a
container (:func:`exec_service`), so a service runs the same command with the
same environment however it is supervised. Apart from the stack because a
multi-host farm uses this and none of the stack's process handling.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Optional

from ndif_celery import config
from ndif_celery.celery_app import worker_argv

from . import runtimes
from .embedded_redis import RedisServerNotFound, redis_argv, redis_dir

# The directory that holds the ndif_celery, web and workers packages. Children
# run from here so ``web.app`` and ``workers.tasks`` import even when the
# project is used from a checkout without being installed.
ROOT = Path(__file__).resolve().parents[2]

SERVICES = ("redis", "web", "worker", "beat", "flower")
CELERY_APP = "workers.tasks:app"
BEAT_APP = "ndif_celery.beat:app"


class StackError(RuntimeError):
    """A stack operation failed; the message is meant for the user as is."""


#: A worker of a runtime (``NDIF_RUNTIMES``) is the service ``worker-nnsight<version>``.
RUNTIME_WORKER = "worker-nnsight"


def default_services(settings: config.Settings) -> list[str]:
    """The services of a single-host stack, in start order.

    Redis only when no ``NDIF_REDIS_URL`` names one; it starts first because
    everything else talks to it, and so stops last. A worker per runtime of
    ``NDIF_RUNTIMES`` after the farm's own (none with ``NDIF_UP_WORKER`` off). Flower
    unless ``NDIF_FLOWER_PORT`` is 0.
    """
    workers = [*(["worker"] if settings.up_worker else []), *(f"{RUNTIME_WORKER}{version}" for version in settings.runtimes)]
    services = ["web", *workers, "beat"] + (["flower"] if settings.flower_port else [])
    return (["redis"] + services) if settings.embedded_redis else services


def known(service: str) -> bool:
    return service in SERVICES or runtime_of(service) is not None


def runtime_of(service: str) -> Optional[str]:
    """The runtime a ``worker-nnsight<version>`` service serves; None for any other service."""
    if service.startswith(RUNTIME_WORKER):
        return runtimes.check_name(service[len(RUNTIME_WORKER):])
    return None


def service_settings(settings: config.Settings, service: str) -> config.Settings:
    """The settings a service runs with: a runtime's worker's say its runtime,
    and with runtimes on the host each worker takes an equal share of the
    measured memory (unless NDIF_WORKER_MEMORY_GIB says otherwise)."""
    runtime = runtime_of(service)
    if runtime is not None:
        name, at, host = settings.worker_name.partition("@")  # NDIF_WORKER_NAME names the farm's own worker
        settings = dataclasses.replace(settings, worker_nnsight=runtime,
                                       worker_name=f"{name}-nnsight{runtime}{at}{host}" if name else "")
    if (service == "worker" or runtime is not None) and settings.runtimes:
        settings = dataclasses.replace(settings, worker_memory_share=1.0 / (1 + len(settings.runtimes)))
    return settings


def command(settings: config.Settings, service: str, worker_name: Optional[str] = None) -> list[str]:
    """The command line of one service.

    Python services run as ``sys.executable -m ...`` so they use the same
    interpreter (and virtual environment) as the CLI, whatever is on ``PATH``.
    """
    if service == "redis":
        return redis_argv(settings)
    if service == "web":
        return [sys.executable, "-m", "gunicorn", "-c", "python:web.gunicorn_conf", "web.app:create_app()"]
    if service == "worker" or runtime_of(service) is not None:
        settings = service_settings(settings, service)
        return [str(worker_python(settings)), "-m", "celery", "-A", CELERY_APP, *worker_argv(settings, worker_name)]
    if service == "beat":
        # Its schedule file under NDIF_HOME; one beat per farm (a second is
        # safe: the watchdog it runs leads by a lease). Its app is
        # ndif_celery.beat's, which adds the watchdog (ndif_celery.farm.watchdog).
        return [
            sys.executable, "-m", "celery", "-A", BEAT_APP, "beat",
            f"--schedule={settings.home / 'run' / 'beat-schedule'}", f"--loglevel={settings.log_level}",
        ]
    if service == "flower":
        if not settings.flower_port:
            raise StackError("Flower is off on this host (NDIF_FLOWER_PORT=0); set NDIF_FLOWER_PORT=<port> to run it")
        return [
            sys.executable, "-m", "celery", "-A", CELERY_APP, "flower",
            f"--port={settings.flower_port}", f"--address={settings.flower_host}",
        ]
    raise StackError(f"unknown service {service!r}; the services are {', '.join(SERVICES)} and "
                     f"{RUNTIME_WORKER}<version> for each runtime of NDIF_RUNTIMES")


def worker_python(settings: config.Settings):
    """The worker's interpreter: the CLI's, or its runtime's (``NDIF_WORKER_NNSIGHT``,
    added on this host with ``ndif-celery runtime add``)."""
    version = settings.worker_nnsight
    if not version or version == runtimes.main_version():
        return sys.executable
    try:
        return runtimes.find(settings.home, version).interpreter
    except runtimes.RuntimeFailure as error:
        raise StackError(f"cannot start a worker for nnsight {version}: {error}") from None


def child_env(settings: config.Settings, base: Optional[dict] = None, service: str = "") -> dict:
    """The environment of every service: the caller's, plus where the stack lives.

    Everything passes through (``HF_HOME``, ``HF_HUB_OFFLINE``, every
    ``NDIF_*``). ``NDIF_HOME`` and ``NDIF_REDIS_URL`` are set explicitly so all
    services agree on them even when they were defaulted or given relative to
    the caller's directory (services run from :data:`ROOT`); with
    ``NDIF_REDIS_URL`` set, no service would ever start a Redis of its own.
    A worker's own runtime and memory share come with ``service``.
    """
    env = dict(os.environ if base is None else base)
    env["NDIF_HOME"] = str(settings.home)
    env["NDIF_REDIS_URL"] = settings.redis_url
    if service:  # a worker's runtime and memory share (service_settings)
        own = service_settings(settings, service)
        if own.worker_nnsight:
            env["NDIF_WORKER_NNSIGHT"] = own.worker_nnsight
        if own.worker_memory_share != settings.worker_memory_share:
            env["NDIF_WORKER_MEMORY_SHARE"] = repr(own.worker_memory_share)
    if env.get("NDIF_RESULTS_DIR"):
        env["NDIF_RESULTS_DIR"] = str(settings.results_dir.resolve())
    # Logs go to files; unbuffered output keeps a crash's last words in them.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def exec_service(settings: config.Settings, service: str, worker_name: Optional[str] = None) -> None:
    """Replace this process with one service, for a supervisor (Procfile, systemd).

    Same command, environment and directory as under ``up``, but in the
    foreground of the caller and with no state file: the supervisor owns it.
    """
    try:
        argv = command(settings, service, worker_name)
    except RedisServerNotFound as exc:
        raise StackError(str(exc)) from None
    if service == "redis":
        redis_dir(settings).mkdir(parents=True, exist_ok=True)
    if service == "beat":
        (settings.home / "run").mkdir(parents=True, exist_ok=True)  # its schedule file
    env = child_env(settings, service=service)
    os.chdir(ROOT)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, env)
