"""Celery workers (and beats) forked from a warm process instead of started cold (tests only).

A worker's start spends most of its CPU importing torch, transformers and
nnsight, and the suite starts some fifty workers whose start is not what
their tests prove. So each pytest process runs one *launcher*: a process that
imports those modules once, then forks a worker for each request. A stack's
beat (Celery's imports, a second or so of CPU) comes from it the same way.

How a stack's worker gets here. ``Stack(..., warm=True)`` puts
``tests/support/stacks/warm_start`` on the stack's ``PYTHONPATH`` and the
launcher's socket in ``NDIF_TEST_LAUNCHER``. Every Python process of the
stack then imports ``warm_start/sitecustomize.py`` at start; in a
``python -m celery ... worker`` it hands its command line, environment,
directory and standard streams to the launcher, and stays as a *shim*:

* the shim keeps the pid ``up`` recorded. It passes on the signals a
  supervisor sends (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) and
  ends as the worker ended: the same exit status, or the same signal;
* the launcher forks; the child starts a session of its own, takes the
  streams, environment and directory, and runs Celery's ``__main__``;
* a shim that is killed (SIGKILL reaches no handler) closes its socket, and
  the launcher kills the worker's process group.

Anything the launcher fixed at import time must match the stack's, or the
shim starts the worker cold as usual: the Hugging Face cache variables,
thread counts, GPU visibility, BLAS switches (:data:`FROZEN_AT_IMPORT`). A
stack whose processes are what its tests prove (``up`` and its supervisor,
deadlines that replace a worker, the jail) starts cold: ``warm=False``.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from tests.support.paths import ROOT

WARM_START_DIR = Path(__file__).resolve().parent / "warm_start"
SOCKET_ENV = "NDIF_TEST_LAUNCHER"

# Read by a module at import: a worker whose environment differs in one starts cold.
# (Not CUDA_VISIBLE_DEVICES as NDIF_WORKER_GPUS sets it: CUDA reads it when it
# initialises, and the launcher never does.)
FROZEN_AT_IMPORT = ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TRANSFORMERS_CACHE",
                    "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_CORETYPE",
                    "OPENBLAS_L2_SIZE", "PYTHONHASHSEED", "NDIF_TORCH_THREADS")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

_started: Optional[subprocess.Popen] = None
_path: Optional[str] = None


# -- the test process's side ------------------------------------------------------


def ensure_started(env: dict) -> str:
    """This pytest process's launcher (started with ``env`` on first use); its socket path."""
    global _started, _path
    if _started is not None and _started.poll() is None:
        return _path
    _path = os.path.join(tempfile.mkdtemp(prefix="ndif-launcher-"), "socket")
    _started = subprocess.Popen([sys.executable, "-u", "-m", "tests.support.stacks.launcher", _path], cwd=ROOT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    atexit.register(stop)
    deadline = time.monotonic() + 120
    while not os.path.exists(_path):
        if _started.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the test launcher did not start (exit {_started.poll()})")
        time.sleep(0.05)
    return _path


def stop() -> None:
    if _started is not None and _started.poll() is None:
        _started.terminate()
        try:
            _started.wait(10)
        except subprocess.TimeoutExpired:
            _started.kill()


def stack_env(base: dict) -> dict:
    """What ``base`` (a stack's environment) gains to start its workers warm."""
    # No NDIF_* setting: the launcher configures nothing, and its import-time
    # environment is the tests' (the stack's own settings reach each worker).
    # Bar the suite's pinned torch threads (tests/conftest.py), which a stack inherits.
    path = ensure_started({k: v for k, v in base.items() if not k.startswith("NDIF_") or k == "NDIF_TORCH_THREADS"})
    pythonpath = os.pathsep.join(p for p in (str(WARM_START_DIR), base.get("PYTHONPATH", "")) if p)
    return {SOCKET_ENV: path, "PYTHONPATH": pythonpath}


# -- the launcher ---------------------------------------------------------------------


def _warm_up() -> None:
    """What a worker imports at its start, before any fork: nothing runs, nothing is configured."""
    import celery.bin.celery  # noqa: F401
    import kombu  # noqa: F401
    import nnsight  # noqa: F401
    import nnsight.modeling.transformers  # noqa: F401
    import redis  # noqa: F401
    import sqlalchemy  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401


def _compatible(env: dict) -> bool:
    return all(env.get(name) == os.environ.get(name) for name in FROZEN_AT_IMPORT)


def _run_worker(request: dict, fds: list, others: list) -> None:
    """In the forked child: become the worker the shim asked for; never returns."""
    code = 1
    try:
        for sock in others:
            sock.close()
        os.setsid()
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        for signum in FORWARDED + (signal.SIGCHLD,):
            signal.signal(signum, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        import random

        random.seed()  # not the launcher's sequence, shared by every worker it forked
        sys.argv = ["celery", *request["args"]]
        import runpy

        runpy.run_module("celery", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the worker's own log says what
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass


def serve(path: str) -> None:
    _warm_up()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the test process waits for the name
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    child_of: dict = {}  # connection -> worker pid
    conn_of: dict = {}  # worker pid -> connection
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    parent = os.getppid()
    try:
        while os.getppid() == parent:  # a pytest process killed outright leaves no launcher behind
            for key, _ in selector.select(timeout=0.2):
                if key.fileobj is listener:
                    conn, _ = listener.accept()
                    selector.register(conn, selectors.EVENT_READ)
                    continue
                conn = key.fileobj
                try:
                    data, ancdata, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * 4))
                except OSError:
                    data, ancdata = b"", []
                if not data:  # the shim is gone: so is its worker
                    selector.unregister(conn)
                    conn.close()
                    pid = child_of.pop(conn, None)
                    if pid is not None:
                        try:
                            os.killpg(pid, signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass
                    continue
                while not data.endswith(b"\n"):  # the rest of a long request
                    more = conn.recv(1 << 20)
                    if not more:
                        break
                    data += more
                fds = []
                for level, kind, raw in ancdata:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.extend(int.from_bytes(raw[i:i + 4], sys.byteorder) for i in range(0, len(raw), 4))
                request = json.loads(data.decode())
                if not _compatible(request["env"]) or len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
                    _send(conn, {"cold": True})
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _run_worker(request, fds, [listener, *child_of, conn])
                for fd in fds:
                    os.close(fd)
                child_of[conn], conn_of[pid] = pid, conn
                _send(conn, {"pid": pid})
            while True:  # reap the workers that ended; tell their shims how
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn = conn_of.pop(pid, None)
                if conn is not None:
                    child_of.pop(conn, None)
                    _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
    finally:
        for pid in list(conn_of):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


if __name__ == "__main__":
    serve(sys.argv[1])
