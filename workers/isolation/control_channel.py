"""The control channel between the worker and a process that forks for it.

The fork server (``workers.isolation.forkserver``, which forks zygotes) and a zygote
(``workers.isolation.zygote``, which forks jailed children) speak the same way to the
worker: one ``SOCK_SEQPACKET`` Unix socket, a JSON object per packet, file
descriptors by ``SCM_RIGHTS``; requests come from the worker, replies
(``ready``, ``error``, what was forked, ``exited`` with a wait status) go back.
Nothing is ever unpickled on the worker's side. Written once here so the two
forking loops cannot drift apart in how they reap, reply or notice the
worker letting go.
"""

from __future__ import annotations

import json
import os
import select
import socket
import time
from typing import Any, Iterator

#: The longest a worker's thread blocks at once waiting for a ``ready``: a kill
#: (``ndif-celery kill``, raised into the job's thread) or a deadline lands only
#: between two waits, since a thread blocked in a lock's C wait runs no Python.
WAIT_SLICE_S = 0.1


def messages(sock: socket.socket) -> Iterator[dict]:
    """The worker's side: each JSON reply until the other end is gone (EOF
    or a socket error); a packet that is not JSON is skipped."""
    while True:
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            return
        try:
            yield json.loads(data)
        except ValueError:
            continue


def settled(handle: Any, message: dict) -> bool:
    """The worker's side: a ``ready`` or ``error`` reply settles ``handle``
    (``handle.ready`` set; ``handle.error`` the reason it can fork nothing);
    False for any other reply, which the caller handles."""
    if "ready" in message:
        handle.ready.set()
        return True
    if "error" in message:
        handle.error = str(message["error"])[:2000]
        handle.ready.set()
        return True
    return False


def wait_ready(handle: Any, timeout: float, error: type, what: str) -> None:
    """The worker's side: return once ``handle`` is settled (:func:`settled`)
    and ready; raise ``error`` naming ``what`` if it is not within ``timeout``
    seconds, or with the reason it gave (``handle.error``).

    Waited in slices of :data:`WAIT_SLICE_S`, not one ``Event.wait(timeout)``:
    the first untrusted job after a deploy waits here for its model's exec'd
    zygote (seconds of imports), and ``ndif-celery kill`` of that job, an
    exception raised into this thread, would otherwise land only once the
    zygote was ready."""
    deadline = time.monotonic() + timeout
    while not handle.ready.wait(min(WAIT_SLICE_S, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            raise error(f"{what} did not become ready within {timeout:g} s")
    if handle.error:
        raise error(handle.error)


def requests(sock: socket.socket, max_fds: int, children: set) -> Iterator[tuple[dict, list]]:
    """The forking side: each request with its file descriptors, until the
    worker lets go (EOF). Between requests (at least every 0.2 s) the exited
    ``children`` are reaped and reported."""
    while True:
        ready, _, _ = select.select([sock], [], [], 0.2)
        reap(sock, children)
        if not ready:
            continue
        try:
            message, fds, _, _ = socket.recv_fds(sock, 65536, max_fds)
        except OSError:
            message = b""
        if not message:
            return
        yield json.loads(message), fds


def reap(sock: socket.socket, children: set) -> None:
    """Report each of ``children`` that has exited: ``{"exited": pid, "status": wait status}``."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        reply(sock, {"exited": pid, "status": status})


def reply(sock: socket.socket, message: dict) -> None:
    """Send ``message`` to the worker; if the worker is gone, so is this process."""
    try:
        sock.send(json.dumps(message).encode())
    except OSError:
        os._exit(0)
