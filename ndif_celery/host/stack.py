"""Run a whole farm on one host: Redis, the web, a worker and Flower.

``ndif-celery up`` is the only thing a user runs on a fresh machine, so this
module owns the processes of a single-host stack: it starts each service as a
child process with a log file under ``NDIF_HOME/logs``, records their pids in
``NDIF_HOME/run/stack.json`` so a later ``down`` or ``status`` (a different
process) can find them, decides when the stack is ready, and stops it.

Each service runs in its own process group (its own session), so

- a Ctrl-C in the terminal of ``up`` reaches only ``up``, which then stops the
  services in order (Redis last, after the worker has let go of its jobs);
- stopping a service signals its whole group, including the children it
  forked (gunicorn's workers), and nothing else.

A multi-host farm does not use this module's process management: each host
runs ``ndif-celery worker`` (or ``web``, ``flower``) under its own supervisor,
which :func:`ndif_celery.host.services.exec_service` serves.

What each service runs is :mod:`ndif_celery.host.services`; how a recorded process
is checked and stopped (pid reuse, process groups) is
:mod:`ndif_celery.host.processes`; restarting a service that died is
:mod:`ndif_celery.host.supervisor`. This module keeps the state file, the ports,
start, readiness and stop.

About 450 lines on purpose: start, readiness and stop share the state file
and the services' order, and read best as one sequence.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterable, Optional

import httpx
import redis

from ndif_celery import config
from ndif_celery.state import registry

from . import log_rotation, processes
from .embedded_redis import RedisServerNotFound, redis_dir
from .services import ROOT, SERVICES, StackError, child_env, command, default_services, known

# How long `start` waits for its own Redis before starting the services that
# need it (a redis-server is up in milliseconds; this only bounds a failure).
REDIS_START_TIMEOUT_S = 15.0


# -- paths ------------------------------------------------------------------


def state_path(settings: config.Settings) -> Path:
    return settings.home / "run" / "stack.json"


def _stopping_path(settings: config.Settings) -> Path:
    # Present while `stop` runs, so a foreground `up` whose children are being
    # stopped by `ndif-celery down` from another terminal exits quietly
    # instead of reporting them as crashed.
    return settings.home / "run" / "stopping"


def log_path(settings: config.Settings, service: str) -> Path:
    return settings.home / "logs" / f"{service}.log"


# -- state file ---------------------------------------------------------------


def _read_state(settings: config.Settings) -> dict:
    try:
        return json.loads(state_path(settings).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise StackError(f"cannot read {state_path(settings)}: {exc}; remove it if no stack is running") from None


def _write_state(settings: config.Settings, state: dict) -> None:
    path = state_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, path)  # a reader never sees half a file


def stopping(settings: config.Settings) -> bool:
    """Whether ``stop`` is stopping the stack (``ndif-celery down``) right now."""
    return _stopping_path(settings).exists()


def mark_stopping(settings: config.Settings) -> None:
    """Say that the stack is being stopped on purpose (``stop`` clears it):
    set before the supervisor is stopped, so it restarts nothing meanwhile."""
    marker = _stopping_path(settings)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()


def clear_stopping(settings: config.Settings) -> None:
    _stopping_path(settings).unlink(missing_ok=True)


def relaunch(settings: config.Settings, service: str, state: dict) -> dict:
    """Start ``service`` again in place of its dead entry in ``state``; record it.

    What is left of the old process group (gunicorn's workers, a worker's
    isolation children) is stopped first: it may hold the port or the GPU the
    new one needs.
    """
    processes.stop_group(state[service], 5.0)
    try:
        argv = command(settings, service)
    except RedisServerNotFound as exc:
        raise StackError(str(exc)) from None
    if service == "redis":
        redis_dir(settings).mkdir(parents=True, exist_ok=True)
    entry = _launch(settings, service, argv, child_env(settings, service=service))
    state[service] = entry
    current = _read_state(settings)
    if current:  # not when `down` removed it meanwhile
        current[service] = entry
        _write_state(settings, current)
    return entry


def _port_problem(host: str, port: int, variable: str, what: str) -> Optional[str]:
    """Why ``what`` could not listen on ``host:port``, or None if it can.

    Checked before anything starts: a service that cannot bind dies in its
    log, which is a worse place to learn that the port is taken.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r} for {what}: {exc}"
    family, socktype, proto, _, address = infos[0]
    with socket.socket(family, socktype, proto) as sock:
        # Like the services themselves: a port in TIME_WAIT is free to them.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (
                    f"port {port} is already in use by another process, so {what} cannot listen on "
                    f"{host}:{port}. Stop that process, or choose a free port with {variable}=<port>."
                )
            return f"{what} cannot listen on {host}:{port} ({exc.strerror}); choose another with {variable}=<port>."
    return None


