"""The byte protocol between the worker and an isolated child, both ways.

Why a module of its own: the worker's side (``workers.isolation.parent``) and the
child's side (``workers.isolation.child``) must agree on every byte, and the child's
frames are read by the worker as hostile input, so the framing and its
limits are written once, here, where both sides import them.

A frame is one type byte, an 8-byte big-endian length, the body. Child to
worker: ``L`` a LOG line (UTF-8), ``R`` the result blob, ``E`` an error
message (UTF-8), ``M`` meta (JSON). Worker to child: ``J`` the request's
JSON header (compress, env), then ``B`` the payload blob.
"""

from __future__ import annotations

import json
import os
import struct

from ndif_celery import output_bounds

HEADER = struct.Struct(">cQ")

#: The largest body of each frame kind a child may send (``R``: the policy's result limit).
FRAME_LIMITS = {b"L": output_bounds.LOG_LINE_BYTES, b"E": output_bounds.ERROR_BYTES, b"M": output_bounds.META_BYTES}
FRAME_NAMES = {b"L": "LOG", b"E": "ERROR", b"M": "meta", b"R": "result"}


# --- the worker's side: the request ---------------------------------------------------


def request_frames(blob: bytes, compress: bool, env: dict) -> tuple:
    """What the worker writes down a child's request pipe, in order: the
    ``J`` header frame, the ``B`` frame's header, the blob (not copied)."""
    header = json.dumps({"compress": bool(compress), "env": env}).encode()
    return HEADER.pack(b"J", len(header)) + header, HEADER.pack(b"B", len(blob)), blob


# --- the child's side -----------------------------------------------------------------


def send(fd: int, kind: bytes, body) -> None:
    """Write one frame to the worker (blocking: the child has nothing else to do)."""
    if kind in (b"L", b"E"):  # the worker kills a child whose frame is over its kind's limit
        # Bounded as the worker will bound it (as JSON), so it is cut once, with one note.
        body = output_bounds.truncate(bytes(body).decode("utf-8", "replace"), FRAME_LIMITS[kind]).encode("utf-8")
    body = memoryview(body)
    if body.nbytes < 65536:
        write_all(fd, HEADER.pack(kind, body.nbytes) + body.tobytes())
    else:  # a big result: no copy of it just to prepend the header
        write_all(fd, HEADER.pack(kind, body.nbytes))
        write_all(fd, body)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def read_exactly(fd: int, size: int) -> bytes:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise EOFError("the worker closed the request pipe")
        got += n
    return bytes(buffer)


def receive_request(fd: int) -> tuple[bytes, bool, dict]:
    """The request the worker hands a child (``request_frames``): a JSON header, then the blob."""
    kind, length = HEADER.unpack(read_exactly(fd, HEADER.size))
    header = json.loads(read_exactly(fd, length)) if kind == b"J" else {}
    kind, length = HEADER.unpack(read_exactly(fd, HEADER.size))
    blob = read_exactly(fd, length)
    os.close(fd)
    return blob, bool(header.get("compress")), header.get("env") or {}
