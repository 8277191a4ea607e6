"""A flood of malformed packets and requests against a real stack leaves the
web's logs within their disk budget.

Each malformed thing a client sends may cost the web a log record, some a
traceback of a few KiB: a websocket upgrade without its key is one
(wsproto refuses it inside the request). So the web passes a few records of
each source per window and counts the rest (``ndif_celery.log_limits``), and
``up``'s supervisor rotates every log at ``NDIF_LOG_MAX_BYTES`` keeping
``NDIF_LOG_BACKUPS`` copies (``ndif_celery.host.log_rotation``). Here, on a
stack with a small budget: 5,000 one-byte messages on Socket.IO websockets
(a new socket whenever one is closed), then 5,000 upgrades without a key.
Every file of the web's log stays within its size, the tracebacks are a few
with one line counting the rest, ``/ping`` still answers, and ``ndif-celery
logs web -f`` goes on across the rotations.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest

from ndif_celery.host import log_rotation
from tests.support.clients import raw_websocket
from tests.support.paths import ROOT
from tests.support.stacks.stack import Stack

MAX_BYTES = 64 * 1024
BACKUPS = 2
BUDGET = MAX_BYTES * (BACKUPS + 1)
REPEATS = 5
WINDOW_S = 5
MESSAGES = 5000
UPGRADES = 5000
SIO_PATH = "/ws/socket.io/?EIO=4&transport=websocket"
# One byte each: an engine.io MESSAGE with no Socket.IO packet, a packet type
# that does not exist, a NUL, and (as a binary frame) a byte engine.io never expects.
MALFORMED = ((b"4", 0x1), (b"x", 0x1), (b"\x00", 0x1), (b"4", 0x2))
COUNTED = re.compile(r"repeated ([\d,]+) more times? in the last")


@pytest.fixture(scope="module", params=["0", "1"], ids=["auth off", "auth on"])
def stack(tmp_path_factory, request):
    env = {"NDIF_LOG_MAX_BYTES": MAX_BYTES, "NDIF_LOG_BACKUPS": BACKUPS, "NDIF_AUTH": request.param,
           "NDIF_LOG_REPEATS": REPEATS, "NDIF_LOG_REPEAT_WINDOW_S": WINDOW_S}
    with Stack(tmp_path_factory.mktemp("log-flood"), env, warm=True) as running:
        yield running


def _web_files(stack) -> dict[str, int]:
    return {path.name: path.stat().st_size for path in log_rotation.files_of(stack.logs_dir / "web.log")}


def _flood_socketio(stack, messages: int) -> dict:
    """``messages`` one-byte messages on Socket.IO websockets, a new socket
    whenever the server closed one (or refused it: then a moment later)."""
    sent = sockets = refused = wire = 0
    deadline = time.monotonic() + 120
    while sent < messages and time.monotonic() < deadline:
        sock, head = raw_websocket.upgrade(stack.url, path=SIO_PATH)
        with sock:
            if not head.startswith("HTTP/1.1 101"):
                refused += 1
                time.sleep(0.02)
                continue
            sockets += 1
            try:
                while sent < messages:
                    payload, opcode = MALFORMED[sent % len(MALFORMED)]
                    data = raw_websocket.frame(payload, opcode)
                    sock.sendall(data)
                    sent += 1
                    wire += len(data)
            except OSError:
                pass  # closed by the server: the next socket goes on
    return {"messages": sent, "sockets": sockets, "refused": refused, "bytes": wire}


def _flood_upgrades(stack, count: int) -> dict:
    """``count`` websocket upgrades without Sec-WebSocket-Key/-Version, on both websocket paths."""
    codes: dict[str, int] = {}
    wire = 0
    for n in range(count):
        path = SIO_PATH if n % 2 else "/subscribe"
        request = (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                   "Connection: Upgrade\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", stack.api_port), timeout=30) as sock:
            sock.sendall(request)
            wire += len(request)
            try:
                code = sock.recv(64)[9:12].decode(errors="replace") or "closed"
            except OSError:
                code = "reset"
        codes[code] = codes.get(code, 0) + 1
    return {"requests": count, "bytes": wire, "answers": codes}


class Follower:
    """``ndif-celery logs web -f``, its output gathered as it comes."""

    def __init__(self, stack) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "ndif_celery.cli", "logs", "web", "-f", "-n", "0"],
                                     cwd=ROOT, env=stack.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.text = ""
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, b""):
            self.text += line.decode(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def _within_budget(stack, when: str) -> dict[str, int]:
    """The web's log files, at rest: all of them within the budget, the log itself under its size."""
    files = _web_files(stack)
    print(f"web log files {when}: {files} = {sum(files.values()):,} bytes (budget {BUDGET:,})")
    assert sum(files.values()) <= BUDGET, f"{when}: {files}"
    assert files["web.log"] < MAX_BYTES and len(files) <= BACKUPS + 1, f"{when}: {files}"
    return files


def _shows_a_request(stack, follower: Follower, when: str) -> None:
    """``/ping`` answers, and its access line reaches the follower (asked
    again each second: the follower starts from the end of the log as it
    finds it, once its command has started)."""
    markers: list[str] = []

    def shown() -> bool:
        markers.append(uuid.uuid4().hex)
        assert httpx.get(f"{stack.url}/ping", params={"marker": markers[-1]}, timeout=10).status_code == 200
        time.sleep(1.0)
        return any(marker in follower.text for marker in markers)

    stack.until(shown, f"`ndif-celery logs web -f` to show a request {when}", timeout_s=30)


def test_a_flood_of_malformed_packets_and_upgrades_leaves_the_web_log_within_its_budget(stack):
    follower = Follower(stack)
    try:
        _shows_a_request(stack, follower, "before the flood")
        before = _web_files(stack)
        started = time.monotonic()
        sio = _flood_socketio(stack, MESSAGES)
        upgrades = _flood_upgrades(stack, UPGRADES)
        flood_s = time.monotonic() - started
        print(f"\nsent {sio['messages']:,} one-byte Socket.IO messages ({sio['bytes']:,} bytes on "
              f"{sio['sockets']:,} sockets, {sio['refused']} refused) and {upgrades['requests']:,} upgrades "
              f"without a key ({upgrades['bytes']:,} bytes, answers {upgrades['answers']}) in {flood_s:.1f} s")
        assert sio["messages"] >= MESSAGES and upgrades["requests"] >= UPGRADES

        time.sleep(1.0)  # the supervisor's next looks
        _within_budget(stack, "right after the flood")
        # The counts of the sources past their burst come as their windows end.
        stack.until(lambda: COUNTED.search(follower.text), "a line counting the repeats", timeout_s=WINDOW_S * 6)
        time.sleep(1.0)
        files = _within_budget(stack, "once the counts came")
        written = follower.text  # all the web logged meanwhile, rotated away or not
        counts = [int(n.replace(",", "")) for n in COUNTED.findall(written)]
        tracebacks = written.count("Traceback (most recent call last)")
        print(f"web log files before: {before}; the web wrote {len(written):,} bytes meanwhile: "
              f"{tracebacks} tracebacks, {sum(counts):,} records left out and counted in {len(counts)} lines")
        assert "web.log.1" in files, "the flood filled the log past its size: it was rotated"
        windows = int(flood_s // WINDOW_S) + 2
        assert 0 < tracebacks <= REPEATS * windows * 4, "a few per source and window, not one per request"
        assert sum(counts) > tracebacks, "the records left out are counted"

        _shows_a_request(stack, follower, "after the flood")
        assert follower.proc.poll() is None
    finally:
        follower.stop()
