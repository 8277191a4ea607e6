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

- UNIX sockets: every listening pathname socket of the host is hidden from
  the child's mount namespace (empty read-only mounts over their directories,
  ``/dev/null`` over the socket file where the directory must stay visible);
- seccomp: a system-call filter (``libseccomp`` through ``pyseccomp``) refuses
  what no experiment needs (io_uring, ptrace, bpf, mount, unshare, keyctl...),
  and ``socket(AF_UNIX)``.

Each layer has a name (:data:`LAYERS`). :class:`Layers` records which ones a
child got and why any is missing; the child refuses to run user code when a
layer is missing that the operator has not waived (``NDIF_JAIL_REQUIRE``), so
a host that lacks one never runs untrusted code in a weaker jail in silence.
:func:`probe` sets the same layers up in a throwaway child (``ndif-celery
doctor``).
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
_FS_RESOLVE_UNIX = 1 << 16  # ABI 9: connect()/sendmsg() to a pathname UNIX socket
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1, 2

ENV_ALLOWLIST = ("PATH", "LANG", "LC_ALL", "TZ", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "OMP_NUM_THREADS")


class JailError(Exception):
    pass


from ndif_celery.jail_layers import LAYERS, WAIVABLE, parse_disable, parse_require  # noqa: E402,F401


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


def make_private() -> None:
    """Mount changes from here on stay in this mount namespace (never reach the host's)."""
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount(make-rprivate /)")


def private_mounts(workdir: str, size_bytes: int, as_nobody: bool) -> None:
    """``workdir`` becomes a private tmpfs (noexec, nosuid, nodev, capped)
    owned by the user the code will run as. Call :func:`make_private` first."""
    owner = NOBODY if as_nobody and os.getuid() == 0 and _real_root() else 0
    os.makedirs(workdir, exist_ok=True)  # again, where a mask hid it (see hide_unix_sockets)
    options = f"size={max(size_bytes, 1 << 20)},mode=0700,uid={owner},gid={owner}".encode()
    _check(
        libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, options),
        f"mount(tmpfs {workdir})",
    )


def fresh_proc() -> None:
    """A /proc that shows only this PID namespace (the caller is its PID 1 or
    a descendant). Without it /proc lists every process of the host."""
    _check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mount(proc /proc)")


# --- UNIX sockets ------------------------------------------------------------------
# A network namespace cuts every TCP/IP and abstract UNIX socket, but a
# pathname UNIX socket is reached through the file system, which the child
# shares. So the child's mount namespace hides them.

ALWAYS_HIDDEN = ("/run", "/var/run", "/tmp", "/var/tmp")  # where sockets live, and nothing a job reads
MS_RDONLY, MS_REMOUNT, MS_BIND = 1, 32, 4096


def listening_unix_paths() -> list:
    """Pathname UNIX sockets bound on this host (its network namespace), from
    /proc/net/unix. Read it before leaving the namespace: the file is per
    network namespace, and the child's new one has none."""
    paths = set()
    try:
        with open("/proc/net/unix", "rb") as f:
            next(f, None)
            for line in f:
                fields = line.split(None, 7)
                if len(fields) == 8 and fields[7].startswith(b"/"):
                    paths.add(os.fsdecode(fields[7].rstrip(b"\n")))
    except OSError as error:
        raise JailError(f"reading /proc/net/unix failed: {error.strerror}") from None
    return sorted(paths)


