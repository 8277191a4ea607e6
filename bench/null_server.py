"""The null server: the nnsight 0.8.1 wire protocol and nothing else.

It answers every request at once with a result prepared in advance, so the
time a client spends against it is the protocol's floor (client serialization,
HTTP, the websocket, downloading and loading the result), with no queue, no
worker and no model. The bench prepares each workload's result by running the
block locally once and encoding it exactly as our worker does
(``workers.results.encode`` / ``completed_frame``), then hands it over here:

    PUT /_null/result   body: the bytes; headers
        X-Null-Mode: inline   body is a pickled COMPLETED frame, sent as one
                              binary websocket frame (as our web does for
                              results up to NDIF_MAX_INLINE_BYTES)
        X-Null-Mode: url      body is the result bytes; COMPLETED carries a URL
                              to GET /_null/blob/<n> (as our store does)
        X-Null-Compress: 1|0  what the request must have asked for (a request
                              that asked otherwise gets ERROR, not wrong bytes)

What the client sees (see docs/api.md; the same as our web):

- ``WS /subscribe``: text frame ``{"session_id": ...}``; later the COMPLETED
  frame of the job submitted with that session id; then a close frame.
- ``POST /request`` (multipart ``data`` + ``blob``): ``RECEIVED`` JSON.
- ``GET /response/<id>``: COMPLETED with the URL (non-blocking clients).
- ``GET /_null/blob/<n>``: the result bytes.

Standard library only (no torch, no Flask): a threaded ``http.server`` with
TCP_NODELAY and a few lines of RFC 6455 for the server side of the websocket.

    python bench/null_server.py --port 8123
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import queue
import socket
import struct
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
RECEIVED_DESCRIPTION = "Your job has been received and is waiting to be queued."
COMPLETED_DESCRIPTION = "Your job has been completed."


def ws_frame(opcode: int, payload: bytes) -> bytes:
    """One unmasked (server-to-client) websocket frame header; payload follows."""
    n = len(payload)
    if n < 126:
        return struct.pack("!BB", 0x80 | opcode, n)
    if n < 1 << 16:
        return struct.pack("!BBH", 0x80 | opcode, 126, n)
    return struct.pack("!BBQ", 0x80 | opcode, 127, n)


def status_json(job_id: str, status: str, description: str, data=None) -> bytes:
    return json.dumps(
        {"id": job_id, "status": status, "description": description, "data": data, "meta": None}
    ).encode()


class Prepared:
    """The answer every job gets until the bench prepares another."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.mode = "none"
        self.compress = True
        self.body = b""
        self.generation = 0


class NullServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128
    allow_reuse_address = True

    def __init__(self, address) -> None:
        super().__init__(address, Handler)
        self.prepared = Prepared()
        self.sessions: dict[str, queue.SimpleQueue] = {}
        self.sessions_lock = threading.Lock()
        self.completed: dict[str, bytes] = {}  # job id -> COMPLETED JSON (non-blocking polls)
        self.host_url = f"http://{address[0]}:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: NullServer

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, *args) -> None:  # quiet: logging costs time
        pass

    def _send(self, code: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _detail(self, code: int, detail: str) -> None:
        self._send(code, json.dumps({"detail": detail}).encode())

    # -- GET: /subscribe, /response/<id>, /_null/blob/<n>, /ping ---------------

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/subscribe":
            return self._subscribe()
        if path.startswith("/_null/blob/"):
            prepared = self.server.prepared
            with prepared.lock:
                body, generation = prepared.body, prepared.generation
            if path != f"/_null/blob/{generation}":
                return self._detail(404, "no such result (the bench prepared another since)")
            return self._send(200, body, "application/octet-stream")
        if path.startswith("/response/"):
            body = self.server.completed.get(path.rsplit("/", 1)[-1])
            if body is None:
                return self._detail(404, f"No response for request {path.rsplit('/', 1)[-1]}.")
            return self._send(200, body)
        if path == "/ping":
            return self._send(200, b'"pong"')
        return self._detail(404, "not found")

    def _subscribe(self) -> None:
        key = self.headers.get("Sec-WebSocket-Key")
        if not key or self.headers.get("Upgrade", "").lower() != "websocket":
            return self._detail(400, "expected a websocket upgrade")
        accept = base64.b64encode(hashlib.sha1(key.encode() + _WS_GUID).digest()).decode()
        session_id = uuid.uuid4().hex
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        with self.server.sessions_lock:
            self.server.sessions[session_id] = inbox
        try:
            hello = json.dumps({"session_id": session_id}).encode()
            self.wfile.write(
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Accept: " + accept.encode() + b"\r\n\r\n" + ws_frame(0x1, hello) + hello
            )
            opcode, payload = inbox.get(timeout=600)
            self.wfile.write(ws_frame(opcode, payload))
            self.wfile.write(payload)
            self.wfile.write(ws_frame(0x8, b"\x03\xe8") + b"\x03\xe8")  # close, 1000
            # Let the client's close frame arrive before we close (no RST).
            self.connection.settimeout(5)
            try:
                self.connection.recv(256)
            except OSError:
                pass
        except queue.Empty:
            pass
        finally:
            with self.server.sessions_lock:
                self.server.sessions.pop(session_id, None)
            self.close_connection = True

    # -- POST /request ----------------------------------------------------------

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] != "/request":
            return self._detail(404, "not found")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        envelope = _form_field(self.headers.get("Content-Type", ""), body, b"data")
        if envelope is None:
            return self._detail(422, "Missing form field 'data' (the JSON request envelope).")
        data = json.loads(envelope)
        job_id = uuid.uuid4().hex
        self._send(200, status_json(job_id, "RECEIVED", RECEIVED_DESCRIPTION))

        prepared = self.server.prepared
        with prepared.lock:
            mode, compress, payload, generation = prepared.mode, prepared.compress, prepared.body, prepared.generation
        session_id = data.get("session_id") or ""
        if mode == "none" or bool(data.get("compress")) != compress:
            frame = (0x1, status_json(job_id, "ERROR", f"null server: prepared {mode} compress={compress}, "
                                                       f"request compress={data.get('compress')}"))
        elif mode == "inline":
            if session_id:
                frame = (0x2, payload)
            else:
                frame = (0x1, status_json(job_id, "ERROR", "null server: prepared an inline result, "
                                                           "but a non-blocking request needs a URL"))
        else:
            url = f"{self.server.host_url}/_null/blob/{generation}"
            frame = (0x1, status_json(job_id, "COMPLETED", COMPLETED_DESCRIPTION, url))
        if session_id:
            with self.server.sessions_lock:
                inbox = self.server.sessions.get(session_id)
            if inbox is not None:
                inbox.put(frame)
        elif frame[0] == 0x1:
            self.server.completed[job_id] = frame[1]

    # -- PUT /_null/result (the bench) -----------------------------------------

    def do_PUT(self) -> None:
        if self.path != "/_null/result":
            return self._detail(404, "not found")
        length = int(self.headers.get("Content-Length") or 0)
        body = bytearray(length)
        view = memoryview(body)
        got = 0
        while got < length:
            n = self.rfile.readinto(view[got:])
            if not n:
                return self._detail(400, "short body")
            got += n
        mode = self.headers.get("X-Null-Mode", "")
        if mode not in ("inline", "url"):
            return self._detail(400, "X-Null-Mode must be inline or url")
        prepared = self.server.prepared
        with prepared.lock:
            prepared.mode = mode
            prepared.compress = self.headers.get("X-Null-Compress", "1") == "1"
            prepared.body = bytes(body)
            prepared.generation += 1
        self.server.completed.clear()
        self._send(200, json.dumps({"bytes": length, "mode": mode}).encode())


def _form_field(content_type: str, body: bytes, name: bytes):
    """The value of the multipart form field ``name`` (just enough of RFC 7578)."""
    marker = "boundary="
    if marker not in content_type:
        return None
    boundary = content_type.split(marker, 1)[1].split(";", 1)[0].strip().strip('"').encode()
    for part in body.split(b"--" + boundary):
        head, sep, value = part.partition(b"\r\n\r\n")
        if sep and b'name="' + name + b'"' in head:
            return value[:-2] if value.endswith(b"\r\n") else value
    return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    server = NullServer((args.host, args.port))
    print(f"null server on {server.host_url}", flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    sys.exit(main())
