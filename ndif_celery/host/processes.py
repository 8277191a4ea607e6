"""A service's process, seen from ``up``, ``down``, ``status`` and the supervisor.

Each service ``ndif_celery.host.stack`` starts leads its own process group (its own
session) and is recorded as a state-file entry (``{"pid", "start_ticks", ...}``)
that a later, different process reads. This module answers the questions
asked of such an entry, safely against pid reuse: does it still run, how did
it end, and stop its whole group (SIGTERM, then SIGKILL). Apart from the
stack's service table and state file because it is the one place that
touches /proc and signals; it knows nothing of settings or services.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

# Children started by this process, so we reap them (no zombies while `up`
# runs in the foreground) and can report their exit status.
_CHILDREN: dict[int, subprocess.Popen] = {}


def track(child: subprocess.Popen) -> None:
    """Remember a service this process started (see ``_CHILDREN``)."""
    _CHILDREN[child.pid] = child


def _proc_stat(pid: int) -> Optional[list[str]]:
    """The fields of ``/proc/<pid>/stat`` after the command name, or None.

    None where there is no /proc (macOS) or no such process.
    """
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2:].split()


def start_ticks(pid: int) -> Optional[int]:
    """When ``pid`` started (field 22 of its stat), or None.

    Together with the pid it identifies a process; a pid alone may be reused."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def alive(entry: dict) -> bool:
    """Whether the process an entry of the state file names still runs.

    A zombie is dead (a detached stack's children are reaped by whoever
    adopted them, which may be never), and a pid now used by an unrelated
    process is dead too: where /proc exists its start time must match the one
    recorded, elsewhere it must still lead its own process group.
    """
    pid = int(entry.get("pid") or 0)
    if pid <= 0:
        return False
    child = _CHILDREN.get(pid)
    if child is not None and child.poll() is not None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else: the identity check decides
    fields = _proc_stat(pid)
    if fields is not None:
        if fields[0] in ("Z", "X"):
            return False
        recorded = entry.get("start_ticks")
        return recorded is None or int(fields[19]) == int(recorded)
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in a process group."""
    child = _CHILDREN.get(pgid)
    if child is not None:
        child.poll()  # reap our own child so it does not count as a zombie
    proc = Path("/proc")
    if proc.is_dir():
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            fields = _proc_stat(int(entry.name))
            if fields and len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exit_status(entry: dict) -> Optional[int]:
    """The ``Popen.returncode`` of a service this process started, else None."""
    child = _CHILDREN.get(int(entry.get("pid") or 0))
    return child.poll() if child is not None else None


def exit_code(entry: dict) -> Optional[int]:
    """None while the service an entry names runs; once it ended, its
    ``Popen.returncode`` (negative: the signal), or 0 when it was not our child."""
    if int(entry.get("pid") or 0) in _CHILDREN:
        return exit_status(entry)
    return None if alive(entry) else 0


def stop_group(entry: dict, timeout: float) -> str:
    """Stop the process group an entry leads: SIGTERM, then SIGKILL after
    ``timeout`` s. Returns "not running", "stopped" or "killed"."""
    pgid = int(entry.get("pid") or 0)
    if pgid <= 0:
        return "not running"
    current, recorded = start_ticks(pgid), entry.get("start_ticks")
    if current is not None and recorded is not None and current != int(recorded):
        # The pid now belongs to an unrelated process, so our group is empty
        # (the kernel reuses no pid while a process group of that id exists).
        return "not running"
    if not _group_alive(pgid):
        return "not running"
    if not _signal_group(pgid, signal.SIGTERM):
        return "not running"
    if _wait_group_gone(pgid, timeout):
        return "stopped"
    _signal_group(pgid, signal.SIGKILL)
    _wait_group_gone(pgid, 5.0)
    return "killed"


def _signal_group(pgid: int, signum: int) -> bool:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    return True


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