def hide_unix_sockets(sockets, readable, workdir: str, hidden=()) -> list:
    """Make every socket in ``sockets`` unreachable in this mount namespace.

    Each directory that holds one (and ``ALWAYS_HIDDEN`` and ``hidden``) gets
    an empty tmpfs on top, unless a ``readable`` path (what the job must read)
    lies in, under or above it: then each socket file there gets ``/dev/null``
    bound over it (connecting fails: not a socket). The job's ``workdir`` may
    lie under a mask: :func:`private_mounts` makes its mount point again inside,
    and :func:`seal_masks` then makes the masks read-only. Returns the masks."""
    readable = [os.path.realpath(p) for p in readable]

    def maskable(directory: str) -> bool:
        return directory != "/" and not any(_within(p, directory) or _within(directory, p) for p in readable) \
            and not _within(directory, workdir)

    directories = {os.path.realpath(d) for d in (*ALWAYS_HIDDEN, *hidden) if d and os.path.isdir(d)}
    singles = []
    for path in sockets:
        directory = os.path.realpath(os.path.dirname(path))
        if maskable(directory):
            directories.add(directory)
        else:
            singles.append(path)
    masks = []
    for directory in sorted(d for d in directories if maskable(d)):
        if any(_within(directory, m) for m in masks):
            continue  # already under a mask
        _check(libc.mount(b"tmpfs", directory.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                          b"size=64k,mode=0755"), f"mount(tmpfs over {directory})")
        masks.append(directory)
    for path in singles:
        if libc.mount(b"/dev/null", path.encode(), None, MS_BIND, None) < 0:
            if ctypes.get_errno() not in (errno.ENOENT, errno.ENOTDIR):  # gone since listed: nothing to reach
                _check(-1, f"mount(/dev/null over {path})")
    return masks


def seal_masks(masks) -> None:
    """Once the workdir is mounted inside them, make the directory masks read-only."""
    for directory in masks:
        if os.path.isdir(directory):
            _check(libc.mount(None, directory.encode(), None,
                              MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, None),
                   f"remount(read-only {directory})")


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _real_root() -> bool:
    """Root outside any user namespace (so dropping to nobody means something)."""
    try:
        with open("/proc/self/uid_map") as f:
            inside, outside, _ = f.read().split()[:3]
        return outside == "0"
    except (OSError, ValueError):
        return False


_PIDS_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")  # cgroup v1 pids controller, or v2


def pids_cgroup_path(name: str, root: str = "") -> str:
    """A fresh cgroup under a writable pids controller (``root``, else the
    usual mount points: ``NDIF_JAIL_CGROUP_ROOT``), or '' where none is."""
    for root in ((root,) if root else _PIDS_ROOTS):
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


def join_cgroup(path: str, max_pids: int) -> None:
    """Put this process (and so everything it forks) in ``path`` capped at
    ``max_pids`` tasks. RLIMIT_NPROC does not bind uid 0, so a fork bomb in a
    child that keeps uid 0 is stopped here. Raises JailError if it is not so."""
    if not path:
        raise JailError("no writable pids cgroup controller (see NDIF_JAIL_CGROUP_ROOT)")
    try:
        _write(os.path.join(path, "pids.max"), str(max_pids))
        _write(os.path.join(path, "cgroup.procs"), str(os.getpid()))
    except OSError as error:
        raise JailError(f"joining the pids cgroup {path} failed: {error.strerror}") from None
    if not in_pids_cgroup():
        raise JailError(f"{path} is not a pids cgroup")


def in_pids_cgroup() -> bool:
    """Whether this process sits in a job cgroup of the pids controller (v1) or the unified tree (v2)."""
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if (controllers == "" or "pids" in controllers.split(",")) and "/ndif-jobs/" in path:
            return True
    return False


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
            continue  # no cap asked for (a CUDA process: see child._run_jailed)
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
_FILE_RIGHTS = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 14) | (1 << 16)  # the rights a rule on a file may carry