def _check_ports(settings: config.Settings, services: Iterable[str]) -> None:
    wanted = {
        "web": (settings.api_host, settings.api_port, "NDIF_API_PORT", "the web API"),
        "redis": ("127.0.0.1", settings.embedded_redis_port, "NDIF_EMBEDDED_REDIS_PORT", "the embedded Redis"),
        "flower": (settings.flower_host, settings.flower_port, "NDIF_FLOWER_PORT", "Flower"),
    }
    problems = [p for s in services if s in wanted for p in [_port_problem(*wanted[s])] if p]
    if problems:
        raise StackError("\n".join(problems))


def _local_host(host: str) -> str:
    # A wildcard bind address is reachable on loopback.
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


def ping_url(settings: config.Settings) -> str:
    """The web's ``/ping`` on this host, where the stack's own web listens.

    The bind address rather than ``NDIF_API_URL``: the latter may be a public
    name behind a proxy, which says nothing about whether our web is up.
    """
    host = _local_host(settings.api_host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.api_port}/ping"


def flower_url(settings: config.Settings) -> str:
    return f"http://{_local_host(settings.flower_host)}:{settings.flower_port}"


def api_answers(settings: config.Settings, timeout: float = 2.0) -> bool:
    """Whether ``GET /ping`` of the web on this host answers 200."""
    try:
        with httpx.Client(timeout=timeout, trust_env=False) as http:
            return http.get(ping_url(settings)).status_code == 200
    except httpx.HTTPError:
        return False


