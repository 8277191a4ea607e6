"""Each limit at its edge: just under passes, just over is refused with a
message naming the limit, and the next request is fine. The client version
gate (NDIF_MIN_NNSIGHT_VERSION, NDIF_MIN_PYTHON_VERSION) is one more: this
stack's minimums are exactly this client's nnsight and Python, so the real
client is at the gate, and one that reports an older version is below it.
Each check at its edges: tests/inprocess/ndif_celery/policy/test_client_versions.py.

Request bodies are attacked by raw HTTP: a body is refused unread when its
key may not send it, a key has a few uploads in flight at most, a trickled
body is cut at its deadline, and thousands of stalled uploads from one key
leave the web answering everyone else."""

from __future__ import annotations

import importlib.metadata
import json
import math
import re
import selectors
import socket
import sys
import threading
import time
from urllib.parse import urlparse

import httpx
import nnsight
import pytest
import redis
import torch
from nnsight.intervention.backends.remote import RemoteError

from ndif_celery import config
from tests.support import pace
from tests.support.clients.remote import final_status, poll, slow_job, wait_status
from tests.support.stacks.stack import client_on_stack
from tests.support.cases.tiny_model import PROMPT
from tests.support.waiting import wait_until

PAYLOAD_LIMIT = 200_000
UPLOAD_GRACE_S = 3  # how far a body may fall behind NDIF_UPLOAD_MIN_BYTES_PER_S
WEB_CONNECTIONS = 400  # the web's connection slots: what slow uploads would take from everyone
RESULT_LIMIT = 100_000
RESULT_QUOTA = 250_000  # a key's stored results: two of 90 kB, not three
TIMEOUT_BASE_S = 5  # the execution timeout on an idle reference machine (scaled in the fixture)
INSTALLED = importlib.metadata.version("nnsight")
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"
# What the real client sends with every request (the raw requests below send it too).
VERSION_HEADERS = {"nnsight-version": INSTALLED, "python-version": sys.version}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, hf_home):
    # Every job here must finish within the execution timeout, a trivial trace
    # included: on a loaded machine one took over 3 s, so the limit grows with it.
    timeout_s = math.ceil(pace.bound(TIMEOUT_BASE_S))
    env = {
        "NDIF_AUTH": "1", "NDIF_AUTH_CACHE_S": "0", "NDIF_ISOLATION": "fork",  # no zygote is the subject here
        "NDIF_MAX_PAYLOAD_BYTES": str(PAYLOAD_LIMIT), "NDIF_MAX_RESULT_BYTES": str(RESULT_LIMIT),
        "NDIF_RESULT_QUOTA_BYTES": str(RESULT_QUOTA),
        "NDIF_EXECUTION_TIMEOUT_S": str(timeout_s), "NDIF_MAX_QUEUE_DEPTH": "2",
        "NDIF_MIN_NNSIGHT_VERSION": INSTALLED, "NDIF_MIN_PYTHON_VERSION": HERE,
        "NDIF_UPLOAD_GRACE_S": str(UPLOAD_GRACE_S), "NDIF_WEB_CONNECTIONS": str(WEB_CONNECTIONS),
        # A key's uploads across every web are the subject here, not its share of one web process.
        "NDIF_WEB_UPLOADS_PER_KEY": "0",
    }
    with client_on_stack(tmp_path_factory.mktemp("limits"), hf_home, env) as stack:
        stack.timeout_s = timeout_s
        yield stack


def make_key(stack, *flags) -> str:
    result = stack.cli("keys", "create", "--email", "limits@example.org", *flags)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture
def trusted_key(stack, monkeypatch):
    key = make_key(stack, "--trusted")
    monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", key)
    return key


def _post(stack, key, model, blob):
    envelope = {"model_key": model.to_model_key(), "session_id": "", "compress": False, "env": {}}
    return httpx.post(
        f"{stack.url}/request", data={"data": json.dumps(envelope)},
        files={"blob": ("request", blob, "application/octet-stream")},
        headers={"ndif-api-key": key, **VERSION_HEADERS},
    )


