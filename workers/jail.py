"""Kernel-enforced confinement for a forked child that runs untrusted code.

Each layer is a Linux primitive that user code cannot undo from inside, with
or without C extensions (``ctypes`` included):

- namespaces: a private network (only a downed loopback: no connection to any
  service, loopback included), mount, PID (the worker and every other process
  are invisible and unsignalable), IPC and UTS namespace;
- a fresh ``tmpfs`` as the only writable place, mounted ``noexec`` (nothing
  written there can be executed or loaded as a library), with a size cap;
- Landlock: reads only of the interpreter, its packages, system libraries and
  the model cache; writes only in the tmpfs; TCP bind/connect refused; signals
  to processes outside the jail refused (where the kernel has them);
- rlimits: address space, CPU seconds, open files, processes, file size, no core;
- privileges: a root worker's child becomes ``nobody`` (or, where the
  interpreter is not readable to ``nobody``, stays uid 0 with every capability
  dropped for good), and ``no_new_privs`` so nothing can gain them back;
- no secrets: the environment is replaced by a short allowlist and the
  process's original environment block is zeroed, and known secret strings
  held by this process are overwritten in place.

``apply`` raises ``JailError`` if a required layer cannot be set up; the
caller then refuses to run the code rather than run it unconfined.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import signal
import sys
from dataclasses import dataclass

libc = ctypes.CDLL(None, use_errno=True)

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
PR_CAPBSET_DROP, PR_SET_SECUREBITS = 24, 28
# SECBIT_NOROOT, NO_SETUID_FIXUP, KEEP_CAPS_LOCKED, NO_CAP_AMBIENT_RAISE, each with its lock bit.
_SECURE_ALL = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80
_CAP_VERSION_3 = 0x20080522
NOBODY = 65534

# Landlock (linux/landlock.h)
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_RULE_PATH_BENEATH = 1
_FS_WRITE_ABI1 = (1 << 1) | (1 << 4) | (1 << 5) | sum(1 << b for b in range(6, 13))  # write, remove, make *
_FS_REFER, _FS_TRUNCATE = 1 << 13, 1 << 14
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1, 2

ENV_ALLOWLIST = ("PATH", "LANG", "LC_ALL", "TZ", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "OMP_NUM_THREADS")


class JailError(Exception):
    pass


@dataclass(frozen=True)
class Limits:
    memory_bytes: int  # address space on top of what the process already maps
    cpu_seconds: int
    open_files: int = 256
    processes: int = 256
    file_bytes: int = 256 * 1024 * 1024


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise JailError(f"{what} failed: {errno.errorcode.get(err, err)} ({os.strerror(err)})")
    return result


def enter_namespaces(pid: bool = True) -> None:
    """New mount, network, PID, IPC and UTS namespaces (user namespace if not root).

    The PID namespace applies to children: the caller must fork once more and
    run the code in that child, which is PID 1 of the new namespace. ``pid``
    False leaves it out (a CUDA child: IPC handles do not cross it).
    """
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | (CLONE_NEWPID if pid else 0)
    uid, gid = os.getuid(), os.getgid()
    if uid != 0:
        flags |= CLONE_NEWUSER
    _check(libc.unshare(flags), "unshare(namespaces)")
    if uid != 0:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"0 {uid} 1")
        _write("/proc/self/gid_map", f"0 {gid} 1")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def die_with_parent() -> None:
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def private_mounts(workdir: str, size_bytes: int, as_nobody: bool) -> None:
    """Mount changes stay in this namespace; ``workdir`` becomes a private tmpfs
    (noexec, nosuid, nodev, capped) owned by the user the code will run as; a
    fresh /proc shows only this PID namespace."""
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount(make-rprivate /)")
    owner = NOBODY if as_nobody and os.getuid() == 0 and _real_root() else 0
    options = f"size={max(size_bytes, 1 << 20)},mode=0700,uid={owner},gid={owner}".encode()
    _check(
        libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, options),
        f"mount(tmpfs {workdir})",
    )
    # Best effort: without it /proc still lists the host's processes, which the
    # dropped user can neither read nor signal.
    libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)


def _real_root() -> bool:
    """Root outside any user namespace (so dropping to nobody means something)."""
    try:
        with open("/proc/self/uid_map") as f:
            inside, outside, _ = f.read().split()[:3]
        return outside == "0"
    except (OSError, ValueError):
        return False


_PIDS_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")  # cgroup v1 pids controller, or v2


def pids_cgroup_path(name: str) -> str:
    """A fresh cgroup under a writable pids controller, or '' where none is."""
    for root in _PIDS_ROOTS:
        if not os.path.exists(os.path.join(root, "cgroup.procs")):
            continue
        if root == "/sys/fs/cgroup" and "pids" not in _read(os.path.join(root, "cgroup.controllers")):
            continue
        path = os.path.join(root, "ndif-jobs", name)
        try:
            os.makedirs(path, exist_ok=True)
            return path
        except OSError:
            continue
    return ""


def join_cgroup(path: str, max_pids: int) -> bool:
    """Put this process (and so everything it forks) in ``path`` capped at
    ``max_pids`` tasks. RLIMIT_NPROC does not bind uid 0, so a fork bomb in a
    child that keeps uid 0 is stopped here."""
    if not path:
        return False
    try:
        _write(os.path.join(path, "pids.max"), str(max_pids))
        _write(os.path.join(path, "cgroup.procs"), str(os.getpid()))
        return True
    except OSError:
        return False


def in_pids_cgroup() -> bool:
    return "/ndif-jobs/" in _read("/proc/self/cgroup")


def remove_cgroup(path: str, timeout_s: float = 10.0) -> None:
    """Kill whatever is left in the job's cgroup, then remove it."""
    import time

    if not path:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        for pid in _read(os.path.join(path, "cgroup.procs")).split():
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


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def set_limits(limits: Limits) -> None:
    vm = _vm_size_bytes()
    pairs = [
        (resource.RLIMIT_AS, vm + limits.memory_bytes),
        (resource.RLIMIT_CPU, limits.cpu_seconds),
        (resource.RLIMIT_NOFILE, limits.open_files),
        (resource.RLIMIT_NPROC, limits.processes),
        (resource.RLIMIT_FSIZE, limits.file_bytes),
        (resource.RLIMIT_CORE, 0),
    ]
    for which, value in pairs:
        if which == resource.RLIMIT_AS and not limits.memory_bytes:
            continue  # no cap asked for (a CUDA process: see isolate._run_jailed)
        resource.setrlimit(which, (value, value))


