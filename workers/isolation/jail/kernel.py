"""What every jail layer stands on: libc, the error, the kernel's flag values, checked calls.

Why a module of its own: each layer module (``namespaces``, ``sockets``,
``cgroups``, ``process``, ``access``, ``seccomp``) calls the kernel through
``ctypes`` the same way and fails the same way (:class:`JailError`, naming
the call and its errno); that is written once, here.
"""

from __future__ import annotations

import ctypes
import errno
import os

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
NOBODY = 65534


class JailError(Exception):
    pass


def check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise JailError(f"{what} failed: {errno.errorcode.get(err, err)} ({os.strerror(err)})")
    return result


def write_file(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def read_file(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def real_root() -> bool:
    """Root outside any user namespace (so dropping to nobody means something)."""
    try:
        with open("/proc/self/uid_map") as f:
            inside, outside, _ = f.read().split()[:3]
        return outside == "0"
    except (OSError, ValueError):
        return False
