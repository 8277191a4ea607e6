"""The Socket.IO door (``web/sio.py``, ``web/open_sockets.py``), attacked in-process.

The real Flask app is served by werkzeug's threaded server in this process
(Socket.IO's ``threading`` mode; the e2e tier attacks gunicorn's gevent
worker). Each attack is a raw websocket doing what no 0.6/0.7 client does:
connecting and never sending the namespace CONNECT, sending an event, a binary
packet, a malformed packet or a second CONNECT, holding more sockets from one
address than the bound. Each must end with the connection closed (or refused
before the upgrade), and a well-behaved client still served.
"""

from __future__ import annotations

import dataclasses
import time

import httpx
import pytest
import socketio

from tests.support import pace

from tests.support.clients import raw_websocket
from tests.support.clients.raw_websocket import SOCKETIO_PATH
from tests.support.stacks.servers import serving
from web import sio

CONNECT_S = 1.0
PER_ADDRESS = 4
UNCLAIMED = 6


@pytest.fixture(scope="module")
def url(embedded_settings):
    from web.app import create_app

    settings = dataclasses.replace(embedded_settings, web_worker_class="gthread", disconnect_grace_s=3600.0,
                                   socketio_connect_s=CONNECT_S, websockets_per_address=PER_ADDRESS,
                                   unclaimed_sockets=UNCLAIMED)
    with serving(create_app(settings)) as found:
        yield found


def _open(url: str, source: str = "127.0.0.1"):
    """A raw engine.io websocket from ``source``: the socket and the server's answer."""
    return raw_websocket.upgrade(url, path=SOCKETIO_PATH, source=source)


def _connected(url: str, source: str = "127.0.0.1"):
    """A raw socket that sent its namespace CONNECT and was answered."""
    sock, head = _open(url, source)
    assert head.startswith("HTTP/1.1 101"), head
    sock.sendall(raw_websocket.frame(b"40"))
    reply = raw_websocket.read(sock, quiet_s=0.5)
    assert any(text.startswith("40{") for text in reply.texts), reply.texts
    return sock


def _closed_within(sock, seconds: float) -> float:
    """How long the server took to close the connection; fails past ``seconds``."""
    started = time.monotonic()
    reply = raw_websocket.read(sock, quiet_s=pace.bound(seconds), within_s=pace.bound(seconds))
    took = time.monotonic() - started
    assert reply.closed, f"still open after {took:.1f} s; it sent {reply.texts}"
    return took


def test_a_connection_that_never_sends_connect_is_closed(url):
    sock, head = _open(url)
    try:
        assert head.startswith("HTTP/1.1 101"), head
        took = _closed_within(sock, CONNECT_S + sio.REAP_EVERY_S + 5)
        print(f"closed {took:.1f} s after the upgrade (NDIF_SOCKETIO_CONNECT_S={CONNECT_S})")
    finally:
        sock.close()


@pytest.mark.parametrize("packet, opcode", [
    pytest.param(b'42["blocking_response","x"]', 0x1, id="an event"),
    pytest.param(b'451-["x",{"_placeholder":true,"num":0}]', 0x1, id="a binary event"),
    pytest.param(b"\x04\x00", 0x2, id="a binary message"),
    pytest.param(b"4", 0x1, id="an empty message"),
    pytest.param(b"4zz", 0x1, id="a malformed packet"),
    pytest.param(b"40", 0x1, id="a second CONNECT"),
    pytest.param(b"9", 0x1, id="an unknown engine.io packet"),
])
def test_a_packet_the_clients_never_send_closes_the_connection(url, packet, opcode):
    sock = _connected(url)
    try:
        sock.sendall(raw_websocket.frame(packet, opcode=opcode))
        _closed_within(sock, 5)
    finally:
        sock.close()


def test_a_message_over_the_bound_is_cut(url):
    sock = _connected(url)
    try:
        sock.sendall(raw_websocket.frame(b"4" + b"x" * sio.MESSAGE_MAX_BYTES))
        reply = raw_websocket.read(sock, quiet_s=pace.bound(5), within_s=pace.bound(5))
        assert reply.closed and reply.close_code == 1009, (reply.closed, reply.close_code)
    finally:
        sock.close()


def test_the_polling_transport_is_refused(url):
    answer = httpx.get(f"{url}/ws/socket.io/?EIO=4&transport=polling", timeout=10)
    assert answer.status_code == 400, answer.text


def test_an_address_holds_a_bounded_number_of_sockets(url):
    held = [_connected(url, "127.0.0.3") for _ in range(PER_ADDRESS)]
    try:
        sock, head = _open(url, "127.0.0.3")
        sock.close()
        assert head.startswith("HTTP/1.1 401") and "NDIF_WEBSOCKETS_PER_ADDRESS" in head, head
        # /subscribe counts among the same address's sockets.
        sock, head = raw_websocket.upgrade(url, source="127.0.0.3")
        sock.close()
        assert " 429 " in head.splitlines()[0] and "NDIF_WEBSOCKETS_PER_ADDRESS" in head, head
        # Another address is served meanwhile, by a real Socket.IO client.
        client = socketio.SimpleClient()
        client.connect(url, socketio_path="/ws/socket.io", transports=["websocket"], wait_timeout=pace.bound(10))
        assert client.connected
        client.disconnect()
    finally:
        for sock in held:
            sock.close()
    # Closed sockets free their places.
    deadline = time.monotonic() + pace.bound(10)
    while True:
        sock, head = _open(url, "127.0.0.3")
        sock.close()
        if head.startswith("HTTP/1.1 101"):
            break
        assert time.monotonic() < deadline, f"the address's places were not freed: {head}"
        time.sleep(0.2)


def test_unclaimed_sockets_are_bounded_per_process(url):
    held = []
    try:
        for n in range(UNCLAIMED):
            sock, head = _open(url, f"127.0.1.{n + 1}")
            held.append(sock)
            assert head.startswith("HTTP/1.1 101"), head
        sock, head = _open(url, "127.0.2.1")
        sock.close()
        assert head.startswith("HTTP/1.1 401") and "NDIF_UNCLAIMED_SOCKETS" in head, head
    finally:
        for sock in held:
            sock.close()


def test_a_namespace_the_server_ends_takes_its_connection_with_it(url, monkeypatch):
    """A socket no key claims is closed after ``IDLE_S``: its connection too, not only the namespace."""
    monkeypatch.setattr(sio, "IDLE_S", 1)
    sock = _connected(url)
    try:
        took = _closed_within(sock, 1 + 5)
        print(f"unclaimed socket closed {took:.1f} s after its CONNECT")
    finally:
        sock.close()