def _vm_size_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def close_inherited_fds(keep: tuple[int, ...]) -> None:
    """Only stdio (to /dev/null) and the fds in ``keep`` survive: inherited
    sockets to Redis or the object store would bypass the network namespace."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    for fd in _open_fds():
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _open_fds() -> list[int]:
    try:
        return sorted(int(name) for name in os.listdir("/proc/self/fd"))
    except OSError:
        return list(range(3, 1024))


def scrub_secrets(secrets: list[str]) -> None:
    """Leave the child no secret to read: a minimal environment, the original
    environment block (``/proc/self/environ``) zeroed, and each known secret
    string overwritten in this process's memory."""
    for value in list(os.environb.values()):
        if len(value) >= 8:
            _overwrite_bytes(value)
    kept = {k: os.environ[k] for k in ENV_ALLOWLIST if k in os.environ}
    os.environ.clear()
    os.environ.update(kept)
    _zero_environ_block()
    for secret in secrets:
        if isinstance(secret, str) and len(secret) >= 8 and secret.isascii():
            _overwrite_str(secret)


def _overwrite_bytes(value: bytes) -> None:
    offset = sys.getsizeof(b"") - 1
    ctypes.memset(id(value) + offset, ord("x"), len(value))


def _overwrite_str(value: str) -> None:
    offset = sys.getsizeof("") - 1  # compact ASCII data follows the header
    ctypes.memset(id(value) + offset, ord("x"), len(value))


