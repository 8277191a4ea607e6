"""Kernel-enforced confinement for a forked child that runs untrusted code.

Each layer is a Linux primitive that user code cannot undo from inside, with
or without C extensions (``ctypes`` included):

- namespaces: a private network (only a downed loopback: no connection to any
  service, loopback included), mount, PID (the worker and every other process
  are invisible and unsignalable), IPC and UTS namespace;
- a fresh ``tmpfs`` as the only writable place, mounted ``noexec`` (nothing
  written there can be executed or loaded as a library), with a size cap;
- Landlock: reads only of the interpreter, its packages, system libraries and
  the served model's own files in the cache; writes only in the tmpfs; TCP bind/connect refused; signals
  to processes outside the jail refused (where the kernel has them);
- rlimits: address space, CPU seconds, open files, processes, file size, no core;
- privileges: a root worker's child becomes ``nobody`` (or, where the
  interpreter is not readable to ``nobody``, stays uid 0 with every capability
  dropped for good), and ``no_new_privs`` so nothing can gain them back;
- no secrets: the environment is replaced by a short allowlist and the
  process's original environment block is zeroed, and known secret strings
  held by this process are overwritten in place.

- UNIX sockets: every listening pathname socket of the host is hidden from
  the child's mount namespace (empty read-only mounts over their directories,
  ``/dev/null`` over the socket file where the directory must stay visible);
- seccomp: a system-call filter (``libseccomp`` through ``pyseccomp``) refuses
  what no experiment needs (io_uring, ptrace, bpf, mount, unshare, keyctl...),
  and ``socket()`` of every family (the allow-list is empty).

Each layer has a name (:data:`LAYERS`). :class:`Layers` records which ones a
child got and why any is missing; the child refuses to run user code when a
layer is missing that the operator has not waived (``NDIF_JAIL_REQUIRE``), so
a host that lacks one never runs untrusted code in a weaker jail in silence.
:func:`probe` sets the same layers up in a throwaway child (``ndif-celery
doctor``).

The layers live in one module each, by kind, and this package's
``__init__`` is the whole jail, the one face its callers use
(``workers.isolation.child``, ``workers.isolation.parent``, ``workers.isolation.zygote``,
``workers.isolation.forkserver``, ``ndif-celery doctor``):

- ``kernel``: libc, :class:`JailError`, the flag values, checked calls;
- ``namespaces``: the namespaces, the private tmpfs, /proc;
- ``sockets``: the host's UNIX sockets masked;
- ``cgroups``: the pids cgroup;
- ``process``: rlimits, privileges, inherited descriptors, secrets;
- ``access``: Landlock and the read list;
- ``seccomp``: the system-call filter;
- here: :class:`Layers` (which a child got), :func:`lock_down` (all of
  them, in order) and :func:`probe`.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import sys
import tempfile
import time

from ndif_celery.policy.jail_layers import LAYERS, WAIVABLE, parse_disable, parse_require  # noqa: F401

# The public face of the jail: every layer's entry points, under ``jail.``.
from .access import SYSTEM_READABLE, covering, landlock, readable_by_others, readable_paths  # noqa: F401
from .cgroups import in_pids_cgroup, join_cgroup, pids_cgroup_path, remove_cgroup  # noqa: F401
from .kernel import NOBODY, JailError  # noqa: F401
from .namespaces import die_with_parent, enter_namespaces, fresh_proc, make_private, private_mounts, proc_hidepid  # noqa: F401
from .process import (  # noqa: F401
    ENV_ALLOWLIST,
    Limits,
    close_inherited_fds,
    drop_privileges,
    no_new_privs,
    open_fds,
    scrub_secrets,
    set_limits,
)
from .seccomp import SECCOMP_DENIED, load_seccomp_binding, seccomp_filter  # noqa: F401
from .sockets import ALWAYS_HIDDEN, hide_unix_sockets, listening_unix_paths, seal_masks  # noqa: F401


class Layers:
    """Which layers this child got, and why any is missing."""

    def __init__(self, disabled=()) -> None:
        self.disabled = set(disabled)
        self.got: dict = {}
        self.why: dict = {}
        self.landlock_abi = 0
        self.user = ""

    def meta(self, waived=()) -> dict:
        """What a job's ``meta.jail`` reports (flat scalars): each layer and
        whether it was in place, who the code ran as, the Landlock ABI, and the
        layers the operator waived (comma-separated)."""
        return {**{name: bool(self.got.get(name)) for name in LAYERS}, "user": self.user,
                "landlock_abi": self.landlock_abi, "waived": ",".join(sorted(waived))}

    def attempt(self, name: str, setup):
        """Run ``setup`` for layer ``name``; record the outcome; return its value (None if missing)."""
        if name in self.disabled:
            self.got[name], self.why[name] = False, "disabled by NDIF_JAIL_DISABLE"
            return None
        try:
            value = setup()
        except (JailError, OSError, RuntimeError, ImportError, ValueError) as error:
            self.got[name], self.why[name] = False, str(error)[:200] or type(error).__name__
            return None
        self.got[name] = True
        return value

    def missing(self, waived=()) -> list:
        """Layers that are not in place and not waived (a layer never tried counts as missing)."""
        return [name for name in LAYERS if not self.got.get(name) and name not in waived]

    def describe(self, names) -> str:
        return "; ".join(f"{name} ({self.why.get(name, 'not set up')})" for name in names)


def lock_down(layers: Layers, workdir: str, readable, limits: Limits, disk_bytes: int, as_nobody: bool,
              sockets, hidden=(), pid_namespace: bool = True) -> str:
    """Every layer after the namespaces, in order, recorded in ``layers``.
    A waivable layer that fails is recorded missing; a core one raises
    JailError (nothing may run without it). Returns who the process now is."""
    if "seccomp" not in layers.disabled:
        layers.attempt("seccomp", load_seccomp_binding)  # now: it cannot be found once /tmp is masked
    make_private()
    masks = None
    if sockets is not None:  # None: the list could not be read, or the layer is disabled (already recorded)
        masks = layers.attempt("unix_sockets", lambda: hide_unix_sockets(sockets, readable, workdir, hidden))
    private_mounts(workdir, disk_bytes, as_nobody)
    layers.got["tmpfs"] = True
    if masks is not None:
        layers.attempt("unix_sockets", lambda: seal_masks(masks))
    # Outside a PID namespace (a GPU child), hidepid at least hides other users' processes.
    layers.attempt("proc", fresh_proc if pid_namespace else proc_hidepid)
    try:
        set_limits(limits)
    except (OSError, ValueError) as error:
        raise JailError(f"setrlimit failed: {error}") from None
    layers.got["rlimits"] = True
    net, scope = "landlock_net" not in layers.disabled, "landlock_scope" not in layers.disabled
    abi = layers.attempt("landlock", lambda: landlock(workdir, list(readable), net=net, scope=scope)) or 0
    for name, needed in (("landlock_net", 4), ("landlock_scope", 6)):
        if name in layers.disabled:
            layers.got[name], layers.why[name] = False, "disabled by NDIF_JAIL_DISABLE"
        elif not abi:
            layers.got[name], layers.why[name] = False, "no Landlock"
        else:
            layers.got[name] = abi >= needed
            if abi < needed:
                layers.why[name] = f"the kernel's Landlock ABI is {abi}, this needs {needed}"
    layers.landlock_abi = abi
    user = drop_privileges(to_nobody=as_nobody)
    layers.got["drop_root"] = True
    no_new_privs()
    layers.got["no_new_privs"] = True
    if layers.got.get("seccomp", True):
        layers.attempt("seccomp", seccomp_filter)  # last: nothing after it needs a refused call
    return user


def probe(readable=None, cgroup_root: str = "", disabled=(), timeout_s: float = 30.0) -> dict:
    """Set every layer up in a throwaway child, with the code a job's child
    uses, and report ``{layer: {"ok": bool, "why": str}}`` (``ndif-celery
    doctor``). Runs no user code; the child exits at once."""
    readable = readable_paths() if readable is None else readable
    try:
        load_seccomp_binding()  # once here, not in the child
    except JailError:
        pass  # the child finds it missing and says so
    workdir = tempfile.mkdtemp(prefix="ndif-job-probe-")
    cgroup = "" if "pids_cgroup" in disabled else pids_cgroup_path(os.path.basename(workdir), cgroup_root)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read_end)
            os.setsid()
            _probe_child(write_end, workdir, cgroup, readable, disabled)
        finally:
            os._exit(0)
    os.close(write_end)
    data, deadline = b"", time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([read_end], [], [], 0.2)
            if ready:
                chunk = os.read(read_end, 65536)
                if not chunk:
                    break
                data += chunk
    finally:
        os.close(read_end)
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        os.waitpid(pid, 0)
        remove_cgroup(cgroup)
        shutil.rmtree(workdir, ignore_errors=True)
    try:
        report = json.loads(data)
    except ValueError:
        report = {"error": "the probe child sent no report"}
    return report


def _probe_child(fd: int, workdir: str, cgroup: str, readable, disabled) -> None:
    layers = Layers(disabled)
    error = ""
    layers.attempt("pids_cgroup", lambda: join_cgroup(cgroup, 64))
    try:
        sockets = layers.attempt("unix_sockets", listening_unix_paths)
        enter_namespaces(pid=True)
        layers.got["namespaces"] = True
        inner = os.fork()
        if inner == 0:
            try:
                layers.user = lock_down(layers, workdir, readable, Limits(memory_bytes=1 << 30, cpu_seconds=10),
                                        1 << 20, readable_by_others(sys.base_prefix), sockets)
            except JailError as failure:
                error = str(failure)
            os.write(fd, json.dumps(_report(layers, error)).encode())
            os._exit(0)
        os.waitpid(inner, 0)
    except (JailError, OSError) as failure:
        layers.why.setdefault("namespaces", str(failure)[:200])
        os.write(fd, json.dumps(_report(layers, str(failure))).encode())


def _report(layers: Layers, error: str) -> dict:
    report = {name: {"ok": bool(layers.got.get(name)), "why": layers.why.get(name, "" if layers.got.get(name)
                                                                              else error or "not reached")}
              for name in LAYERS}
    report["landlock_abi"] = layers.landlock_abi
    report["user"] = layers.user
    return report
