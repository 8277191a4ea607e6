"""The Socket.IO door under hostile clients, on real stacks (gunicorn's gevent worker), auth off and on.

The nnsight 0.6/0.7 clients wait on ``/ws/socket.io`` with no key, so anyone
who reaches the web can open one. Two attacks once cost the farm: a message
that never finishes (simple-websocket buffered it whole before any size
check: 192 MiB held per socket), and connections that never send the
namespace CONNECT (never closed: hundreds took a web process's connections).
Now a message is cut at ``sio.MESSAGE_MAX_BYTES`` as it arrives, a
connection must CONNECT within ``NDIF_SOCKETIO_CONNECT_S``, and sockets are
bounded per address and, unclaimed, per process (``web/open_sockets.py``).
Meanwhile ``/ping`` answers and a key holder's trace is exact.
"""

from __future__ import annotations

import socket
import time

import httpx
import nnsight
import psutil
import pytest

from ndif_celery import config
from tests.support import pace
from tests.support.clients import raw_websocket
from tests.support.clients.raw_websocket import SOCKETIO_PATH
from tests.support.clients.remote import client_pointed_at, same_as_local
from tests.support.waiting import wait_until
from web import sio

MESSAGE_BYTES = 200 << 20
RSS_SLACK = 64 << 20
ATTEMPTS = 3000
ADDRESSES = [f"127.0.0.{n}" for n in range(2, 18)]


@pytest.fixture(params=["fs", "auth"], ids=["auth off", "auth on"])
def stack(stack_pool, model, request):
    """A pooled stack, the client pointed at it with a key where auth is on."""
    found = stack_pool.get(request.param)
    with client_pointed_at(found.url):
        if request.param == "auth":
            made = found.cli("keys", "create", "--email", f"holder-{time.monotonic_ns()}@sio.test", "--trusted",
                             check=True)
            nnsight.CONFIG.API.APIKEY = made.stdout.strip().splitlines()[-1]
        yield found


pytestmark = pytest.mark.pools("fs", "auth")


def _web_rss(stack) -> int:
    master = psutil.Process(stack.pids()["web"])
    return sum(p.memory_info().rss for p in [master, *master.children(recursive=True)])


def test_a_message_that_never_finishes_is_cut_as_it_arrives(stack, model):
    sock, head = raw_websocket.upgrade(stack.url, path=SOCKETIO_PATH)
    try:
        assert head.startswith("HTTP/1.1 101"), head
        before = _web_rss(stack)
        # One 200 MiB text message, its payload sent a MiB at a time and never finished.
        sock.sendall(bytes([0x81, 0x80 | 127]) + MESSAGE_BYTES.to_bytes(8, "big") + b"\0\0\0\0")
        sent, piece = 0, b"4" * (1 << 20)
        try:
            while sent < MESSAGE_BYTES - len(piece):
                sock.sendall(piece)
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = raw_websocket.read(sock, quiet_s=pace.bound(5), within_s=pace.bound(20))
        grown = _web_rss(stack) - before
        print(f"sent {sent >> 20} MiB of a {MESSAGE_BYTES >> 20} MiB message before the cut; "
              f"close code {reply.close_code}; web RSS {grown / (1 << 20):+.1f} MiB")
        assert reply.closed and reply.close_code == 1009, (reply.closed, reply.close_code)
        assert sent < MESSAGE_BYTES - len(piece), "the web read the whole message"
        assert grown < RSS_SLACK, f"the web grew {grown >> 20} MiB"
    finally:
        sock.close()
    same_as_local(model)


def test_thousands_of_half_open_connections_take_no_door(stack, model):
    settings = config.load(stack.env)
    bound = settings.web_workers * settings.unclaimed_sockets  # per web process
    held, refused, most_open, ping_s = [], 0, 0, []
    try:
        for n in range(ATTEMPTS):
            try:
                sock, head = raw_websocket.upgrade(stack.url, path=SOCKETIO_PATH, source=ADDRESSES[n % len(ADDRESSES)])
            except OSError:
                refused += 1
                continue
            if head.startswith("HTTP/1.1 101"):
                held.append(sock)
            else:
                assert head.startswith("HTTP/1.1 401") and "NDIF_" in head, head
                refused += 1
                sock.close()
            if n % 250 == 0:
                held = [sock for sock in held if not _closed(sock)]  # the ones the server still holds
                most_open = max(most_open, len(held))
                started = time.monotonic()
                assert httpx.get(f"{stack.url}/ping", timeout=pace.bound(5)).status_code == 200
                ping_s.append(time.monotonic() - started)
        same_as_local(model)  # a key holder's trace while the connections are held
        print(f"{ATTEMPTS} attempts from {len(ADDRESSES)} addresses: at most {most_open} open at once "
              f"(bound {bound}), {refused} refused; /ping in {max(ping_s) * 1000:.0f} ms at worst")
        assert most_open <= bound and refused > 0
        # None of them sent its CONNECT: each is closed by the server after the deadline.
        deadline = settings.socketio_connect_s + sio.REAP_EVERY_S
        wait_until(lambda: all(_closed(sock) for sock in held), pace.bound(deadline + 10),
                   "the server to close every half-open connection")
    finally:
        for sock in held:
            sock.close()
    assert httpx.get(f"{stack.url}/ping", timeout=10).status_code == 200


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed the connection (what it sent before is read and dropped)."""
    sock.setblocking(False)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True
