"""Jail layers ``namespaces``, ``tmpfs`` and ``proc``: the child's own view of the machine.

Why a module of its own: these are the layers set up with ``unshare`` and
``mount`` alone (new mount, network, PID, IPC and UTS namespaces; a private
``noexec`` tmpfs as the only writable place; a /proc that shows only the
jail's processes), the base every other layer assumes.
"""

from __future__ import annotations

import os
import signal

from .kernel import (
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    CLONE_NEWUTS,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_REC,
    NOBODY,
    PR_SET_PDEATHSIG,
    check,
    libc,
    real_root,
    write_file,
)


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
    check(libc.unshare(flags), "unshare(namespaces)")
    if uid != 0:
        write_file("/proc/self/setgroups", "deny")
        write_file("/proc/self/uid_map", f"0 {uid} 1")
        write_file("/proc/self/gid_map", f"0 {gid} 1")


def die_with_parent() -> None:
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def make_private() -> None:
    """Mount changes from here on stay in this mount namespace (never reach the host's)."""
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount(make-rprivate /)")


def private_mounts(workdir: str, size_bytes: int, as_nobody: bool) -> None:
    """``workdir`` becomes a private tmpfs (noexec, nosuid, nodev, capped)
    owned by the user the code will run as. Call :func:`make_private` first."""
    owner = NOBODY if as_nobody and os.getuid() == 0 and real_root() else 0
    os.makedirs(workdir, exist_ok=True)  # again, where a mask hid it (see hide_unix_sockets)
    options = f"size={max(size_bytes, 1 << 20)},mode=0700,uid={owner},gid={owner}".encode()
    check(
        libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, options),
        f"mount(tmpfs {workdir})",
    )


def fresh_proc() -> None:
    """A /proc that shows only this PID namespace (the caller is its PID 1 or
    a descendant). Without it /proc lists every process of the host."""
    check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mount(proc /proc)")


def proc_hidepid() -> None:
    check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, b"hidepid=2"),
           "mount(proc /proc, hidepid=2)")
