"""Keep a single-host stack running: restart a service that dies, with backoff.

``ndif-celery up`` is the embedded default (``make run``), and on one host
nothing else watches its processes: without this module, a worker killed by
the OOM killer would stay dead, and the farm with it. ``up`` in the foreground runs
:meth:`Supervisor.run` itself; ``up --detach`` forks a copy of itself that
leads its own session, starts the services (so they are its children and it
learns how each one ended), and stays to supervise them.

Kept apart from :mod:`ndif_celery.host.stack`, which launches and stops processes:
this module only decides *when* to launch again and records *why*, in
``NDIF_HOME/run/supervisor.json`` (read by ``ndif-celery status``, another
process): per service the restarts and the last exit (code, or the signal that
killed it). A service that dies is restarted after a backoff that starts at
:data:`BACKOFF_START_S` and doubles to :data:`BACKOFF_MAX_S`, and goes back
to the start once the service stayed up :data:`STABLE_S`, so a crash loop
costs little and a rare crash is repaired at once. Each exit and restart is
logged, in the service's own log and the supervisor's. At each look it also
keeps the logs under ``NDIF_HOME/logs`` to their size
(:mod:`ndif_celery.host.log_rotation`), for as long as the stack runs.

A service that exits with :data:`REPLACE_EXIT_CODE` asked to be replaced (a
worker whose user code would not unwind from a deadline): it is
restarted at once, with no backoff, and logged as "replaced itself".

``ndif-celery down`` stops the supervisor first (so nothing it stops comes
back), then the services. The Procfile, Compose and systemd recipes have
supervisors of their own (honcho, ``restart: unless-stopped``,
``Restart=always``) and do not use this module.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from pathlib import Path
from typing import Callable, Optional

from ndif_celery import config
from ndif_celery.exit_codes import REPLACE_EXIT_CODE

from . import log_rotation, processes, stack

BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
# A service that ran this long before dying is restarted after BACKOFF_START_S again.
STABLE_S = 60.0
POLL_S = 0.2


def state_path(settings: config.Settings) -> Path:
    return settings.home / "run" / "supervisor.json"


def exit_reason(code: Optional[int]) -> str:
    """How a process ended, in words, from ``Popen.returncode``."""
    if code is None:
        return "exited (status unknown)"
    if code == REPLACE_EXIT_CODE:
        return f"replaced itself (exit status {REPLACE_EXIT_CODE})"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exited with status {code}"


def read(settings: config.Settings) -> dict:
    """The supervisor's record (``{}`` when none), with ``alive`` added."""
    try:
        record = json.loads(state_path(settings).read_text())
    except (OSError, ValueError):
        return {}
    record["alive"] = processes.alive(record)
    return record


def stop_supervisor(settings: config.Settings, timeout: float) -> Optional[str]:
    """Stop a supervisor of this NDIF_HOME other than this process (``down``).

    Called with the ``stopping`` marker present, so it exits without stopping
    the services (``down`` stops them next, in order). Returns what happened,
    or None when there was none.
    """
    record = read(settings)
    if not record:
        return None
    if int(record.get("pid") or 0) == os.getpid():
        state_path(settings).unlink(missing_ok=True)  # `up` stopping its own stack
        return None
    outcome = "not running"
    pid = int(record.get("pid") or 0)
    if record["alive"] and pid != os.getpid():
        outcome = "stopped"
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while processes.alive(record):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                outcome = "killed"
                break
            time.sleep(0.05)
    state_path(settings).unlink(missing_ok=True)
    return outcome


def stop_all(settings: config.Settings, timeout: float) -> dict:
    """``ndif-celery down``: the supervisor first (so nothing comes back),
    then every service, last started first (``stack.stop``)."""
    stack.mark_stopping(settings)
    supervisor = stop_supervisor(settings, timeout)
    outcome = stack.stop(settings, timeout)
    if not outcome:
        stack.clear_stopping(settings)
    return ({"supervisor": supervisor} if supervisor else {}) | outcome


