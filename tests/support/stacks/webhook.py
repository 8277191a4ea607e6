"""A webhook receiver for the alert tests: a real HTTP server on a fixed loopback
port that can be stopped (the port refuses connections) and started again on
the same port, or made to answer another status or only after a while.

``tests.support.stacks.servers.Receiver`` is the plain one (always up, one status)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.support.stacks.servers import free_ports


class Hook:
    """``received``: the JSON bodies it answered 200 to. ``status`` and ``hang_s``
    apply to a POST as they were when it arrived; its path holds a token, as a
    real webhook's does, for the tests that check it is never shown."""

    def __init__(self) -> None:
        [self.port] = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}/hook/secret-token?key=also-secret"
        self.received: list = []
        self.status = 200
        self.hang_s = 0.0
        self.server = None

    def start(self) -> "Hook":
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                status, hang_s = hook.status, hook.hang_s
                body = self.rfile.read(int(self.headers["Content-Length"]))
                time.sleep(hang_s)
                if status == 200:
                    hook.received.append(json.loads(body))
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
