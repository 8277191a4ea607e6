"""Environments for older nnsight clients, made from the package index once per checkout.

A client of another version is made exactly as a runtime is
(``ndif_celery.host.runtimes.add``): its own nnsight (and what it needs, such
as python-socketio for 0.6/0.7) over this project's torch and transformers;
the same environment, linked into a stack's home, is that runtime's workers'.
Its script runs in a subprocess with that interpreter, against the tests'
offline model cache, and prints a JSON line of what happened.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from ndif_celery.host import runtimes
from tests.support.paths import OUT_DIR

#: Where the test runs keep the client environments (runtimes of this checkout), made once.
SHARED_HOME = OUT_DIR / "clients"


def shared(version: str, python: Optional[str] = None) -> runtimes.Runtime:
    """The runtime of ``version`` under :data:`SHARED_HOME` (on ``python``, if
    given), made by the first pytest process that asks (the others wait on a
    lock) and kept between runs: it serves as a client's environment and,
    linked into a stack's home, as a worker's runtime."""
    SHARED_HOME.mkdir(parents=True, exist_ok=True)
    with open(SHARED_HOME / f".lock-{version}{'-' + Path(python).parent.parent.name if python else ''}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return runtimes.add(SHARED_HOME, version, log=lambda line: None, python=python)


def client_only(name: str, requirements: list, drop: tuple = ()) -> Path:
    """The interpreter of a client environment that serves no worker (a 0.4
    client, or 0.5 with another cloudpickle): made as a runtime is, with
    ``requirements``, once under :data:`SHARED_HOME` (the first process that
    asks makes it; a failed make leaves nothing)."""
    path = SHARED_HOME / "client-only" / name
    SHARED_HOME.mkdir(parents=True, exist_ok=True)
    with open(SHARED_HOME / f".lock-client-only-{name}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "made").exists():
            shutil.rmtree(path, ignore_errors=True)
            try:
                runtimes.build_environment(path, requirements, log=lambda line: None, drop=drop)
            except BaseException:
                shutil.rmtree(path, ignore_errors=True)
                raise
            (path / "made").write_text(" ".join(requirements) + "\n")
    return path / "bin" / "python"


def other_python() -> Optional[str]:
    """An interpreter of another Python minor than this one on this host (pyenv's,
    or ``python3.X`` on the PATH), or None."""
    found = [shutil.which(f"python3.{minor}") or "" for minor in (12, 10, 13)]  # newest first, one below
    found += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1*/bin/python3")),
                    key=lambda path: "/3.12." not in path)
    for python in filter(None, found):
        said = subprocess.run([python, "-c", "import sys; print(sys.version_info[1])"],
                              capture_output=True, text=True, timeout=60)
        if said.returncode == 0 and said.stdout.strip().isdigit() and \
                int(said.stdout) >= 10 and int(said.stdout) != sys.version_info.minor:
            return python
    return None


def link_into(home: Path, runtime: runtimes.Runtime) -> None:
    """Make ``runtime`` one of the stack at ``home``'s runtimes (as ``runtime add`` there would)."""
    target = runtimes.folder(home, runtime.version)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        target.symlink_to(runtime.path, target_is_directory=True)


@contextlib.contextmanager
def runtimes_stack(home: Path, hf_home: Path, runtimes: list, env: Optional[dict] = None, timeout_s: float = 180):
    """A stack with keys required whose workers serve ``runtimes`` (``NDIF_RUNTIMES``,
    each linked into ``home``) beside the farm's own: started, a worker of each
    registered, discarded after."""
    from ndif_celery.policy import client_versions
    from tests.support.stacks.stack import Stack, offline_env
    from tests.support.stacks.stack_pool import AUTH_LIMITS_OFF

    for runtime in runtimes:
        link_into(home, runtime)
    names = {runtime.version for runtime in runtimes}
    stack = Stack(home, env={**offline_env(hf_home), **AUTH_LIMITS_OFF, "NDIF_AUTH": "1", "NDIF_AUTH_CACHE_S": "0",
                             "NDIF_RUNTIMES": ",".join(runtime.version for runtime in runtimes), **(env or {})})
    stack.start()
    try:
        stack.until(lambda: {info.get("nnsight") for info in stack.operator_farm()["cluster"]["workers"].values()}
                    >= names | {client_versions.MAIN}, "a worker of each runtime to register", timeout_s=timeout_s)
        yield stack
    finally:
        stack.discard()


def run(python: Path, script: str, *args: str, timeout_s: float = 180, env: dict | None = None) -> dict:
    """Run ``script`` under ``python`` with the offline cache (and ``env``); its last JSON line."""
    return run_all(python, script, *args, timeout_s=timeout_s, env=env)[-1]


def run_all(python: Path, script: str, *args: str, timeout_s: float = 180, env: dict | None = None) -> list:
    """Run ``script`` under ``python`` with the offline cache (and ``env``); every JSON line it printed."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NDIF_")}, **(env or {})}
    done = subprocess.run([str(python), "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    # The older clients draw their job's status on one line they rewrite, without an end:
    # the script's JSON may follow it on the same line.
    lines = [line[line.index('{"'):] for line in done.stdout.strip().splitlines() if '{"' in line]
    if done.returncode != 0 or not lines:
        raise AssertionError(f"the client script failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in lines]