def _works(model):
    with model.trace(PROMPT, remote=True):
        remote = model.transformer.h[0].output.save()
    with model.trace(PROMPT):
        local = model.transformer.h[0].output.save()
    assert torch.equal(remote, local)


def test_payload_size(stack, model, trusted_key, monkeypatch):
    assert _post(stack, trusted_key, model, b"x" * PAYLOAD_LIMIT).status_code == 200
    over = _post(stack, trusted_key, model, b"x" * (PAYLOAD_LIMIT + 1))
    assert over.status_code == 413
    assert f"at most {PAYLOAD_LIMIT} bytes (NDIF_MAX_PAYLOAD_BYTES)" in over.json()["detail"]
    monkeypatch.setattr(nnsight.CONFIG.API, "COMPRESS", False)
    noise = torch.rand(PAYLOAD_LIMIT // 4)
    with pytest.raises(RemoteError, match="NDIF_MAX_PAYLOAD_BYTES"):
        with model.trace(PROMPT, remote=True):
            out = (model.transformer.h[0].output.sum() + noise.sum()).save()  # noqa: F841
    _works(model)


def test_result_size(stack, model, trusted_key, monkeypatch):
    monkeypatch.setattr(nnsight.CONFIG.API, "COMPRESS", False)
    with model.trace(PROMPT, remote=True) as tracer:
        under = nnsight.save(torch.zeros(RESULT_LIMIT - 4000, dtype=torch.uint8))
    assert under.numel() == RESULT_LIMIT - 4000 and tracer.backend.meta["result_bytes"] <= RESULT_LIMIT
    with pytest.raises(RemoteError, match=f"over this server's limit of {RESULT_LIMIT} bytes"):
        with model.trace(PROMPT, remote=True):
            over = nnsight.save(torch.zeros(RESULT_LIMIT, dtype=torch.uint8))  # noqa: F841
    _works(model)


def _stored_job(model):
    """A non-blocking job (its result is stored, not sent inline) saving 90 kB."""
    with model.trace(PROMPT, remote=True, blocking=False) as tracer:
        data = nnsight.save(torch.randint(0, 256, (90_000,), dtype=torch.uint8))  # noqa: F841 (incompressible)
    return tracer.backend


def test_stored_results_are_bounded_per_key(stack, model, monkeypatch):
    """NDIF_RESULT_QUOTA_BYTES: the job whose result would take its key's
    stored results over the quota ends with an error naming the quota and what
    the key keeps; its earlier results still download, and another key's jobs
    are not counted against it."""
    monkeypatch.setattr(nnsight.CONFIG.API, "COMPRESS", False)
    key = make_key(stack, "--trusted")
    monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", key)
    kept = [_stored_job(model) for _ in range(2)]
    for backend in kept:
        poll(backend)
    with pytest.raises(RemoteError, match="NDIF_RESULT_QUOTA_BYTES") as caught:
        poll(_stored_job(model))
    detail = str(caught.value)
    used = int(re.search(r"already hold (\d+) bytes", detail).group(1))
    assert f"quota of {RESULT_QUOTA} bytes" in detail and 180_000 < used <= RESULT_QUOTA, detail
    for backend in kept:
        latest = final_status(stack.url, backend.job_id, headers={"ndif-api-key": key})
        assert latest["status"] == "COMPLETED" and httpx.get(latest["data"], timeout=30).status_code == 200
    monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", make_key(stack, "--trusted"))
    for _ in range(2):
        poll(_stored_job(model))


@pytest.mark.parametrize("trusted", [True, False], ids=["in-process", "isolated"])
def test_execution_timeout(stack, model, monkeypatch, trusted):
    monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", make_key(stack, *(["--trusted"] if trusted else [])))
    with model.trace(PROMPT, remote=True) as tracer:
        out = model.transformer.h[0].output.save()  # noqa: F841
        for _ in range(20):
            time.sleep(0.05)  # 1 s: under the limit
    assert tracer.backend.meta["isolated"] is not trusted
    started, limit = time.monotonic(), stack.timeout_s
    with pytest.raises(RemoteError, match=f"exceeded the execution timeout of {limit}s"):
        with model.trace(PROMPT, remote=True):
            out = model.transformer.h[0].output.save()  # noqa: F841
            for _ in range(int((limit + 5) / 0.05)):
                time.sleep(0.05)  # 5 s over it
    assert time.monotonic() - started < limit + pace.bound(5)
    _works(model)


def _wait_for_minute_start():
    """Rate windows are calendar minutes: start a burst well inside one."""
    if time.time() % 60 > 45:
        time.sleep(61 - time.time() % 60)


def test_rate_limit_per_key(stack, model, monkeypatch):
    key = make_key(stack, "--trusted", "--rate-limit", "3")
    monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", key)
    _wait_for_minute_start()
    for _ in range(3):
        _works(model)
    with pytest.raises(RemoteError, match="at most 3 requests per minute"):
        _works(model)
    monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", make_key(stack, "--trusted"))
    _works(model)  # other keys are not affected


def test_handshakes_that_submit_nothing_count_against_the_keys_rate(stack, model, monkeypatch):
    """A key may not open /subscribe sockets it never submits on faster than
    twice its rate: the handshakes have a window of their own."""
    from tests.support.clients import raw_websocket

    key = make_key(stack, "--trusted", "--rate-limit", "3")
    _wait_for_minute_start()
    opened = []
    try:
        for _ in range(6):  # twice the key's rate: a client within its rate never meets this bound
            sock, head = raw_websocket.upgrade(stack.url, {"ndif-api-key": key})
            opened.append(sock)
            assert head.startswith("HTTP/1.1 101"), head
        sock, head = raw_websocket.upgrade(stack.url, {"ndif-api-key": key})
        opened.append(sock)
        assert head.startswith("HTTP/1.1 429") and "at most 6 per minute" in head, head
    finally:
        for sock in opened:
            sock.close()
    monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", make_key(stack, "--trusted"))
    _works(model)  # other keys are not affected


def test_concurrent_jobs_per_key(stack, model, monkeypatch):
    key = make_key(stack, "--trusted", "--max-concurrent", "2")
    monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", key)
    first, second = slow_job(model, 30), slow_job(model, 1)
    with pytest.raises(RemoteError, match="at most 2 queued or running"):
        slow_job(model, 1)
    poll(first)
    poll(second)
    poll(slow_job(model, 1))  # room again


def test_queue_depth_per_model(stack, model, monkeypatch):
    monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", make_key(stack, "--trusted"))
    running = slow_job(model, 40)  # 2 s on the only worker
    wait_status(stack.url, running.job_id, "RUNNING", headers={"ndif-api-key": running.api_key})
    waiting = [slow_job(model, 1), slow_job(model, 1)]  # the queue now holds 2
    with pytest.raises(RemoteError, match="queue for this model is full"):
        slow_job(model, 1)
    for backend in [running, *waiting]:
        poll(backend)
    _works(model)


# -- the client version gate --


def _below(version: str) -> str:
    """A version just below ``version`` (its last part one less, or the one before it)."""
    parts = [int(p) for p in re.findall(r"\d+", version)[:3]]
    for i in reversed(range(len(parts))):
        if parts[i] > 0:
            parts[i] -= 1
            return ".".join(map(str, parts))
    raise ValueError(f"nothing is below {version}")


def test_client_below_the_minimum_raises_with_the_message(stack, model, trusted_key, monkeypatch):
    from nnsight.intervention.backends import remote

    older = _below(INSTALLED)
    # The real client, reporting an older nnsight: the header is all the server reads of it.
    monkeypatch.setattr(remote, "_NNSIGHT_VERSION", older)
    message = (f"Client nnsight version {older} is below the minimum supported {INSTALLED}. "
               "Please `pip install --upgrade nnsight`.")
    for blocking in (True, False):
        with pytest.raises(RemoteError) as caught:
            with model.trace(PROMPT, remote=True, blocking=blocking):
                model.transformer.h[0].output.save()
        assert message in str(caught.value), (blocking, str(caught.value))
    # A new enough nnsight on an old python: the python message.
    old_python = f"{_below(HERE)} (main, Jan  1 2020, 00:00:00) [GCC 9.0.0]"
    envelope = {"model_key": model.to_model_key(), "session_id": "", "compress": False, "env": {}}
    response = httpx.post(
        f"{stack.url}/request", data={"data": json.dumps(envelope)},
        files={"blob": ("request", b"x", "application/octet-stream")},
        headers={"nnsight-version": INSTALLED, "python-version": old_python, "ndif-api-key": trusted_key},
        timeout=30,
    )
    assert response.status_code == 400
    assert response.json() == {"detail": f"Client python version {_below(HERE)} is below the minimum supported "
                                         f"{HERE}. Please update python."}


def test_client_at_the_minimum_works(stack, model, trusted_key):
    with model.trace(PROMPT, remote=True):
        remote = model.transformer.h[0].output.save()
    with model.trace(PROMPT):
        local = model.transformer.h[0].output.save()
    assert torch.equal(remote, local)


# -- request bodies --


def _start_upload(stack, key: str, length: int, chunked: bool = False, source: str = "127.0.0.1",
                  begin: bool = False) -> socket.socket:
    """A ``POST /request`` from ``source`` whose headers are sent and whose body
    is not (``begin``: but its first KiB, so it is not cut at NDIF_UPLOAD_FIRST_BYTE_S): its socket."""
    where = urlparse(stack.url)
    sock = socket.create_connection((where.hostname, where.port), timeout=30, source_address=(source, 0))
    size = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}"
    head = ["POST /request HTTP/1.1", f"Host: {where.netloc}", f"ndif-api-key: {key}",
            *(f"{name}: {value}" for name, value in VERSION_HEADERS.items()),
            "Content-Type: multipart/form-data; boundary=xyz", size]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + (b"--xyz\r\n" + b"x" * 1017 if begin else b""))
    return sock