def landlock(workdir: str, readable: list, net: bool = True, scope: bool = True) -> int:
    """Reads only under ``readable`` (the interpreter, its packages, system
    libraries), everything only under ``workdir``; with ``net``, no TCP; with
    ``scope``, no signals and no abstract UNIX sockets out of the jail; no
    pathname UNIX socket outside the jail either where the kernel can say so
    (ABI 9). Returns the Landlock ABI of the kernel; raises JailError where it
    has none."""
    abi = libc.syscall(_SYS_CREATE_RULESET, None, 0, 1)
    if abi < 1:
        raise JailError("the kernel has no Landlock (Linux >= 5.13 with landlock in the lsm= list)")
    handled_fs = (_FS_READ | _FS_WRITE_ABI1 | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
                  | (_FS_RESOLVE_UNIX if abi >= 9 else 0))
    handled_net = (_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 and net else 0
    scoped = (_SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL) if abi >= 6 and scope else 0
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


# --- seccomp ----------------------------------------------------------------------

# System calls no experiment needs, refused with EPERM: kernel attack surface
# (io_uring, bpf, perf, userfaultfd, keyrings), other processes' memory
# (ptrace, process_vm_*), anything that changes mounts, namespaces or the
# machine. Names this architecture lacks are skipped.
SECCOMP_DENIED = (
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp",
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "mount", "umount2", "unshare", "setns", "pivot_root", "chroot", "open_tree", "move_mount",
    "fsopen", "fsmount", "fsconfig", "fspick", "mount_setattr",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd",
    "name_to_handle_at", "open_by_handle_at", "lookup_dcookie", "fanotify_init",
    "syslog", "vhangup", "iopl", "ioperm", "modify_ldt", "uselib", "ustat", "sysfs", "_sysctl", "nfsservctl",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname", "vmsplice",
)
_CLONE_NAMESPACES = (CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET,
                     0x02000000)  # ... and CLONE_NEWCGROUP
# personality() bits that weaken the next exec (no ASLR, executable data, page zero...).
_PERSONALITY_RISKY = (0x0020000, 0x0040000, 0x0100000, 0x0200000, 0x0400000, 0x0800000, 0x8000000)
AF_UNIX = 1


_seccomp = None


def load_seccomp_binding():
    """Import ``pyseccomp`` (it finds libseccomp.so with ``ldconfig``, which
    needs /tmp: so before the mounts). Raises JailError where it is missing."""
    global _seccomp
    if _seccomp is None:
        try:
            import pyseccomp
        except (ImportError, RuntimeError, OSError) as error:  # RuntimeError: no libseccomp.so on the host
            raise JailError(f"libseccomp is not available ({error})") from None
        _seccomp = pyseccomp
    return _seccomp


def seccomp_filter() -> None:
    """Load the filter on every thread of this process (TSYNC). Raises
    JailError where libseccomp (or its binding) is missing."""
    sc = load_seccomp_binding()
    eperm = sc.ERRNO(errno.EPERM)
    rules = sc.SyscallFilter(sc.ALLOW)
    for name in SECCOMP_DENIED:
        try:
            rules.add_rule(eperm, name)
        except OSError:  # no such call on this architecture
            continue
    rules.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # libc falls back to clone(), whose flags we can read
    for flag in _CLONE_NAMESPACES:
        rules.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    for bit in _PERSONALITY_RISKY:  # bit 31 set: the 0xffffffff query, allowed
        rules.add_rule(eperm, "personality", sc.Arg(0, sc.MASKED_EQ, 0x80000000 | bit, bit))
    # Pathname and abstract UNIX sockets alike: the host's sockets stay out of
    # reach even if one was bound after the mount masks were made.
    rules.add_rule(eperm, "socket", sc.Arg(0, sc.EQ, AF_UNIX))
    rules.set_attr(sc.Attr.CTL_TSYNC, 1)
    try:
        rules.load()
    except OSError as error:
        raise JailError(f"loading the seccomp filter failed: {error}") from None


# --- the whole jail -----------------------------------------------------------------


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
    layers.attempt("proc", fresh_proc if pid_namespace else _proc_hidepid)
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


def _proc_hidepid() -> None:
    _check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, b"hidepid=2"),
           "mount(proc /proc, hidepid=2)")


def probe(readable=None, cgroup_root: str = "", disabled=(), timeout_s: float = 30.0) -> dict:
    """Set every layer up in a throwaway child, with the code a job's child
    uses, and report ``{layer: {"ok": bool, "why": str}}`` (``ndif-celery
    doctor``). Runs no user code; the child exits at once."""
    import json
    import shutil
    import tempfile
    import time

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
            ready, _, _ = __import__("select").select([read_end], [], [], 0.2)
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
    import json

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
