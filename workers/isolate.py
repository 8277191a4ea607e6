"""Untrusted requests run in a fresh, jailed child forked per request.

The worker keeps the model resident and forks: the child shares the weights
copy-on-write (an in-place edit copies the page into the child and dies with
it), deserializes and runs the user's block inside the jail (``workers.jail``)
and hands back only bytes: LOG lines, the result blob, a JSON error. The
parent never unpickles anything the child sends. At the deadline the child's
whole process group is killed.

The fork and the jail are paid ahead of time: after an untrusted job the
worker prepares a :class:`Spare` (forked, jailed, OpenMP pool started) that
waits for the next request on the same model; a request with no fitting spare
forks one on the spot. Either way each request gets a child of its own.

Frames on the pipes: one type byte, an 8-byte big-endian length, the body.
Child to worker: ``L`` a LOG line (UTF-8), ``R`` the result blob, ``E`` an
error message (UTF-8), ``M`` meta (JSON). Worker to child: ``J`` the request's
JSON header (compress, env), then ``B`` the payload blob.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import jail
from .execute import RequestError, result_too_big

_HEADER = struct.Struct(">cQ")


@dataclass
class Outcome:
    data: Any  # bytes-like
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Policy:
    timeout_s: float
    memory_bytes: int
    disk_bytes: int
    secrets: tuple = ()
    max_result_bytes: int = 0
    readable: tuple = ()  # paths user code may read (see jail.readable_paths)
    max_processes: int = 256
    as_nobody: bool = True


class Spare:
    """A child forked and jailed ahead of time, waiting for its one request.

    Forking, entering the namespaces, mounting, Landlock and dropping
    privileges cost tens of milliseconds; a spare pays them while the worker
    is idle, so a request only ships its payload down a pipe. A spare serves
    exactly one request and is never reused. It is tied to the model object it
    was forked with (a reloaded model needs a new spare) and is made after a
    job has ended and the weights are as loaded, exactly when a request-time
    fork would have been made.
    """

    def __init__(self, model: Any, policy: Policy, zygote: Any = None) -> None:
        self.model_id = id(model)
        self.zygote = zygote
        self.policy = policy
        self.workdir = tempfile.mkdtemp(prefix="ndif-job-")
        self.cgroup = jail.pids_cgroup_path(os.path.basename(self.workdir))
        out_read, out_write = os.pipe()  # child -> worker: frames
        in_read, in_write = os.pipe()  # worker -> child: the request
        started = time.perf_counter()

        def child() -> None:  # never returns
            os.close(out_read)
            os.close(in_write)
            _child(model, policy, out_write, in_read, self.workdir, self.cgroup)

        try:
            if zygote is not None:  # forked by the model's zygote (workers.zygote), not by us
                self.forked = zygote.fork(out_write, in_read, policy, self.workdir, self.cgroup)
            else:
                self.forked = ForkedChild(child)
        except BaseException:
            for fd in (out_read, out_write, in_read, in_write):
                os.close(fd)
            shutil.rmtree(self.workdir, ignore_errors=True)
            jail.remove_cgroup(self.cgroup)
            raise
        os.close(out_write)
        os.close(in_read)
        self.out_fd, self.in_fd = out_read, in_write
        self.fork_ms = round((time.perf_counter() - started) * 1000, 1)

    def fits(self, model: Any, policy: Policy, zygote: Any = None) -> bool:
        return (self.model_id == id(model) and self.policy == policy and self.zygote is zygote
                and self.forked.status is None)

    def run(self, blob: bytes, compress: bool, env: dict, log: Callable[[str], None]) -> Outcome:
        """Hand the request to the child and collect what it sends back."""
        header = json.dumps({"compress": bool(compress), "env": env}).encode()
        try:
            _write_all(self.in_fd, _HEADER.pack(b"J", len(header)) + header)
            _write_all(self.in_fd, _HEADER.pack(b"B", len(blob)))
            _write_all(self.in_fd, blob)
        except BrokenPipeError:
            pass  # the child died before reading (its jail failed): _collect says why
        finally:
            os.close(self.in_fd)
            self.in_fd = -1
        return _collect(self.forked, self.out_fd, self.policy, log)

    def close(self) -> None:
        self.forked.kill()
        self.forked.wait()
        for fd in (self.in_fd, self.out_fd):
            if fd >= 0:
                os.close(fd)
        self.in_fd = self.out_fd = -1
        shutil.rmtree(self.workdir, ignore_errors=True)
        jail.remove_cgroup(self.cgroup)


_spare: "Spare | None" = None
_spare_lock = threading.Lock()


def _take_spare(model: Any, policy: Policy, zygote: Any) -> "Spare | None":
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    if spare is not None and not spare.fits(model, policy, zygote):
        spare.close()
        return None
    return spare


def prepare(model: Any, policy: Policy, zygote: Any = None) -> None:
    """Make a spare for the next request on ``model`` (replacing any other).

    Called by the job's own thread after a job has ended, so no torch work runs
    in this process while it forks."""
    global _spare
    with _spare_lock:
        current = _spare
    if current is not None and current.fits(model, policy, zygote):
        return
    discard()
    spare = Spare(model, policy, zygote)
    with _spare_lock:
        _spare = spare


def discard() -> None:
    """Kill the spare (its model is being evicted, or the worker stops)."""
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    if spare is not None:
        spare.close()


def run(model: Any, blob: bytes, compress: bool, env: dict, policy: Policy, log: Callable[[str], None],
        zygote: Any = None) -> Outcome:
    """Run one request in a jailed child (the spare if one fits, else a new one),
    forked by this process or by ``zygote``; return its result bytes or raise
    RequestError."""
    started = time.perf_counter()
    spare = _take_spare(model, policy, zygote)
    warm = spare is not None
    if spare is None:
        spare = Spare(model, policy, zygote)
    try:
        outcome = spare.run(blob, compress, env, log)
    finally:
        # Killing, reaping and cleaning up after the child is nobody's wait.
        threading.Thread(target=spare.close, name="ndif-reap", daemon=True).start()
    outcome.meta["isolated_ms"] = round((time.perf_counter() - started) * 1000, 1)
    outcome.meta["spare"] = warm
    return outcome


class ForkedChild:
    """A child forked from a fresh thread that stays to reap it.

    GNU OpenMP keeps its thread pool per thread and is not fork-safe: a child
    forked from a thread that has used the pool (this worker's job thread, after
    any trusted job) deadlocks at its first parallel region. A child forked
    from a fresh thread builds a new pool, and computes exactly as the worker
    does, with as many threads. The thread waits for the child rather than
    exit at once, because the child's parent-death signal fires when the thread
    that forked it ends.
    """

    def __init__(self, child: Callable[[], None]) -> None:
        self._forked = threading.Event()
        self.pid = 0
        self.status: int | None = None
        self._thread = threading.Thread(target=self._run, args=(child,), name="ndif-fork", daemon=True)
        self._thread.start()
        self._forked.wait()

    def _run(self, child: Callable[[], None]) -> None:
        pid = os.fork()
        if pid == 0:
            child()
        self.pid = pid
        self._forked.set()
        _, self.status = os.waitpid(pid, 0)

    def wait(self) -> int:
        self._thread.join()
        return self.status if self.status is not None else 0

    def kill(self) -> None:
        _kill_group(self.pid)


def _collect(forked: ForkedChild, fd: int, policy: Policy, log: Callable[[str], None]) -> Outcome:
    deadline = time.monotonic() + policy.timeout_s
    buffer = bytearray()
    result, error, meta = None, None, {}
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            forked.kill()
            raise RequestError(f"Your job exceeded the execution timeout of {policy.timeout_s:g}s.", kind="timeout")
        # Short waits, so a cancel (an exception raised in this thread) lands promptly.
        ready, _, _ = select.select([fd], [], [], min(remaining, 0.1))
        if not ready:
            continue
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        buffer += chunk
        if policy.max_result_bytes and len(buffer) > policy.max_result_bytes + (1 << 20):
            forked.kill()
            raise result_too_big(len(buffer), policy.max_result_bytes)
        while len(buffer) >= _HEADER.size:
            kind, length = _HEADER.unpack_from(buffer)
            if len(buffer) < _HEADER.size + length:
                break
            if kind == b"R":  # the last frame: keep it where it is, no copy
                result = memoryview(buffer)[_HEADER.size : _HEADER.size + length]
                break
            body = bytes(buffer[_HEADER.size : _HEADER.size + length])
            del buffer[: _HEADER.size + length]
            if kind == b"L":
                log(body.decode("utf-8", "replace"))
            elif kind == b"E":
                error = body.decode("utf-8", "replace")
            elif kind == b"M":
                meta.update(json.loads(body))
        if result is not None or error is not None:
            break  # the child's last word: no need to wait for it to exit
    if error is not None:
        raise RequestError(error)
    if result is None:
        raise RequestError(_died(forked.wait(), policy))
    return Outcome(result, meta)


def _died(status: int, policy: Policy) -> str:
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        hint = {
            "SIGXCPU": f" (it used its {policy.timeout_s:g} s of CPU time)",
            "SIGKILL": " (killed: over a limit, or it tried to take down its own jail)",
            "SIGSEGV": " (a crash, possibly from running out of its memory allowance)",
        }.get(sig, "")
        return f"Your job's isolated process died of {sig}{hint} before it returned a result."
    return f"Your job's isolated process exited (status {os.WEXITSTATUS(status)}) before it returned a result."


def _kill_group(pid: int) -> None:
    """SIGKILL the child's process group (its ``ForkedChild`` thread reaps it)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# --- the child --------------------------------------------------------------------


