"""The fork server: a pristine copy of the worker that forks its zygotes.

With ``NDIF_ISOLATION=fork`` a model's zygote (``workers.isolation.zygote``) is not a
fresh interpreter but a fork of this server, which the worker forks from
itself once, at the Celery ``worker_init`` signal: before it has opened a
Redis, object store or database client, before any job, payload, result or
URL has existed in it, and before CUDA. The server then scrubs what secrets
the worker's process still held at that point:

- the environment: ``os.environ`` cut down to what a zygote needs, every
  original value overwritten, the environment block (``/proc/self/environ``)
  zeroed (``jail.scrub_secrets``);
- the settings: ``workers.tasks`` (``this_worker.settings``, the Celery app) dropped from
  ``sys.modules``;
- every copy of every secret and of its derived forms (a URL's password,
  quoted and unquoted; ``user:password``; each secret-named environment
  variable's value) overwritten wherever it lies in this process's writable
  memory, live objects and freed heap alike (``scrub_memory``).

Then, per resident model, it forks the zygote, which maps the worker's
weights and forks the jailed children exactly as an exec'd zygote does, so
both modes share one child-side path. What a forked zygote saves over an
exec'd one is the interpreter start and the imports (its pages are the
worker's, shared copy-on-write).

The worker talks to the server over a Unix socket: JSON requests and
replies, file descriptors by ``SCM_RIGHTS``; nothing is unpickled on the
worker's side. A dead server is not restarted (the clean point is gone):
untrusted jobs are then refused until the worker restarts.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Iterable, Optional
from urllib.parse import unquote, urlsplit

from . import control_channel
from .zygote import ZygoteError

READY_TIMEOUT_S = 60.0
MIN_SECRET_LEN = 8  # shorter values are not searched for: too likely to hit unrelated bytes
_SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSW|PASSWD|CREDENTIAL|AUTH", re.I)
_DROPPED_MODULES = ("workers.tasks",)  # the worker's settings and Celery app


class ForkServerError(ZygoteError):
    """No zygote can come from the fork server: the job is refused, never run weaker."""


def derived_secrets(secrets: Iterable[str], environ: dict, keep: Iterable[str] = ()) -> list[bytes]:
    """Every form of the secrets worth searching for in memory: each value, a
    URL's password (quoted and unquoted) and ``user:password``, and the value
    of every environment variable whose name says it is secret. Values that
    occur inside a kept (needed) environment value are left out, so scrubbing
    cannot corrupt what the zygote still uses."""
    values = {s for s in secrets if isinstance(s, str)}
    values |= {v for k, v in environ.items() if _SECRET_NAME.search(k) and k not in keep}
    for value in list(values):
        try:
            parts = urlsplit(value)
        except ValueError:
            continue
        if parts.scheme and parts.password:
            raw = parts.netloc.rsplit("@", 1)[0]
            user, _, password = raw.partition(":")
            values |= {password, unquote(password), raw, unquote(raw)}
    kept = [v for k, v in environ.items() if k in keep]
    found = set()
    for value in values:
        if len(value) < MIN_SECRET_LEN or any(value in k for k in kept):
            continue
        for encoding in ("utf-8", "latin-1"):
            try:
                found.add(value.encode(encoding))
            except UnicodeEncodeError:
                pass
    return sorted(found, key=len, reverse=True)


def scrub_memory(needles: list[bytes]) -> int:
    """Overwrite every occurrence of every needle in this process's writable
    anonymous memory (heap, arenas, stack, environment block) with ``x``:
    live strings and freed residue alike. Searched in place (no copies made
    that could themselves linger). Returns the number of occurrences."""
    if not needles:
        return 0
    pattern = re.compile(b"|".join(re.escape(n) for n in needles))  # matched on its compiled code, not these bytes
    regions = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if not fields[1].startswith("rw") or (len(fields) > 5 and fields[5].startswith("/")):
                continue
            if len(fields) > 5 and fields[5] in ("[vvar]", "[vsyscall]"):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            regions.append((start, end))
    hits = 0
    for start, end in regions:
        view = (ctypes.c_char * (end - start)).from_address(start)
        for match in pattern.finditer(view):
            ctypes.memset(start + match.start(), ord("x"), match.end() - match.start())
            hits += 1
    return hits


# --- the worker's side ---------------------------------------------------------------


class ForkedProcess:
    """A zygote the server forked, seen from the worker: the parts of
    ``subprocess.Popen`` that ``workers.isolation.zygote.Zygote`` uses (its exit status
    comes from the server, its parent)."""

    def __init__(self, pid: int, stdin) -> None:
        self.pid = pid
        self.stdin = stdin
        self.returncode: Optional[int] = None
        self._exited = threading.Event()

    def ended(self, status: int) -> None:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(status) if status >= 0 else status
        self._exited.set()

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired("zygote", timeout)
        return self.returncode

    def kill(self) -> None:
        if not self._exited.is_set():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class ForkServer:
    """The worker's handle on its fork server."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock = sock
        self.pid = pid
        self.error: Optional[str] = None
        self.ready = threading.Event()
        self._lock = threading.Lock()
        self._replies = threading.Condition()
        self._spawned: dict[int, ForkedProcess] = {}
        self._processes: dict[int, ForkedProcess] = {}
        self._pipes: dict[int, object] = {}
        self._next = 0
        self._reader = threading.Thread(target=self._read, name="ndif-forkserver", daemon=True)
        self._reader.start()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        control_channel.wait_ready(self, timeout, ForkServerError, "the fork server")

    def spawn(self, zygote_fd: int, cpu_fd: int) -> ForkedProcess:
        """Fork a zygote that serves on ``zygote_fd`` and maps the weights
        from ``cpu_fd``; its header goes to the returned process's ``stdin``."""
        self.wait_ready()
        header_read, header_write = os.pipe()
        fds = [zygote_fd, header_read] + ([cpu_fd] if cpu_fd >= 0 else [])
        with self._lock:
            self._next += 1
            request = self._next
            self._pipes[request] = os.fdopen(header_write, "wb")
            try:
                socket.send_fds(self.sock, [json.dumps({"spawn": request, "cpu": cpu_fd >= 0}).encode()], fds)
            except OSError as error:
                self._pipes.pop(request).close()
                raise ForkServerError(f"the fork server is gone ({error})") from None
            finally:
                os.close(header_read)
        deadline = time.monotonic() + 30
        with self._replies:
            while request not in self._spawned:
                if self.error or time.monotonic() > deadline:
                    pipe = self._pipes.pop(request, None)
                    if pipe is not None:
                        pipe.close()
                    raise ForkServerError(self.error or "the fork server did not fork a zygote in 30 s")
                self._replies.wait(0.1)
            return self._spawned.pop(request)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _read(self) -> None:
        for message in control_channel.messages(self.sock):
            if control_channel.settled(self, message):
                continue
            if "spawned" in message:
                request = int(message["spawned"])
                process = ForkedProcess(int(message["pid"]), self._pipes.pop(request, None))
                with self._replies:
                    self._processes[process.pid] = process
                    self._spawned[request] = process
                    self._replies.notify_all()
            elif "exited" in message:
                with self._replies:
                    process = self._processes.pop(int(message["exited"]), None)
                if process is not None:
                    process.ended(int(message["status"]))
        self._gone(self.error or "the fork server exited; restart the worker to get a clean one")

    def _gone(self, reason: str) -> None:
        if self.error is None:
            self.error = reason
        self.ready.set()
        with self._replies:
            processes = list(self._processes.values())
            self._processes = {}
            self._replies.notify_all()
        for process in processes:  # they die with the server (parent-death signal)
            process.ended(-signal.SIGKILL)


