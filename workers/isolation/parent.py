"""Untrusted requests run in a fresh, jailed child forked per request.

The worker keeps the model resident; the child is forked by the model's
zygote (``workers.isolation.zygote``), never by the worker itself, so it holds no
secret and no residue of any job the worker ran. It shares the weights
(copy-on-write on CPU: an in-place edit copies the page into the child and
dies with it), deserializes and runs the user's block inside the jail
(``workers.isolation.jail``) and hands back only bytes: LOG lines, the result blob, a
JSON error. The worker never unpickles anything the child sends. At the
deadline the child's whole process group is killed.

The fork and the jail are paid ahead of time: after an untrusted job the
worker prepares a :class:`Spare` (forked, jailed, OpenMP pool started) that
waits for the next request on the same model; a request with no fitting spare
forks one on the spot. Either way each request gets a child of its own.

This module is the worker's side; what runs in the child is
``workers.isolation.child`` (its entry point ``child.main``, started by the zygote),
and the frames both sides send are ``workers.isolation.frames``.

The child runs user code, so everything it sends is hostile until checked:
each frame kind has a size limit (``frames.FRAME_LIMITS``; only ``R`` may be as
large as the result limit), read from its header before its body is
buffered; a header over its kind's limit, or of an unknown kind, kills the
child and ends the job with an ERROR. Meta passes only the keys the worker
expects, with bounded values (``child_meta``). Every wait on a child (the
request write, its frames, its exit, its reaping) has a deadline.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import select
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ndif_celery import messages
from ndif_celery import output_bounds
from workers.execute import RequestError, result_too_big

from . import jail
from .frames import FRAME_LIMITS, FRAME_NAMES, HEADER, request_frames

#: How long reaping a SIGKILLed child may take before the worker stops waiting for it.
REAP_TIMEOUT_S = 10.0
#: The slices every wait on a child is cut into, so ``ndif-celery kill`` (an
#: exception raised in the job's thread) lands within one of them.
_SLICE_S = 0.1

log = logging.getLogger("ndif_celery.worker")


@dataclass
class ChildOutcome:
    data: Any  # bytes-like
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class IsolationPolicy:
    timeout_s: float
    memory_bytes: int
    disk_bytes: int
    secrets: tuple = ()
    max_result_bytes: int = 0
    readable: tuple = ()  # paths user code may read (see jail.readable_paths)
    max_processes: int = 256
    as_nobody: bool = True
    jail_waived: tuple = ()  # layers that may be absent (NDIF_JAIL_REQUIRE); every other one is required
    jail_disabled: tuple = ()  # layers not even tried (NDIF_JAIL_DISABLE)
    cgroup_root: str = ""  # NDIF_JAIL_CGROUP_ROOT ("" = the usual mount points)
    hidden: tuple = ()  # directories masked in the child's mounts (NDIF_HOME: its sockets, its files)


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

    def __init__(self, model: Any, policy: IsolationPolicy, zygote: Any) -> None:
        if zygote is None:  # the worker itself is never the parent: it holds secrets and earlier jobs
            raise ValueError("an isolated child is forked by its model's zygote")
        self.model_id = id(model)
        self.zygote = zygote
        self.policy = policy
        self.workdir = tempfile.mkdtemp(prefix="ndif-job-")
        self.cgroup = ("" if "pids_cgroup" in policy.jail_disabled
                       else jail.pids_cgroup_path(os.path.basename(self.workdir), policy.cgroup_root))
        out_read, out_write = os.pipe()  # child -> worker: frames
        in_read, in_write = os.pipe()  # worker -> child: the request
        started = time.perf_counter()
        try:
            self.forked = zygote.fork(out_write, in_read, policy, self.workdir, self.cgroup)
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

    def fits(self, model: Any, policy: IsolationPolicy, zygote: Any) -> bool:
        return (self.model_id == id(model) and self.policy == policy and self.zygote is zygote
                and self.forked.status is None)

    def run(self, blob: bytes, compress: bool, env: dict, log: Callable[[str], None],
            deadline: float | None = None) -> ChildOutcome:
        """Hand the request to the child and collect what it sends back, all by
        ``deadline`` (``time.monotonic()``; default: the policy's timeout from now)."""
        if deadline is None:
            deadline = time.monotonic() + self.policy.timeout_s
        try:
            os.set_blocking(self.in_fd, False)
            for data in request_frames(blob, compress, env):
                _write_until(self.forked, self.in_fd, data, deadline, self.policy)
        except BrokenPipeError:
            pass  # the child died before reading (its jail failed): _collect says why
        finally:
            os.close(self.in_fd)
            self.in_fd = -1
        return _collect(self.forked, self.out_fd, self.policy, log, deadline)

    def close(self) -> None:
        self.forked.kill()
        if self.forked.wait(REAP_TIMEOUT_S) is None:  # bounded: this runs on a reaper thread, or at eviction
            log.warning("isolated process %d did not exit %g s after SIGKILL; not waiting for it",
                        self.forked.pid, REAP_TIMEOUT_S)
        for fd in (self.in_fd, self.out_fd):
            if fd >= 0:
                os.close(fd)
        self.in_fd = self.out_fd = -1
        shutil.rmtree(self.workdir, ignore_errors=True)
        jail.remove_cgroup(self.cgroup)


_spare: "Spare | None" = None
_spare_lock = threading.Lock()


def _take_spare(model: Any, policy: IsolationPolicy, zygote: Any) -> "Spare | None":
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    if spare is not None and not spare.fits(model, policy, zygote):
        spare.close()
        return None
    return spare


def prepare(model: Any, policy: IsolationPolicy, zygote: Any) -> None:
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


def discard(zygote: Any = None) -> None:
    """Kill the spare (its model is being evicted, or the worker stops).

    With ``zygote``, only a spare that zygote forked (a resident model
    letting go of what it holds: ``resident.Resident.close``)."""
    global _spare
    with _spare_lock:
        if zygote is not None and (_spare is None or _spare.zygote is not zygote):
            return
        spare, _spare = _spare, None
    if spare is not None:
        spare.close()


def run(model: Any, blob: bytes, compress: bool, env: dict, policy: IsolationPolicy, log: Callable[[str], None],
        zygote: Any) -> ChildOutcome:
    """Run one request in a jailed child (the spare if one fits, else a new one)
    forked by ``zygote``; return its result bytes or raise RequestError."""
    started = time.perf_counter()
    deadline = time.monotonic() + policy.timeout_s  # the job's whole isolated life, fork included
    spare = _take_spare(model, policy, zygote)
    warm = spare is not None
    if spare is None:
        spare = Spare(model, policy, zygote)
    try:
        outcome = spare.run(blob, compress, env, log, deadline)
    finally:
        # Killing, reaping and cleaning up after the child is nobody's wait
        # (except the keyed weight check's: ``wait_reaped``).
        global _reaping
        reaper = threading.Thread(target=spare.close, name="ndif-reap", daemon=True)
        reaper.start()
        _reaping = (reaper, spare)
    outcome.meta["isolated_ms"] = round((time.perf_counter() - started) * 1000, 1)
    outcome.meta["spare"] = warm
    return outcome


_reaping: "tuple | None" = None  # (the thread killing and reaping the last job's child, its Spare)


def wait_reaped(timeout_s: float) -> bool:
    """Wait until the last job's child is dead and reaped (a GPU child's
    mapping of the weights dies with it); False if it is not within
    ``timeout_s`` (or its reaper gave up on it). The weight check after an
    untrusted job waits for this, so a child that sent its answer cannot
    write after the check."""
    if _reaping is None:
        return True
    reaper, spare = _reaping
    reaper.join(timeout_s)
    return not reaper.is_alive() and spare.forked.status is not None


def _collect(forked: Any, fd: int, policy: IsolationPolicy, log: Callable[[str], None],
             deadline: float | None = None) -> ChildOutcome:
    """Read the child's frames until its result or its error, by ``deadline``.

    Each frame's header is checked before its body is buffered (``_check``),
    so the worker never holds more than one frame within its kind's limit
    plus one read. A child that closes its pipe without a last word is waited
    for only until the deadline (``_wait_for``)."""
    if deadline is None:
        deadline = time.monotonic() + policy.timeout_s
    buffer = bytearray()
    result, error, meta = None, None, {}
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timed_out(forked, policy)
        # Short waits, so a cancel (an exception raised in this thread) lands promptly.
        ready, _, _ = select.select([fd], [], [], min(remaining, _SLICE_S))
        if not ready:
            continue
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        buffer += chunk
        while len(buffer) >= HEADER.size:
            kind, length = HEADER.unpack_from(buffer)
            _check(forked, kind, length, policy)
            if len(buffer) < HEADER.size + length:
                break
            if kind == b"R":  # the last frame: keep it where it is, no copy
                result = memoryview(buffer)[HEADER.size : HEADER.size + length]
                break
            body = bytes(buffer[HEADER.size : HEADER.size + length])
            del buffer[: HEADER.size + length]
            if kind == b"L":
                log(body.decode("utf-8", "replace"))
            elif kind == b"E":
                error = body.decode("utf-8", "replace")
                break
            elif kind == b"M":
                meta.update(child_meta(body))
        if result is not None or error is not None:
            break  # the child's last word: no need to wait for it to exit
    if error is not None:
        raise RequestError(error)
    if result is None:
        raise RequestError(_died(_wait_for(forked, deadline, policy), policy))
    return ChildOutcome(result, meta)


def _check(forked, kind: bytes, length: int, policy: IsolationPolicy) -> None:
    """Refuse a frame header the worker's own child code never sends: an
    unknown kind, or a body over its kind's limit. The child is killed."""
    if kind == b"R":
        if policy.max_result_bytes and length > policy.max_result_bytes:
            forked.kill()
            raise result_too_big(length, policy.max_result_bytes)
        return
    limit = FRAME_LIMITS.get(kind)
    if limit is None:
        forked.kill()
        raise RequestError(f"Your job's isolated process sent a frame of unknown kind {kind!r} on its result pipe, "
                           f"so it was stopped.")
    if length > limit:
        forked.kill()
        raise RequestError(
            f"Your job's isolated process announced {output_bounds.human_bytes(length)} in one {FRAME_NAMES[kind]} frame, "
            f"over the {output_bounds.human_bytes(limit)} such a frame may carry, so it was stopped.")


def _timed_out(forked, policy: IsolationPolicy) -> RequestError:
    forked.kill()
    return RequestError(messages.timed_out(policy.timeout_s), kind="timeout")


def _wait_for(forked, deadline: float, policy: IsolationPolicy) -> int:
    """The child's exit status, waited for in short slices until ``deadline``;
    at the deadline its process group is killed and the job times out. (A
    child that closed its pipe and sleeps must not hold the worker.)"""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timed_out(forked, policy)
        status = forked.wait(min(remaining, _SLICE_S))
        if status is not None:
            return status


def _write_until(forked, fd: int, data, deadline: float, policy: IsolationPolicy) -> None:
    """Write all of ``data`` to the child's (non-blocking) request pipe by
    ``deadline``: a child that stops reading cannot block the worker."""
    view = memoryview(data)
    while view:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timed_out(forked, policy)
        _, writable, _ = select.select([], [fd], [], min(remaining, _SLICE_S))
        if not writable:
            continue
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            continue
        view = view[written:]


# What a child's meta frame may carry into the job's meta (and from there the
# status, the ledger and metrics): its jail layers and its own timings. Any
# other key (``worker``, ``job_id``, ``result_bytes``...) is the worker's to
# set, and is dropped.
_LAYER_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")
_MAX_LAYERS = 32
_CHILD_TIMINGS = ("deserialize_ms", "run_ms", "encode_ms")
#: Every key a ChildOutcome's meta may hold (the child's, then run's own).
OUTCOME_META = ("jail", "child", "isolated_ms", "spare")


def child_meta(body: bytes) -> dict:
    """The expected keys of a child's meta frame, with sane values; the rest dropped."""
    try:
        raw = json.loads(body)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(raw, dict):
        return {}
    meta = {}
    layers = raw.get("jail")
    if isinstance(layers, dict):
        meta["jail"] = {name: value for name, value in list(layers.items())[:_MAX_LAYERS]
                        if isinstance(name, str) and _LAYER_NAME.fullmatch(name) and _scalar(value)}
    timings = raw.get("child")
    if isinstance(timings, dict):
        meta["child"] = {name: round(float(timings[name]), 1) for name in _CHILD_TIMINGS
                         if _number(timings.get(name)) and 0 <= timings[name] < 1e9}
    return meta


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _scalar(value) -> bool:
    return value is None or isinstance(value, bool) or (_number(value) and abs(value) < 1e15) or (
        isinstance(value, str) and len(value) <= 200)


def _died(status: int, policy: IsolationPolicy) -> str:
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        hint = {
            "SIGXCPU": f" (it used its {policy.timeout_s:g} s of CPU time)",
            "SIGKILL": " (killed: over a limit, or it tried to take down its own jail)",
            "SIGSEGV": " (a crash, possibly from running out of its memory allowance)",
        }.get(sig, "")
        return f"Your job's isolated process died of {sig}{hint} before it returned a result."
    return f"Your job's isolated process exited (status {os.WEXITSTATUS(status)}) before it returned a result."