def _send(fd: int, kind: bytes, body) -> None:
    body = memoryview(body)
    if body.nbytes < 65536:
        _write_all(fd, _HEADER.pack(kind, body.nbytes) + body.tobytes())
    else:  # a big result: no copy of it just to prepend the header
        _write_all(fd, _HEADER.pack(kind, body.nbytes))
        _write_all(fd, body)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _read_exactly(fd: int, size: int) -> bytes:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise EOFError("the worker closed the request pipe")
        got += n
    return bytes(buffer)


def _receive_request(fd: int) -> tuple[bytes, bool, dict]:
    """The request the worker hands a spare: a JSON header, then the blob."""
    kind, length = _HEADER.unpack(_read_exactly(fd, _HEADER.size))
    header = json.loads(_read_exactly(fd, length)) if kind == b"J" else {}
    kind, length = _HEADER.unpack(_read_exactly(fd, _HEADER.size))
    blob = _read_exactly(fd, length)
    os.close(fd)
    return blob, bool(header.get("compress")), header.get("env") or {}


def _child(model, policy, fd, request_fd, workdir, cgroup, before_jail=None) -> None:
    """The forked child. ``before_jail`` (a GPU child of the zygote) maps the
    GPU weights first; such a child stays in its parent's PID namespace (CUDA
    IPC does not cross one) and runs the code itself (CUDA cannot fork)."""
    code = 1
    try:
        os.setsid()  # its own process group: killed as one, and it cannot signal ours
        jail.die_with_parent()
        jail.join_cgroup(cgroup, policy.max_processes)
        jail.close_inherited_fds(keep=(fd, request_fd))
        try:
            if before_jail is not None:
                before_jail()
            jail.enter_namespaces(pid=before_jail is None)
        except (jail.JailError, OSError) as error:
            _send(fd, b"E", _refuse(error).encode())
            os._exit(0)
        if before_jail is not None:
            _run_jailed(model, policy, fd, request_fd, workdir, gpu=True)
        inner = os.fork()  # PID 1 of the new PID namespace runs the code
        if inner == 0:
            _run_jailed(model, policy, fd, request_fd, workdir)
        os.close(fd)
        os.close(request_fd)
        _, status = os.waitpid(inner, 0)
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            os.kill(os.getpid(), -code)  # die the same way, so the parent can say why
    except BaseException:  # noqa: BLE001 - nothing may escape a forked child
        code = 1
    finally:
        os._exit(code if code >= 0 else 1)


