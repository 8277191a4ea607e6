"""Jail layer ``pids_cgroup``: a job's processes counted and capped by the kernel.

Why a module of its own: RLIMIT_NPROC does not bind uid 0, so a fork bomb
in a child that keeps uid 0 is stopped only by a pids cgroup; the worker
makes one per child (``pids_cgroup_path``), the child joins it before
anything else (``join_cgroup``), and the worker removes it, killing what is
left, once the child is gone (``remove_cgroup``).
"""

from __future__ import annotations

import os
import signal
import time

from .kernel import JailError, read_file, write_file

_PIDS_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")  # cgroup v1 pids controller, or v2


def pids_cgroup_path(name: str, root: str = "") -> str:
    """A fresh cgroup under a writable pids controller (``root``, else the
    usual mount points: ``NDIF_JAIL_CGROUP_ROOT``), or '' where none is."""
    for root in ((root,) if root else _PIDS_ROOTS):
        if not os.path.exists(os.path.join(root, "cgroup.procs")):
            continue
        if root == "/sys/fs/cgroup" and "pids" not in read_file(os.path.join(root, "cgroup.controllers")):
            continue
        path = os.path.join(root, "ndif-jobs", name)
        try:
            os.makedirs(path, exist_ok=True)
            return path
        except OSError:
            continue
    return ""


def join_cgroup(path: str, max_pids: int) -> None:
    """Put this process (and so everything it forks) in ``path`` capped at
    ``max_pids`` tasks. RLIMIT_NPROC does not bind uid 0, so a fork bomb in a
    child that keeps uid 0 is stopped here. Raises JailError if it is not so."""
    if not path:
        raise JailError("no writable pids cgroup controller (see NDIF_JAIL_CGROUP_ROOT)")
    try:
        write_file(os.path.join(path, "pids.max"), str(max_pids))
        write_file(os.path.join(path, "cgroup.procs"), str(os.getpid()))
    except OSError as error:
        raise JailError(f"joining the pids cgroup {path} failed: {error.strerror}") from None
    if not in_pids_cgroup():
        raise JailError(f"{path} is not a pids cgroup")


def in_pids_cgroup() -> bool:
    """Whether this process sits in a job cgroup of the pids controller (v1) or the unified tree (v2)."""
    for line in read_file("/proc/self/cgroup").splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if (controllers == "" or "pids" in controllers.split(",")) and "/ndif-jobs/" in path:
            return True
    return False


def remove_cgroup(path: str, timeout_s: float = 10.0) -> None:
    """Kill whatever is left in the job's cgroup, then remove it."""
    if not path:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        for pid in read_file(os.path.join(path, "cgroup.procs")).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError, ValueError):
                pass
        try:
            os.rmdir(path)
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