_server: Optional[ForkServer] = None


def current() -> Optional[ForkServer]:
    return _server


def start(secrets: Iterable[str], keep_env: Iterable[str]) -> ForkServer:
    """Fork the fork server from this process, now (call it from the main
    thread at ``worker_init``, before any client, job or CUDA). The heavy
    imports come first, so the server and every zygote share their pages."""
    global _server
    import nnsight.modeling.transformers  # noqa: F401
    import torch  # noqa: F401 - before the fork: shared, and never CUDA-initialised here

    from workers.cuda import cuda_initialized

    if cuda_initialized():
        raise ForkServerError("this process has initialised CUDA; it cannot be the fork server's template")
    keep_env = tuple(keep_env)
    needles = derived_secrets(tuple(secrets), dict(os.environ), keep_env)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            _become_server(theirs, needles, keep_env)
        finally:
            os._exit(1)
    theirs.close()
    del needles
    _server = ForkServer(ours, pid)
    threading.Thread(target=_reap, args=(pid,), name="ndif-forkserver-reap", daemon=True).start()
    return _server


def stop() -> None:
    global _server
    server, _server = _server, None
    if server is not None:
        server.close()


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


# --- the server process -----------------------------------------------------------


def _become_server(sock: socket.socket, needles: list, keep_env: tuple) -> None:
    """Clean up after the worker, then serve. Never returns."""
    from . import jail

    jail.die_with_parent()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)  # not the worker's (Celery's) handlers
    for fd in jail.open_fds():
        if fd > 2 and fd != sock.fileno():
            try:
                os.close(fd)
            except OSError:
                pass
    try:
        kept = {k: os.environ[k] for k in keep_env if k in os.environ}  # decoded: copies of their own
        jail.scrub_secrets([])  # every environment value overwritten, the block zeroed
        os.environ.clear()
        os.environ.update(kept)
        # torch.cuda.is_available() without this initialises the CUDA driver,
        # after which no forked child could use the GPU.
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        for name in _DROPPED_MODULES:
            sys.modules.pop(name, None)
        gc.collect()
        scrub_memory(needles)
        del needles
    except BaseException as error:  # noqa: BLE001 - reported: no zygote from an unscrubbed server
        control_channel.reply(sock, {"error": f"the fork server could not scrub itself: {type(error).__name__}: {error}"})
        os._exit(1)
    control_channel.reply(sock, {"ready": True})
    _serve(sock)


def _serve(sock: socket.socket) -> None:
    children: set = set()
    for request, fds in control_channel.requests(sock, 3, children):
        zygote_fd, header_fd = fds[0], fds[1]
        cpu_fd = fds[2] if request.get("cpu") and len(fds) > 2 else -1
        pid = os.fork()
        if pid == 0:
            _become_zygote(sock, zygote_fd, header_fd, cpu_fd)
        for fd in fds:
            os.close(fd)
        children.add(pid)
        control_channel.reply(sock, {"spawned": request["spawn"], "pid": pid})
    os._exit(0)  # the worker is gone or let go of us: zygotes die with us


def _become_zygote(server_sock: socket.socket, zygote_fd: int, header_fd: int, cpu_fd: int) -> None:
    from . import jail, zygote

    code = 1
    try:
        server_sock.close()
        jail.die_with_parent()
        with os.fdopen(header_fd, "rb") as header:
            zygote.serve(zygote_fd, cpu_fd, header)
        code = 0
    finally:
        os._exit(code)
