"""Request bodies that send nothing cannot take a web process's upload places.

A web process reads NDIF_WEB_UPLOADS (64) bodies at once. An attacker opens
200 ``POST /request`` sockets from a few addresses (127.0.0.x: loopback is a
whole /8), sends their headers with a Content-Length, and then nothing, and
opens another each time the server closes one. One client address holds at
most NDIF_UPLOADS_PER_ADDRESS (8) of a process's places, so the attacker's
three addresses hold 24; the rest are refused 429 from their headers, and a
researcher at 127.0.0.1 is served, exactly, while the attacker holds all it
may. With auth on the attacker spreads its bodies over eight keys as well.
A body that sends nothing is cut with 408 after NDIF_UPLOAD_FIRST_BYTE_S (2 s);
one that sent its first KiB and stalls is held for the rate's grace, and the
shares bound it just the same.

The rules in-process: tests/inprocess/web/test_uploads.py.
"""

from __future__ import annotations

import json
import re
import selectors
import socket
import threading
import time
import uuid
from urllib.parse import urlparse

import httpx
import nnsight
import pytest

from ndif_celery import config
from ndif_celery.accounts import db
from tests.support import pace
from tests.support.clients.remote import same_as_local
from tests.support.stacks.stack import client_on_stack

ATTEMPTS = 200  # the attacker's sockets open at once
ATTACK_PER_S = 100  # how fast it opens them
ATTACKER_KEYS = 8  # with auth on: 8 keys x 16 (NDIF_UPLOADS_PER_KEY) would be 128 places
BODY_BYTES = 100_000  # each body's declared size
WATCH_S = 0.25  # the web's watcher looks at its bodies this often (web.uploads.WATCH_S)


@pytest.fixture(scope="module", params=["auth off", "auth on"])
def stack(request, tmp_path_factory, hf_home):
    """A stack of the product's defaults for request bodies, auth off or on (one web process)."""
    auth_on = request.param == "auth on"
    env = {"NDIF_AUTH": "1", "NDIF_AUTH_CACHE_S": "0", "NDIF_ISOLATION": "fork"} if auth_on else {}
    with client_on_stack(tmp_path_factory.mktemp("upload-slots"), hf_home, env) as stack:
        stack.auth_on = auth_on
        stack.settings = config.load(stack.env)
        if auth_on:
            engine = db.engine_for(stack.settings.database_url)
            stack.new_key = lambda *tags: db.create_key(engine, f"{uuid.uuid4().hex[:8]}@example.org", tags)
        yield stack


@pytest.fixture
def researcher(stack, monkeypatch):
    """The real client, at 127.0.0.1, with a key of its own when auth is on."""
    if stack.auth_on:
        key = stack.new_key("trusted")
        monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", key)
        return key
    return None


def _start_upload(stack, key: str | None, source: str, begin: bool = False) -> socket.socket:
    """A ``POST /request`` from ``source`` whose headers are sent and whose body
    is not (``begin``: but its first KiB)."""
    where = urlparse(stack.url)
    sock = socket.create_connection((where.hostname, where.port), timeout=30, source_address=(source, 0))
    head = ["POST /request HTTP/1.1", f"Host: {where.netloc}", *([f"ndif-api-key: {key}"] if key else []),
            "Content-Type: multipart/form-data; boundary=xyz", f"Content-Length: {BODY_BYTES}"]
    sent = ("\r\n".join(head) + "\r\n\r\n").encode()
    if begin:
        sent += b"--xyz\r\n" + b"x" * 1017
    sock.sendall(sent)
    return sock


def _answer(sock: socket.socket, within_s: float) -> tuple[int, str]:
    """The status and body of the server's answer on ``sock``; fails if none comes in ``within_s``."""
    sock.settimeout(within_s)
    got = b""
    try:
        while True:
            head, found, body = got.partition(b"\r\n\r\n")
            length = re.search(rb"content-length: *(\d+)", head, re.I) if found else None
            if length and len(body) >= int(length.group(1)):
                break
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    except socket.timeout:
        raise AssertionError(f"no answer in {within_s:.1f} s (sent only headers); got {got[:200]!r}") from None
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), got[:200]
    return int(head.split()[1]), body.decode(errors="replace")


