"""The tests' warm start of Celery workers (tests/support/stacks/launcher.py) keeps a
worker what ``up`` expects: the recorded pid is the shim, the worker it stands
for is forked from the launcher and serves exactly, and killing the shim as a
supervisor would (SIGKILL) ends the worker; ``up`` then starts a fresh one.
The stack's beat is forked from the launcher the same way."""

from __future__ import annotations

import os
import signal
import time

from tests.support import pace
from tests.support.clients.remote import same_as_local
from tests.support.stacks.stack import client_on_stack


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        raw = stat.read()
    return int(raw[raw.rindex(")") + 2:].split()[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _forked_for(launcher: int, home: str) -> set:
    """The logs the launcher's children for the stack at ``home`` write to (their stdout)."""
    logs = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if _parent(int(entry)) != launcher:
                    continue
                out = os.readlink(f"/proc/{entry}/fd/1")
            except (OSError, ValueError):
                continue
            if out.startswith(home):
                logs.add(os.path.basename(out))
    return logs


def _worker_pid(stack) -> int:
    (info,) = stack.farm()["cluster"]["workers"].values()
    return info["pid"]


def test_a_warm_worker_serves_and_ends_with_its_shim(tmp_path, hf_home, model):
    with client_on_stack(tmp_path / "home", hf_home) as stack:
        shim, worker = stack.pids()["worker"], _worker_pid(stack)
        assert worker != shim, "the worker started cold"
        with open(f"/proc/{_parent(worker)}/cmdline", "rb") as cmdline:
            assert b"tests.support.stacks.launcher" in cmdline.read()
        assert _forked_for(_parent(worker), stack.env["NDIF_HOME"]) == {"worker.log", "beat.log"}, "both forked"
        same_as_local(model)

        os.kill(shim, signal.SIGKILL)  # what `down` does to a group that does not stop
        deadline = time.monotonic() + pace.bound(10)
        while _alive(worker):
            assert time.monotonic() < deadline, "the worker outlived its shim"
            time.sleep(0.1)
        deadline = time.monotonic() + pace.bound(60)
        while stack.pids()["worker"] == shim or not stack.farm()["cluster"]["workers"]:
            assert time.monotonic() < deadline, "up did not start a fresh worker"
            time.sleep(0.2)
        same_as_local(model)  # the fresh one (the model loads again on first use)
