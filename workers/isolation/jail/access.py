"""Jail layers ``landlock``, ``landlock_net`` and ``landlock_scope``: what the child may touch.

Why a module of its own: Landlock is the one layer that lists paths (reads
only of the interpreter, its packages, system libraries and the served
model's own folder of the cache; writes only in the job's tmpfs) and, where the kernel has them,
refuses TCP and signals or abstract UNIX sockets out of the jail. The read
list (``readable_paths``) is also what the worker hands each child.
"""

from __future__ import annotations

import ctypes
import os
import stat
import sys

from .kernel import JailError, check, libc
from .process import no_new_privs

# Landlock (linux/landlock.h)

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_RULE_PATH_BENEATH = 1
_FS_WRITE_ABI1 = (1 << 1) | (1 << 4) | (1 << 5) | sum(1 << b for b in range(6, 13))  # write, remove, make *
_FS_REFER, _FS_TRUNCATE = 1 << 13, 1 << 14
_FS_RESOLVE_UNIX = 1 << 16  # ABI 9: connect()/sendmsg() to a pathname UNIX socket
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1, 2


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
    ruleset = check(libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), size, 0), "landlock_create_ruleset")
    try:
        _allow(ruleset, workdir, handled_fs)
        for path in readable:
            _allow(ruleset, path, _FS_READ)
        no_new_privs()
        check(libc.syscall(_SYS_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
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
        check(libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), 0), f"landlock_add_rule({path})")
    finally:
        os.close(fd)


SYSTEM_READABLE = (
    "/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/opt",
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/passwd", "/etc/group",
    "/etc/nsswitch.conf", "/etc/ssl", "/etc/pki", "/etc/ca-certificates", "/etc/alternatives", "/etc/mime.types",
    "/proc", "/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/sys/devices/system/cpu", "/sys/fs/cgroup",
)


def readable_paths(extra: tuple = ()) -> list[str]:
    """What user code may read: the interpreter, its installed packages and this
    project's own (``ndif_celery``, ``workers``), system libraries and a few /etc
    files, and ``extra`` (the served model's own files). Not the worker's home,
    its working directory, ``NDIF_HOME``, results, the rest of the model cache,
    or any other user's files."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths = {*prefixes, *SYSTEM_READABLE, *extra, *_project_packages()}
    paths.update(p for p in sys.path if p and os.path.isdir(p) and _installed_code(p, prefixes))
    return sorted(os.path.realpath(p) for p in paths if p)


def _installed_code(path: str, prefixes) -> bool:
    """An import-path entry that holds installed code: a site-packages, or a
    directory under the interpreter's prefixes. Not a source checkout or the
    working directory on the path (``python -m``): those hold more than code,
    ``.env`` files and caches among them."""
    path = os.path.realpath(path)
    return os.path.basename(path) in ("site-packages", "dist-packages") or any(
        path == os.path.realpath(p) or path.startswith(os.path.realpath(p).rstrip("/") + "/") for p in prefixes)


def _project_packages() -> list[str]:
    """This project's packages a child imports, wherever they are installed (a
    checkout, for an editable install): their directories, not what is beside them."""
    import ndif_celery
    import workers

    return [os.path.dirname(module.__file__) for module in (ndif_celery, workers)]


def covering(readable, private) -> tuple[str, str]:
    """The first (readable path, private path) where a readable path is, or
    lies above, a path that must stay private; ("", "") when none does.
    Landlock only adds what may be read, so a private path under a readable
    one cannot be taken back out."""
    for inside in private:
        inside = os.path.realpath(inside)
        for path in readable:
            if inside == path or inside.startswith(path.rstrip("/") + "/"):
                return path, inside
    return "", ""


def readable_by_others(path: str) -> bool:
    """Whether ``nobody`` could read ``path`` (every directory on the way searchable)."""
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
