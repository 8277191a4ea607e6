"""What runs inside an isolated child: jail itself, take one request, run it, answer in frames.

Why a module of its own: the child's side is the only code that runs next
to user code, and two parents start it, the exec'd zygote and the fork
server's zygote (both through ``workers.isolation.zygote``), while the worker's side
(``workers.isolation.parent``) only ever talks to it through pipes. :func:`main` is
the one entry point; :func:`kill_group` is how anyone ends a child (it leads
its own process group).

The child (:func:`main`) leaves its parent's session, joins its pids cgroup,
closes every inherited descriptor, enters its namespaces, and, inside them,
forks the process that runs the code (PID 1 of the new PID namespace; a GPU
child runs it itself, see :func:`main`). That process sets up every other
jail layer (``workers.isolation.jail``), refuses if one the operator requires is
missing, warms up, and only then reads the request (``workers.isolation.frames``),
deserializes and runs it, and sends back LOG lines, meta and the result, or
one error.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time

import torch

from workers import execute, results
from workers.execute import RequestError, result_too_big

from . import jail
from .frames import receive_request, send

try:  # import the seccomp binding once here, in the zygote, so no child pays for finding libseccomp
    jail.load_seccomp_binding()
except jail.JailError:
    pass  # each child finds the layer missing and says so (refused unless NDIF_JAIL_REQUIRE waives it)


def main(model, policy, fd, request_fd, workdir, cgroup, before_jail=None) -> None:
    """The forked child's entry point (never returns). ``fd``: its frames to
    the worker; ``request_fd``: the request from the worker; ``policy``: an
    ``parent.IsolationPolicy``. ``before_jail`` (a GPU child of the zygote) maps the
    GPU weights first; such a child stays in its parent's PID namespace (CUDA
    IPC does not cross one) and runs the code itself (CUDA cannot fork)."""
    code = 1
    try:
        os.setsid()  # its own process group: killed as one, and it cannot signal ours
        jail.die_with_parent()
        # Which layers this child gets, and why any is missing: checked against
        # NDIF_JAIL_REQUIRE once all are set up (_run_jailed).
        layers = jail.Layers(policy.jail_disabled)
        layers.attempt("pids_cgroup", lambda: jail.join_cgroup(cgroup, policy.max_processes))
        jail.close_inherited_fds(keep=(fd, request_fd))
        try:
            if before_jail is not None:
                before_jail()
            # The host's UNIX sockets, read while this is still the host's network namespace.
            sockets = layers.attempt("unix_sockets", jail.listening_unix_paths)
            jail.enter_namespaces(pid=before_jail is None)
            layers.got["namespaces"] = True
        except (jail.JailError, OSError) as error:
            send(fd, b"E", _refuse(error).encode())
            os._exit(0)
        if before_jail is not None:
            _run_jailed(model, policy, fd, request_fd, workdir, layers, sockets, gpu=True)
        inner = os.fork()  # PID 1 of the new PID namespace runs the code
        if inner == 0:
            _run_jailed(model, policy, fd, request_fd, workdir, layers, sockets)
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


def kill_group(pid: int) -> None:
    """SIGKILL a child's process group (it leads one: :func:`main`; its zygote reaps it)."""
    if pid <= 0:  # no child yet: killpg(0) would be the caller's own group
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _refuse(error: BaseException) -> str:
    return (
        "This worker cannot isolate untrusted code, so it did not run your job: "
        f"{error}. Ask the operator (the worker needs Linux namespaces; see docs/security.md)."
    )


def _refuse_missing(layers: "jail.Layers", missing: list) -> str:
    """The ERROR of a job refused because its jail lacks a required layer."""
    return (
        "This worker cannot isolate untrusted code as its operator requires, so it did not run your job: "
        f"missing jail layer(s): {layers.describe(missing)}. Ask the operator (the host lacks a layer that "
        "NDIF_JAIL_REQUIRE requires; `ndif-celery doctor` lists them; see docs/security.md)."
    )


def _run_jailed(model, policy, fd, request_fd, workdir, layers: "jail.Layers", sockets,
                gpu: bool = False) -> None:
    """Lock in, take the one request, run it, send the result, exit.

    Every jail layer is set up (``jail.lock_down``); if one the operator
    requires is missing, the child refuses before it reads the request.

    ``gpu``: this is the zygote's CUDA child itself (no inner fork, so it
    already leads its session), and RLIMIT_AS stays unset (the CUDA driver
    reserves far more virtual memory than any sane cap; GPU memory is bounded
    by the allocator fraction instead)."""
    try:
        jail.die_with_parent()
        if not gpu:
            os.setsid()
        jail.scrub_secrets(list(policy.secrets))
        limits = jail.Limits(memory_bytes=0 if gpu else policy.memory_bytes, cpu_seconds=int(policy.timeout_s) + 1,
                             file_bytes=policy.disk_bytes, processes=policy.max_processes)
        layers.user = jail.lock_down(layers, workdir, policy.readable, limits, policy.disk_bytes, policy.as_nobody,
                                     sockets, hidden=policy.hidden, pid_namespace=not gpu)
        missing = layers.missing(policy.jail_waived)
        if missing:
            send(fd, b"E", _refuse_missing(layers, missing).encode())
            os._exit(0)
        os.chdir(workdir)
        os.environ.update(HOME=workdir, TMPDIR=workdir)
        tempfile.tempdir = workdir
        _warm_up(model)
    except BaseException as error:  # noqa: BLE001
        send(fd, b"E", _refuse(error).encode())
        os._exit(0)
    try:
        blob, compress, env = receive_request(request_fd)
    except BaseException:  # noqa: BLE001 - discarded unused: the worker let go of it
        os._exit(0)
    try:
        marks = [time.perf_counter()]
        tracer = execute.deserialize(model, blob, compress, env)
        marks.append(time.perf_counter())
        saved = execute.run(tracer, lambda line: send(fd, b"L", line.encode("utf-8", "replace")))
        marks.append(time.perf_counter())
        data = results.encode(saved, compress)
        marks.append(time.perf_counter())
        if policy.max_result_bytes and len(data) > policy.max_result_bytes:
            raise result_too_big(len(data), policy.max_result_bytes)
        child_ms = {name: round((b - a) * 1000, 1)
                    for name, a, b in zip(("deserialize_ms", "run_ms", "encode_ms"), marks, marks[1:])}
        send(fd, b"M", json.dumps({"jail": layers.meta(policy.jail_waived), "child": child_ms}).encode())
        send(fd, b"R", data)
    except BaseException as error:  # noqa: BLE001 - user code may raise anything, SystemExit included
        message = str(error) if isinstance(error, RequestError) else execute.format_user_error(error)
        try:
            send(fd, b"E", message.encode("utf-8", "replace"))
        except BaseException:  # noqa: BLE001
            pass
    os._exit(0)


def _warm_up(model) -> None:
    """Pay, before the request arrives, what its first forward pass would:
    this process's own OpenMP thread pool (a fresh one: no thread of its
    zygote ever computed), and
    the copy-on-write faults and lazy setup of one tiny forward pass through
    the model (a one-token input; best effort: a model that takes something
    else simply starts cold). No user data is involved."""
    torch.ones(1 << 16).add_(1).sum()
    try:
        module = model._module
        device = next(module.parameters()).device
        with torch.no_grad():
            module(torch.zeros((1, 1), dtype=torch.long, device=device))
    except Exception:  # noqa: BLE001
        pass