def log_tail(settings: config.Settings, service: str, lines: int = 40, entry: Optional[dict] = None) -> str:
    """The last lines a service logged, since it was started when ``entry`` says when.

    Earlier runs append to the same file; their lines would only mislead.
    """
    path = log_path(settings, service)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            offset = int(entry["log_offset"]) if entry and entry.get("log_offset") is not None else None
            if offset is not None and offset <= size:
                f.seek(offset)
            else:  # no start recorded, or the log was rotated since
                f.seek(max(0, size - 256 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return f"(no log at {path})"
    tail = text.splitlines()[-lines:]
    return "\n".join(tail) if tail else f"(nothing logged in {path})"


def _failure(settings: config.Settings, service: str, entry: dict, what: str) -> StackError:
    status = processes.exit_status(entry)
    detail = f" with status {status}" if status is not None else ""
    return StackError(
        f"{service} (pid {entry.get('pid')}) {what}{detail}. "
        f"Last lines of {log_path(settings, service)}:\n{log_tail(settings, service, entry=entry)}"
    )


# -- the operations -------------------------------------------------------------


def status(settings: config.Settings) -> list[tuple[str, int, bool]]:
    """Each recorded service, its pid, and whether it still runs, in start order."""
    return [(service, int(entry["pid"]), processes.alive(entry)) for service, entry in _read_state(settings).items()]


def start(settings: config.Settings, services: Optional[Iterable[str]] = None) -> dict:
    """Start the services (default: the whole stack) and record them; do not wait.

    Refuses when the state file names running processes: two stacks in one
    ``NDIF_HOME`` would share a Redis directory and a state file. Checks the
    ports first, so a taken port is reported as such rather than as a crash.
    If any service fails to launch, the ones already launched are stopped.
    Returns the new state: service -> {pid, command, started_at, ...}.
    """
    services = list(default_services(settings) if services is None else services)
    for service in services:
        if not known(service):
            raise StackError(f"unknown service {service!r}; the services are {', '.join(SERVICES)}")

    running = [(service, pid) for service, pid, alive in status(settings) if alive]
    if running:
        listed = ", ".join(f"{service} pid {pid}" for service, pid in running)
        raise StackError(
            f"ndif-celery is already running; run `ndif-celery down` first "
            f"(NDIF_HOME={settings.home}: {listed})"
        )
    if state_path(settings).exists():
        stop(settings)  # stale: its leaders died; collect stragglers and the file
    _check_ports(settings, services)

    try:
        argvs = {service: command(settings, service) for service in services}
    except RedisServerNotFound as exc:
        raise StackError(str(exc)) from None
    (settings.home / "logs").mkdir(parents=True, exist_ok=True)
    if "redis" in services:
        redis_dir(settings).mkdir(parents=True, exist_ok=True)
    state: dict = {}
    try:
        for service in services:
            state[service] = _launch(settings, service, argvs[service], child_env(settings, service=service))
            _write_state(settings, state)
            if service == "redis":
                _wait_redis(settings, state["redis"])
    except BaseException:
        _write_state(settings, state)
        stop(settings)
        raise
    return state


def _launch(settings: config.Settings, service: str, argv: list[str], env: dict) -> dict:
    path = log_path(settings, service)
    try:
        log_rotation.rotate(path, settings.log_max_bytes, settings.log_backups)  # left over its size before
    except OSError:
        pass  # the service starts all the same; the supervisor says why at its next rotation
    started = datetime.datetime.now(datetime.timezone.utc)
    with open(path, "ab") as log:
        offset = log.tell()
        log.write(f"==== {started.isoformat(timespec='seconds')} ndif-celery starts {service}: "
                  f"{' '.join(argv)}\n".encode())
        log.flush()
        try:
            child = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: see the module docstring
            )
        except OSError as exc:
            raise StackError(f"cannot start {service} ({argv[0]}): {exc}") from None
    processes.track(child)
    return {
        "pid": child.pid,
        "command": argv,
        "started_at": started.isoformat(),
        "start_ticks": processes.start_ticks(child.pid),
        "log": str(path),
        "log_offset": offset,
    }


def _wait_redis(settings: config.Settings, entry: dict) -> None:
    """Wait for our own Redis, so the others find their broker on the first try."""
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=1, socket_connect_timeout=1)
    deadline = time.monotonic() + REDIS_START_TIMEOUT_S
    try:
        while True:
            if not processes.alive(entry):
                raise _failure(settings, "redis", entry, "exited while starting")
            try:
                if client.ping():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise _failure(settings, "redis", entry, f"did not answer PING within {REDIS_START_TIMEOUT_S:.0f}s")
            time.sleep(0.05)
    finally:
        client.close()


def _worker_registered(client: redis.Redis, since: float) -> bool:
    """Whether a worker has registered itself (workers write ``ndif:workers`` once ready).

    An entry last seen before the stack started is a leftover of an earlier
    run (the embedded Redis persists), not a worker of this one.
    """
    for raw in client.hvals(registry.WORKERS):
        try:
            last_seen = float(json.loads(raw).get("last_seen"))
        except (ValueError, TypeError, AttributeError):
            return True  # not the shape we know: take it at its word
        if last_seen >= since - 1.0:
            return True
    return False


class _NotYet(Exception):
    pass