def _answer(sock: socket.socket, within_s: float) -> tuple[int, str]:
    """The status and body of the server's answer on ``sock``; fails if none comes in ``within_s``."""
    sock.settimeout(within_s)
    got = b""
    try:
        while True:
            head, _, body = got.partition(b"\r\n\r\n")
            if _:
                length = re.search(rb"content-length: *(\d+)", head, re.I)
                if length and len(body) >= int(length.group(1)):
                    break
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    except socket.timeout:
        raise AssertionError(f"no answer in {within_s:.0f} s (sent only headers); got {got[:200]!r}") from None
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), got[:200]
    return int(head.split()[1]), body.decode(errors="replace")


def test_a_body_is_refused_unread_when_its_key_may_not_send_it(stack, model, monkeypatch):
    """Over its rate, the request is answered from its headers: the server
    reads none of the body (none is sent), and a body with no declared size is refused."""
    key = make_key(stack, "--trusted", "--rate-limit", "1")
    monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", key)
    _wait_for_minute_start()
    _works(model)
    status, body = _answer(_start_upload(stack, key, 100_000), within_s=pace.bound(5))
    assert status == 429 and "at most 1 requests per minute" in body, (status, body)
    status, body = _answer(_start_upload(stack, make_key(stack), 0, chunked=True), within_s=pace.bound(5))
    assert status == 411 and "Content-Length" in body, (status, body)


