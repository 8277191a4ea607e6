"""The web under hostile clients, by raw websocket against a real stack.

A blocking client's ``/subscribe`` only listens: what a client sends there is
bounded (``web/subscribe.py``). A deflate bomb (a frame of a few hundred KiB
that would inflate to 256 MiB) is refused without inflating it: the socket
closes and the web's memory stays where it was. Any message closes the socket
with 1008; one over the inbound cap is cut while it arrives. After each, the
web still answers and a real client's trace is exact.
"""

from __future__ import annotations

import os
import socket
import time
import zlib

import psutil
import pytest

from tests.support.clients import raw_websocket
from tests.support.clients.remote import same_as_local

BOMB_BYTES = 256 << 20  # what the bomb inflates to
RSS_SLACK = 64 << 20  # the web may grow this much for unrelated reasons, not more


def _web_rss(stack) -> int:
    """Resident bytes of the stack's gunicorn processes (the master and its workers)."""
    master = psutil.Process(stack.pids()["web"])
    return sum(p.memory_info().rss for p in [master, *master.children(recursive=True)])


def _upgrade(stack, deflate: bool = True) -> tuple[socket.socket, str]:
    """A raw handshake on the stack's ``/subscribe``, accepted."""
    sock, head = raw_websocket.upgrade(stack.url, deflate=deflate)
    assert head.startswith("HTTP/1.1 101"), head
    return sock, head


_frame = raw_websocket.frame


def _closed(sock: socket.socket, within_s: float = 20.0) -> bytes:
    """Everything the server sent until it closed the connection; fails if it does not."""
    sock.settimeout(1.0)
    got, deadline = b"", time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk
    raise AssertionError(f"the socket is still open after {within_s:.0f} s; it sent {got[:200]!r}")


def _close_code(received: bytes) -> int | None:
    """The status code of the close frame among the server's frames, if any."""
    return raw_websocket.Reply(raw_websocket.frames(received), closed=True).close_code


@pytest.fixture
def stack(on_fs_stack):
    yield on_fs_stack


def test_a_deflate_bomb_is_refused_without_inflating_it(stack, model):
    sock, head = _upgrade(stack)
    try:
        assert "permessage-deflate" not in head.lower(), f"the server accepted compression:\n{head}"
        before = _web_rss(stack)
        squeezer = zlib.compressobj(9, zlib.DEFLATED, -15)
        bomb = squeezer.compress(b"\0" * BOMB_BYTES) + squeezer.flush(zlib.Z_SYNC_FLUSH)
        assert bomb.endswith(b"\x00\x00\xff\xff") and len(bomb) < BOMB_BYTES // 500
        sock.sendall(_frame(bomb[:-4], opcode=0x2, rsv1=True))
        _closed(sock)
        assert _web_rss(stack) - before < RSS_SLACK, "the web inflated the bomb"
    finally:
        sock.close()
    same_as_local(model)


def test_a_message_on_the_status_socket_closes_it(stack, model):
    sock, _ = _upgrade(stack, deflate=False)
    try:
        sock.sendall(_frame(b'{"hello": "server"}'))
        assert _close_code(_closed(sock)) == 1008
    finally:
        sock.close()
    same_as_local(model)


def test_a_message_over_the_inbound_cap_is_cut_while_it_arrives(stack, model):
    sock, _ = _upgrade(stack, deflate=False)
    try:
        before = _web_rss(stack)
        # One 64 MiB message, its payload sent a MiB at a time: the server cuts it
        # at the cap (1009, message too big) long before the end.
        total, piece = 64 << 20, 1 << 20
        sock.sendall(bytes([0x82, 0x80 | 127]) + total.to_bytes(8, "big") + os.urandom(4))
        sent = 0
        try:
            while sent < total:
                sock.sendall(b"\0" * piece)  # any bytes: masked, they are the payload
                sent += piece
        except (BrokenPipeError, ConnectionResetError):
            pass
        code = _close_code(_closed(sock))
        assert code == 1009 or (code is None and sent < total), (code, sent)
        assert _web_rss(stack) - before < RSS_SLACK, "the web buffered the oversized message"
    finally:
        sock.close()
    same_as_local(model)


def test_handshakes_that_submit_nothing_leave_nothing_in_redis(stack):
    """Each handshake records its session's owner; it lives while the socket
    does (renewed at each look) and goes when it closes, not for a job's TTL."""
    import redis

    from tests.support.waiting import wait_until
    from web.subscribe import SESSION_OWNER_TTL_S

    client = redis.Redis.from_url(stack.redis_url)
    try:
        before = set(client.keys("ndif:session:*"))
        sockets = [_upgrade(stack, deflate=False)[0] for _ in range(20)]
        made = set(client.keys("ndif:session:*")) - before
        try:
            assert len([key for key in made if key.endswith(b":owner")]) == 20, made
            for key in made:
                assert 0 < client.ttl(key) <= SESSION_OWNER_TTL_S, (key, client.ttl(key))
        finally:
            for sock in sockets:
                sock.close()
        wait_until(lambda: not any(client.exists(key) for key in made), 30, "the closed sessions' records to go")
    finally:
        client.close()