def _zero_environ_block() -> None:
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # Fields 50 and 51 of stat (1-based) are env_start and env_end; after the
    # ")" split, field n sits at index n - 3.
    start, end = int(fields[47]), int(fields[48])
    if 0 < start < end:
        ctypes.memset(start, 0, end - start)


_FS_READ = (1 << 0) | (1 << 2) | (1 << 3)  # execute, read file, read dir
_FILE_RIGHTS = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 14)  # the rights a rule on a file may carry


def landlock(workdir: str, readable: list[str]) -> int:
    """Reads only under ``readable`` (the interpreter, its packages, system
    libraries), everything only under ``workdir``, no TCP, no signals out of the
    jail. Returns the Landlock ABI used (0: the kernel has none)."""
    abi = libc.syscall(_SYS_CREATE_RULESET, None, 0, 1)
    if abi < 1:
        return 0
    handled_fs = _FS_READ | _FS_WRITE_ABI1 | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    handled_net = (_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 else 0
    scoped = (_SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL) if abi >= 6 else 0
    attr = (ctypes.c_uint64 * 3)(handled_fs, handled_net, scoped)
    size = 8 * (3 if abi >= 6 else 2 if abi >= 4 else 1)
    ruleset = _check(libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), size, 0), "landlock_create_ruleset")
    try:
        _allow(ruleset, workdir, handled_fs)
        for path in readable:
            _allow(ruleset, path, _FS_READ)
        no_new_privs()
        _check(libc.syscall(_SYS_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    return abi


def _allow(ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # not on this host: nothing to allow
    try:
        if not os.path.isdir(path):
            rights &= _FILE_RIGHTS
        rule = (ctypes.c_uint8 * 12)()
        ctypes.memmove(rule, ctypes.byref(ctypes.c_uint64(rights)), 8)
        ctypes.memmove(ctypes.byref(rule, 8), ctypes.byref(ctypes.c_int32(fd)), 4)
        _check(libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), 0), f"landlock_add_rule({path})")
    finally:
        os.close(fd)


SYSTEM_READABLE = (
    "/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/opt",
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/passwd", "/etc/group",
    "/etc/nsswitch.conf", "/etc/ssl", "/etc/pki", "/etc/ca-certificates", "/etc/alternatives", "/etc/mime.types",
    "/proc", "/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/sys/devices/system/cpu", "/sys/fs/cgroup",
)


def readable_paths(extra: tuple = ()) -> list[str]:
    """What user code may read: the interpreter and its import path, system
    libraries and a few /etc files, and ``extra`` (the model cache). Not the
    worker's home, ``NDIF_HOME``, results, or any other user's files."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *SYSTEM_READABLE, *extra}
    paths.update(p for p in sys.path if p and os.path.isdir(p))
    return sorted(os.path.realpath(p) for p in paths if p)


def readable_by_others(path: str) -> bool:
    """Whether ``nobody`` could read ``path`` (every directory on the way searchable)."""
    import stat

    current = "/"
    for part in os.path.realpath(path).strip("/").split("/"):
        current = os.path.join(current, part)
        try:
            mode = os.stat(current).st_mode
        except OSError:
            return False
        if not mode & (stat.S_IXOTH if stat.S_ISDIR(mode) else stat.S_IROTH):
            return False
    return True


def no_new_privs() -> None:
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")


def drop_privileges(to_nobody: bool) -> str:
    """Give up root: become ``nobody`` when the interpreter is readable to it,
    else stay uid 0 with every capability gone for good (no bounding set, no
    root privileges regained on exec), fenced by Landlock. Returns who we are."""
    if os.getuid() != 0:
        return "unprivileged"
    if to_nobody and _real_root():
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
        return "nobody"
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    _check(libc.prctl(PR_SET_SECUREBITS, _SECURE_ALL, 0, 0, 0), "prctl(securebits)")
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset(none)")
    return "root-without-capabilities"