class Supervisor:
    """Restarts the services of one stack (``state`` as ``stack.start`` returned it)."""

    def __init__(self, settings: config.Settings, state: dict, say: Callable[[str], None]) -> None:
        self.settings = settings
        self.state = state
        self.say = say
        self.stop_requested = False
        self.rotation_failed = False  # said once, until a rotation works again
        self.services = {
            name: {"restarts": 0, "last_exit": None, "restart_at": None, "backoff": BACKOFF_START_S}
            for name in state
        }
        self.started_at = datetime.datetime.now(datetime.timezone.utc).isoformat()
        self.write()

    def request_stop(self, signum=None, frame=None) -> None:
        """A signal handler: the loop ends at its next turn (never mid-launch)."""
        self.stop_requested = True

    def write(self) -> None:
        record = {
            "pid": os.getpid(), "start_ticks": processes.start_ticks(os.getpid()), "started_at": self.started_at,
            "services": {
                name: {"restarts": s["restarts"], "last_exit": s["last_exit"],
                       "restarting": s["restart_at"] is not None}
                for name, s in self.services.items()
            },
        }
        path = state_path(self.settings)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)

    def run(self) -> str:
        """Supervise until told to stop: ``"down"`` when ``ndif-celery down``
        stops the stack (it stops the services), ``"signal"`` on a signal
        (the caller stops them)."""
        while True:
            if stack.stopping(self.settings) or not stack.state_path(self.settings).exists():
                return "down"
            if self.stop_requested:
                return "signal"
            for name in list(self.state):
                try:
                    self.check(name)
                except Exception as exc:  # noqa: BLE001 - the supervisor must outlive one bad restart
                    self.note(name, f"supervising {name} failed ({type(exc).__name__}: {exc}); trying again")
            self.rotate_logs()
            time.sleep(POLL_S)

    def rotate_logs(self) -> None:
        """Keep every log under ``$NDIF_HOME/logs`` within its budget (``log_rotation``):
        no other process of the stack is sure to live as long as the services."""
        try:
            log_rotation.rotate_all(self.settings)
        except OSError as exc:
            if not self.rotation_failed:
                self.say(f"supervisor: could not rotate the logs in {self.settings.home / 'logs'}: {exc}")
            self.rotation_failed = True
        else:
            self.rotation_failed = False

    def check(self, name: str) -> None:
        service = self.services[name]
        if service["restart_at"] is None:
            code = processes.exit_code(self.state[name])
            if code is None:
                return
            self.died(name, code)
        if service["restart_at"] is not None and time.monotonic() >= service["restart_at"]:
            self.restart(name)

    def died(self, name: str, code: Optional[int]) -> None:
        service, entry = self.services[name], self.state[name]
        ran_s = time.time() - datetime.datetime.fromisoformat(entry["started_at"]).timestamp()
        if ran_s >= STABLE_S:
            service["backoff"] = BACKOFF_START_S
        replaced = code == REPLACE_EXIT_CODE
        delay = 0.0 if replaced else service["backoff"]
        if not replaced:
            service["backoff"] = min(service["backoff"] * 2, BACKOFF_MAX_S)
        reason = exit_reason(code)
        service["last_exit"] = {
            "reason": reason, "code": code if code is None or code >= 0 else None,
            "signal": signal.Signals(-code).name if code is not None and code < 0 and -code in _SIGNALS else None,
            "pid": entry.get("pid"), "at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "ran_s": round(ran_s, 1),
        }
        service["restart_at"] = time.monotonic() + delay
        line = f"{name} (pid {entry.get('pid')}) {reason} after {ran_s:.0f} s; restarting it in {delay:g} s"
        self.note(name, line)
        self.write()

    def restart(self, name: str) -> None:
        service = self.services[name]
        try:
            self.state[name] = stack.relaunch(self.settings, name, self.state)
        except stack.StackError as exc:
            service["last_exit"] = dict(service["last_exit"] or {}, reason=f"could not start: {exc}")
            service["restart_at"] = time.monotonic() + service["backoff"]
            service["backoff"] = min(service["backoff"] * 2, BACKOFF_MAX_S)
            self.note(name, f"{name} could not be restarted ({exc}); trying again")
            self.write()
            return
        service["restarts"] += 1
        service["restart_at"] = None
        self.note(name, f"{name} restarted (pid {self.state[name]['pid']}, restart {service['restarts']})")
        self.write()

    def note(self, name: str, line: str) -> None:
        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.say(f"{stamp} supervisor: {line}")
        try:
            with open(stack.log_path(self.settings, name), "a") as log:
                log.write(f"==== {stamp} ndif-celery supervisor: {line}\n")
        except OSError:
            pass


_SIGNALS = {int(s) for s in signal.Signals}