def _answers_200(http: httpx.Client, url: str) -> bool:
    response = http.get(url)
    if response.status_code != 200:
        raise _NotYet(f"answered {response.status_code}")
    return True


def wait_ready(settings: config.Settings, timeout: float) -> None:
    """Wait until the stack serves: Redis answers PING, the web answers
    ``GET /ping`` with 200, a worker has registered, and Flower answers.

    Only the checks of services that were started apply (Redis always: nothing
    works without it). If a service dies meanwhile, fail at once with the tail
    of its log, rather than waiting out the timeout for something that
    will never come.
    """
    state = _read_state(settings)
    if not state:
        raise StackError(f"no stack is running in {settings.home}; run `ndif-celery up`")
    since = min(datetime.datetime.fromisoformat(e["started_at"]).timestamp() for e in state.values())
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=2, socket_connect_timeout=2)
    http = httpx.Client(timeout=2.0, trust_env=False)  # loopback: never through a proxy

    checks = {"redis": lambda: bool(client.ping())}
    if "web" in state:
        checks["web"] = lambda: _answers_200(http, ping_url(settings))
    if "worker" in state:
        checks["worker"] = lambda: _worker_registered(client, since)
    if "flower" in state:
        checks["flower"] = lambda: _answers_200(http, flower_url(settings) + "/healthcheck")
    waiting_for = {
        "redis": f"Redis at {settings.redis_url} to answer PING",
        "web": f"GET {ping_url(settings)} to answer 200",
        "worker": f"a worker to register in the Redis hash {registry.WORKERS}",
        "flower": f"Flower at {flower_url(settings)}",
    }
    errors: dict[str, str] = {}
    passed: set[str] = set()
    deadline = time.monotonic() + timeout
    try:
        while True:
            for service, entry in state.items():
                if not processes.alive(entry):
                    raise _failure(settings, service, entry, "exited while starting")
            redis_ok = False
            for name, check in checks.items():
                if name in passed:
                    continue
                try:
                    ok = check()
                except (redis.RedisError, httpx.HTTPError, OSError, _NotYet) as exc:
                    ok = False
                    errors[name] = str(exc) if isinstance(exc, _NotYet) else f"{type(exc).__name__}: {exc}"
                if not ok:
                    continue
                errors.pop(name, None)
                if name == "redis":
                    redis_ok = True  # checked every round: the others depend on it
                else:
                    passed.add(name)
            if redis_ok and passed == set(checks) - {"redis"}:
                return
            if time.monotonic() > deadline:
                break
            time.sleep(0.25)
    finally:
        client.close()
        http.close()

    pending = [name for name in checks if name not in passed and not (name == "redis" and redis_ok)]
    lines = [f"the stack was not ready within {timeout:.0f}s; still waiting for:"]
    for name in pending:
        lines.append(f"- {waiting_for[name]}" + (f" (last error: {errors[name]})" if name in errors else ""))
    for name in pending:
        if name in state:
            lines.append(f"Last lines of {log_path(settings, name)}:\n{log_tail(settings, name, entry=state[name])}")
    raise StackError("\n".join(lines))


def stop(settings: config.Settings, timeout: float = 10) -> dict:
    """Stop every recorded service, last started first, and forget them.

    Reverse order, one at a time: the worker finishes (or gives back) its job
    while Redis is still there to take the acknowledgement. Each process group
    gets SIGTERM, then SIGKILL if it is still there ``timeout`` seconds later.
    Stopping what is not running is fine. Returns service -> what happened.
    """
    state = _read_state(settings)
    outcome: dict[str, str] = {}
    if not state:
        state_path(settings).unlink(missing_ok=True)
        return outcome
    mark_stopping(settings)
    marker = _stopping_path(settings)
    try:
        for service in reversed(list(state)):
            outcome[service] = processes.stop_group(state[service], timeout)
        state_path(settings).unlink(missing_ok=True)
    finally:
        marker.unlink(missing_ok=True)
    return outcome
