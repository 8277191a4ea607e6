"""Jail layer ``unix_sockets``: the host's pathname UNIX sockets hidden from the child.

Why a module of its own: a network namespace cuts every TCP/IP and abstract
UNIX socket, but a pathname UNIX socket is reached through the file system,
which the child shares. So the child's mount namespace hides them: empty
read-only mounts over their directories, ``/dev/null`` over the socket file
where the directory must stay visible.
"""

from __future__ import annotations

import ctypes
import errno
import os

from .kernel import MS_NODEV, MS_NOEXEC, MS_NOSUID, JailError, check, libc

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
        check(libc.mount(b"tmpfs", directory.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                          b"size=64k,mode=0755"), f"mount(tmpfs over {directory})")
        masks.append(directory)
    for path in singles:
        if libc.mount(b"/dev/null", path.encode(), None, MS_BIND, None) < 0:
            if ctypes.get_errno() not in (errno.ENOENT, errno.ENOTDIR):  # gone since listed: nothing to reach
                check(-1, f"mount(/dev/null over {path})")
    return masks


def seal_masks(masks) -> None:
    """Once the workdir is mounted inside them, make the directory masks read-only."""
    for directory in masks:
        if os.path.isdir(directory):
            check(libc.mount(None, directory.encode(), None,
                              MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, None),
                   f"remount(read-only {directory})")


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")
