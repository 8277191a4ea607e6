"""A websocket handshake and frames written by hand, for attacks no client library makes."""

from __future__ import annotations

import base64
import os
import socket
from urllib.parse import urlparse


def upgrade(url: str, headers: dict | None = None, deflate: bool = False, path: str = "/subscribe",
            source: str | None = None) -> tuple[socket.socket, str]:
    """A raw handshake on ``url``'s ``path`` (offering permessage-deflate if
    ``deflate``), from the loopback address ``source`` if given: the socket,
    and the server's answer up to its blank line (and, for a refusal, its body)."""
    where = urlparse(url)
    sock = socket.create_connection((where.hostname, where.port), timeout=30,
                                    source_address=(source, 0) if source else None)
    key = base64.b64encode(os.urandom(16)).decode()
    lines = [f"GET {path} HTTP/1.1", f"Host: {where.netloc}", "Upgrade: websocket", "Connection: Upgrade",
             f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13"]
    if deflate:
        lines.append("Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits")
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    got = b""
    while not got.endswith(b"\r\n\r\n"):  # byte by byte: a frame sent right after the 101 stays unread
        chunk = sock.recv(1)
        if not chunk:
            break
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    text = head.decode(errors="replace")
    if not text.startswith("HTTP/1.1 101"):  # a refusal: its JSON body too
        length = next((int(line.split(":", 1)[1]) for line in text.splitlines()
                       if line.lower().startswith("content-length:")), None)
        while length is None or len(body) < length:  # no length: the body ends with the connection
            try:
                chunk = sock.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            body += chunk
        text += "\r\n\r\n" + body.decode(errors="replace")
    return sock, text


def frame(payload: bytes, opcode: int = 0x1, rsv1: bool = False) -> bytes:
    """One masked client frame (RFC 6455), RSV1 set for a compressed message (RFC 7692)."""
    head = bytes([0x80 | (0x40 if rsv1 else 0) | opcode])
    n = len(payload)
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 1 << 16:
        head += bytes([0x80 | 126]) + n.to_bytes(2, "big")
    else:
        head += bytes([0x80 | 127]) + n.to_bytes(8, "big")
    mask = os.urandom(4)
    whole = (mask * (n // 4 + 1))[:n]
    masked = (int.from_bytes(payload, "big") ^ int.from_bytes(whole, "big")).to_bytes(n, "big") if n else b""
    return head + mask + masked


SOCKETIO_PATH = "/ws/socket.io/?EIO=4&transport=websocket"


class Reply:
    """What a server sent on a raw socket until it closed it or went quiet."""

    def __init__(self, frames: list, closed: bool) -> None:
        self.frames = frames  # (opcode, payload) pairs
        self.closed = closed  # the server closed the TCP connection

    @property
    def texts(self) -> list:
        return [payload.decode(errors="replace") for opcode, payload in self.frames if opcode == 0x1]

    @property
    def close_code(self) -> int | None:
        return next((int.from_bytes(payload[:2], "big") for opcode, payload in self.frames
                     if opcode == 0x8 and len(payload) >= 2), None)


def read(sock: socket.socket, quiet_s: float = 1.0, within_s: float = 20.0) -> Reply:
    """The server's frames until it closes the connection, goes ``quiet_s``
    without a byte, or ``within_s`` passes."""
    import time

    sock.settimeout(quiet_s)
    got, closed, deadline = b"", False, time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            break
        except (ConnectionResetError, OSError):
            closed = True
            break
        if not chunk:
            closed = True
            break
        got += chunk
    return Reply(frames(got), closed)


def frames(data: bytes) -> list:
    """Unmasked server frames, as (opcode, payload)."""
    frames, at = [], 0
    while at + 2 <= len(data):
        opcode, n = data[at] & 0x0F, data[at + 1] & 0x7F
        at += 2
        if n == 126:
            n, at = int.from_bytes(data[at:at + 2], "big"), at + 2
        elif n == 127:
            n, at = int.from_bytes(data[at:at + 8], "big"), at + 8
        frames.append((opcode, data[at:at + n]))
        at += n
    return frames