def test_slow_bodies_are_cut_at_their_deadline_and_bounded_per_key(stack, model, monkeypatch):
    """NDIF_UPLOADS_PER_KEY (its auth-on default) bodies in flight per key: the
    next is refused at once. Those in flight, begun and then stalled, are cut at
    their deadline, a trickled one too (ten bytes a second), and the key's uploads
    are counted no longer. They come from two addresses, and the next from a
    third: NDIF_UPLOADS_PER_ADDRESS is tests/e2e/api/test_upload_slots.py's."""
    in_flight = config.AUTH_ON_DEFAULTS["NDIF_UPLOADS_PER_KEY"]
    key = make_key(stack)
    started = time.monotonic()
    uploads = [_start_upload(stack, key, 100_000, source=f"127.0.1.{n % 2 + 1}", begin=True) for n in range(in_flight)]
    client = redis.Redis.from_url(stack.redis_url)
    try:  # all admitted (each counted in its key's uploads) before the next is sent
        wait_until(lambda: [client.zcard(name) for name in client.keys("ndif:uploads:*")] == [in_flight],
                   pace.bound(5), "the uploads to be admitted")
    finally:
        client.close()
    status, body = _answer(_start_upload(stack, key, 100_000, source="127.0.1.3"), within_s=pace.bound(5))
    assert status == 429 and "NDIF_UPLOADS_PER_KEY" in body, (status, body)

    def trickle(sock):
        try:
            while True:
                sock.sendall(b"x")
                time.sleep(0.1)
        except OSError:  # cut, or closed by the test
            pass

    threading.Thread(target=trickle, args=(uploads[0],), daemon=True).start()
    answers = [_answer(sock, within_s=UPLOAD_GRACE_S + pace.bound(10)) for sock in uploads]
    waited = time.monotonic() - started
    for status, body in answers:
        assert status == 408 and "NDIF_UPLOAD_MIN_BYTES_PER_S" in body, (status, body)
    assert waited >= UPLOAD_GRACE_S, f"cut after {waited:.1f} s, before the grace"
    monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", key)
    _works(model)  # the key's uploads in flight were released