def _refuse(error: BaseException) -> str:
    return (
        "This worker cannot isolate untrusted code, so it did not run your job: "
        f"{error}. Ask the operator (the worker needs Linux namespaces; see docs/security.md)."
    )


def _run_jailed(model, policy, fd, request_fd, workdir, gpu: bool = False) -> None:
    """Lock in, take the one request, run it, send the result, exit.

    ``gpu``: this is the zygote's CUDA child itself (no inner fork, so it
    already leads its session), and RLIMIT_AS stays unset (the CUDA driver
    reserves far more virtual memory than any sane cap; GPU memory is bounded
    by the allocator fraction instead)."""
    from . import execute, results

    try:
        jail.die_with_parent()
        if not gpu:
            os.setsid()
        jail.private_mounts(workdir, policy.disk_bytes, policy.as_nobody)
        jail.set_limits(
            jail.Limits(memory_bytes=0 if gpu else policy.memory_bytes, cpu_seconds=int(policy.timeout_s) + 1,
                        file_bytes=policy.disk_bytes, processes=policy.max_processes)
        )
        jail.scrub_secrets(list(policy.secrets))
        layers = {"pids_cgroup": jail.in_pids_cgroup(), "landlock_abi": jail.landlock(workdir, policy.readable)}
        layers["user"] = jail.drop_privileges(to_nobody=policy.as_nobody)
        jail.no_new_privs()
        os.chdir(workdir)
        os.environ.update(HOME=workdir, TMPDIR=workdir)
        tempfile.tempdir = workdir
        _warm_up(model)
    except BaseException as error:  # noqa: BLE001
        _send(fd, b"E", _refuse(error).encode())
        os._exit(0)
    try:
        blob, compress, env = _receive_request(request_fd)
    except BaseException:  # noqa: BLE001 - discarded unused: the worker let go of it
        os._exit(0)
    try:
        marks = [time.perf_counter()]
        tracer = execute.deserialize(model, blob, compress, env)
        marks.append(time.perf_counter())
        saved = execute.run(tracer, lambda line: _send(fd, b"L", line.encode("utf-8", "replace")))
        marks.append(time.perf_counter())
        data = results.encode(saved, compress)
        marks.append(time.perf_counter())
        if policy.max_result_bytes and len(data) > policy.max_result_bytes:
            raise result_too_big(len(data), policy.max_result_bytes)
        child_ms = {name: round((b - a) * 1000, 1)
                    for name, a, b in zip(("deserialize_ms", "run_ms", "encode_ms"), marks, marks[1:])}
        _send(fd, b"M", json.dumps({"jail": layers, "child": child_ms}).encode())
        _send(fd, b"R", data)
    except BaseException as error:  # noqa: BLE001 - user code may raise anything, SystemExit included
        message = str(error) if isinstance(error, RequestError) else execute.format_user_error(error)
        try:
            _send(fd, b"E", message.encode("utf-8", "replace"))
        except BaseException:  # noqa: BLE001
            pass
    os._exit(0)


def _warm_up(model) -> None:
    """Pay, before the request arrives, what its first forward pass would:
    this process's own OpenMP thread pool (a fresh one: see ForkedChild), and
    the copy-on-write faults and lazy setup of one tiny forward pass through
    the model (a one-token input; best effort: a model that takes something
    else simply starts cold). No user data is involved."""
    import torch

    torch.ones(1 << 16).add_(1).sum()
    try:
        module = model._module
        device = next(module.parameters()).device
        with torch.no_grad():
            module(torch.zeros((1, 1), dtype=torch.long, device=device))
    except Exception:  # noqa: BLE001
        pass