class Attack:
    """``ATTEMPTS`` upload sockets kept open from ``sources`` (and ``keys``), each
    held until the server closes it, then opened again; what each got, and when."""

    def __init__(self, stack, sources: tuple, keys: list, begin: bool) -> None:
        self.stack, self.sources, self.keys, self.begin = stack, sources, keys or [None], begin
        self.answers: list[tuple[float, float, int]] = []  # (opened, answered, status)
        self.opened = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Attack":
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stopped.set()
        self.thread.join(30)

    def _open(self, selector) -> None:
        n = self.opened
        sock = _start_upload(self.stack, self.keys[n % len(self.keys)], self.sources[n % len(self.sources)], self.begin)
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, data={"opened": time.monotonic(), "got": b"", "status": None})
        self.opened += 1

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        next_open = time.monotonic()
        try:
            while not self.stopped.is_set():
                now = time.monotonic()
                while len(selector.get_map()) < ATTEMPTS and now >= next_open:
                    self._open(selector)
                    next_open += 1 / ATTACK_PER_S
                for ready, _ in selector.select(timeout=0.01):
                    state = ready.data
                    try:
                        chunk = ready.fileobj.recv(65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        chunk = b""
                    if chunk and state["status"] is None:
                        state["got"] += chunk
                        if b"\r\n" in state["got"]:
                            state["status"] = int(state["got"].split()[1])
                            self.answers.append((state["opened"], time.monotonic(), state["status"]))
                    if not chunk:  # closed by the server: held no longer, open another
                        selector.unregister(ready.fileobj)
                        ready.fileobj.close()
                        if state["status"] is None:
                            self.answers.append((state["opened"], time.monotonic(), 0))
        finally:
            stopped = time.monotonic()
            for key in list(selector.get_map().values()):
                if key.data["status"] is None:  # still being read when the attack stopped
                    self.answers.append((key.data["opened"], stopped, 0))
                key.fileobj.close()
            selector.close()

    def held(self, at: float) -> int:
        """Bodies the web was reading at ``at``: those it later cut with 408 (or never answered)."""
        return sum(1 for opened, answered, status in list(self.answers)
                   if status in (408, 0) and opened <= at < answered)

    def statuses(self) -> dict:
        counts: dict = {}
        for _, _, status in list(self.answers):
            counts[status] = counts.get(status, 0) + 1
        return dict(sorted(counts.items()))


@pytest.mark.parametrize("begin", [False, True], ids=["sending nothing", "stalled after a KiB"])
def test_a_few_addresses_of_stalled_bodies_leave_upload_places_to_everyone(stack, model, researcher, begin):
    """200 bodies at once from three addresses (and eight keys with auth on),
    kept up for as long as the researcher's trace takes: the attacker holds
    its three shares at most, the rest are refused 429 unread, and the
    researcher's upload is accepted and its trace exact."""
    share = stack.settings.uploads_per_address
    sources = ("127.0.0.6", "127.0.0.7", "127.0.0.8") if begin else ("127.0.0.2", "127.0.0.3", "127.0.0.4")
    keys = [stack.new_key() for _ in range(ATTACKER_KEYS)] if stack.auth_on else []
    envelope = {"model_key": model.to_model_key(), "session_id": "", "compress": False, "env": {}}
    with Attack(stack, sources, keys, begin) as attack:
        time.sleep(ATTEMPTS / ATTACK_PER_S + 0.5)  # all 200 sent, and the web has read their headers
        started = time.monotonic()
        same_as_local(model)
        traced = time.monotonic()
        raw = httpx.post(f"{stack.url}/request", data={"data": json.dumps(envelope)},
                         files={"blob": ("request", b"not a pickle", "application/octet-stream")},
                         headers={"ndif-api-key": researcher} if researcher else {}, timeout=pace.bound(10))
        finished = time.monotonic()
        time.sleep(WATCH_S)
    moments = [started + (finished - started) * i / 20 for i in range(21)]
    during = [attack.held(at) for at in moments]
    statuses = attack.statuses()
    print(f"\n[{'auth on' if stack.auth_on else 'auth off'}, bodies {'stalled after a KiB' if begin else 'sending nothing'}] "
          f"{attack.opened} upload sockets opened from {len(sources)} addresses"
          f"{f' with {len(keys)} keys' if keys else ''}; answers by status {statuses} (0: never answered); "
          f"held during the researcher's trace and POST: {min(during)}..{max(during)} of "
          f"{stack.settings.web_uploads} places; trace {traced - started:.2f} s, "
          f"POST /request {raw.status_code} in {finished - traced:.2f} s; {pace.describe()}")
    assert raw.status_code == 200, raw.text  # past the upload's admission: the job was accepted
    assert attack.opened >= ATTEMPTS
    assert statuses.get(429, 0) > ATTEMPTS // 2 and not statuses.get(503), statuses
    # Counted at the attacker, from a socket's headers until it reads the answer, which it
    # may read late: a body cut and the one admitted in its place can overlap there, so this
    # says the attacker held at least its shares. That it holds no more: the 429s above, and
    # tests/inprocess/web/test_uploads.py.
    assert max(during) >= len(sources) * share, "the attacker held its shares while the researcher was served"
    assert all(status in (408, 429, 0) for status in statuses), statuses
    same_as_local(model)


def test_a_body_that_sends_nothing_is_cut_with_408_at_the_first_byte_deadline(stack, researcher):
    deadline_s = stack.settings.upload_first_byte_s
    assert deadline_s == 2.0, "the default"
    started = time.monotonic()
    status, body = _answer(_start_upload(stack, researcher, "127.0.0.5"), within_s=pace.bound(deadline_s + 5))
    waited = time.monotonic() - started
    print(f"\n[{'auth on' if stack.auth_on else 'auth off'}] a body that sent nothing was answered {status} "
          f"{waited:.2f} s after its headers (NDIF_UPLOAD_FIRST_BYTE_S={deadline_s:g}, the watcher looks every "
          f"{WATCH_S} s); {pace.describe()}")
    assert status == 408 and "NDIF_UPLOAD_FIRST_BYTE_S" in body and "did not begin" in body, (status, body)
    assert deadline_s <= waited <= deadline_s + WATCH_S + pace.bound(0.5), f"cut {waited:.2f} s after its headers"