ATTACK_UPLOADS = 2000
ATTACK_PER_S = 100


def _ping_s(stack) -> float:
    started = time.monotonic()
    assert httpx.get(f"{stack.url}/ping", timeout=pace.bound(2)).json() == "pong"
    return time.monotonic() - started


def test_thousands_of_stalled_uploads_from_one_key_leave_the_web_to_everyone(stack, model, monkeypatch):
    """One key starts thousands of uploads from its own address and never sends
    their bodies, holding every socket the server leaves open (WEB_CONNECTIONS
    are the web's slots). /ping stays at its usual latency and another key's
    trace is exact."""
    attacker = make_key(stack)
    monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", make_key(stack, "--trusted"))
    _works(model)
    usual = sorted(_ping_s(stack) for _ in range(10))[5]
    done, opened, most_held = threading.Event(), [0], [0]

    def attack():
        held = selectors.DefaultSelector()
        try:
            while opened[0] < ATTACK_UPLOADS:
                held.register(_start_upload(stack, attacker, 100_000, source="127.0.0.2"), selectors.EVENT_READ)
                opened[0] += 1
                for ready, _ in held.select(timeout=0):  # held until the server closes it
                    try:
                        closed = not ready.fileobj.recv(65536)
                    except OSError:
                        closed = True
                    if closed:
                        held.unregister(ready.fileobj)
                        ready.fileobj.close()
                most_held[0] = max(most_held[0], len(held.get_map()))
                time.sleep(1 / ATTACK_PER_S)
        finally:
            done.set()
            for sock in list(held.get_map().values()):
                sock.fileobj.close()

    threading.Thread(target=attack, daemon=True).start()
    during = []
    traced = False
    while not done.is_set():
        during.append(_ping_s(stack))
        if not traced and opened[0] > WEB_CONNECTIONS:  # the web's slots all taken, were they held
            _works(model)
            traced = True
        time.sleep(0.2)
    assert traced and opened[0] == ATTACK_UPLOADS
    print(f"/ping p50 {usual * 1000:.1f} ms before, {sorted(during)[len(during) // 2] * 1000:.1f} ms during "
          f"(worst {max(during) * 1000:.0f} ms) {ATTACK_UPLOADS} stalled uploads; the attacker held at most "
          f"{most_held[0]} sockets; {pace.describe()}")
    assert max(during) < pace.bound(1.0), "a /ping waited behind the stalled uploads"
