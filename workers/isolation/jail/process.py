"""Jail layers ``rlimits``, ``drop_root`` and ``no_new_privs``, and what the child inherits.

Why a module of its own: these layers act on the process itself, not on
its view of the machine: its resource limits, its user and capabilities,
its open descriptors (an inherited socket to Redis would bypass the network
namespace), its environment and the secret strings in its memory.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
from dataclasses import dataclass

from .kernel import NOBODY, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECUREBITS, check, libc, real_root

# SECBIT_NOROOT, NO_SETUID_FIXUP, KEEP_CAPS_LOCKED, NO_CAP_AMBIENT_RAISE, each with its lock bit.
SECURE_ALL = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80
CAP_VERSION_3 = 0x20080522

ENV_ALLOWLIST = ("PATH", "LANG", "LC_ALL", "TZ", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "OMP_NUM_THREADS")


@dataclass(frozen=True)
class Limits:
    memory_bytes: int  # address space on top of what the process already maps
    cpu_seconds: int
    open_files: int = 256
    processes: int = 256
    file_bytes: int = 256 * 1024 * 1024


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
    for fd in open_fds():
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def open_fds() -> list[int]:
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


def no_new_privs() -> None:
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")


def drop_privileges(to_nobody: bool) -> str:
    """Give up root: become ``nobody`` when the interpreter is readable to it,
    else stay uid 0 with every capability gone for good (no bounding set, no
    root privileges regained on exec), fenced by Landlock. Returns who we are."""
    if os.getuid() != 0:
        return "unprivileged"
    if to_nobody and real_root():
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
        return "nobody"
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    check(libc.prctl(PR_SET_SECUREBITS, SECURE_ALL, 0, 0, 0), "prctl(securebits)")
    header = (ctypes.c_uint32 * 2)(CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    check(libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset(none)")
    return "root-without-capabilities"
