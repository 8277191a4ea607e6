"""Defaults with auth on: with ``NDIF_AUTH=1`` a farm is
shared, so the limits default to values that protect it (per-key concurrency,
queue depth, rate, payload and result sizes, open websockets per key), and the
auth cache cannot be grown, nor the key database hammered, by made-up keys.

The rules (config, the cache's bound, the database queries a flood costs) are
pinned in tests/inprocess/ndif_celery/accounts/test_auth.py; here are the attacks, by raw HTTP and the real
client, against a real stack started with ``NDIF_AUTH=1`` and nothing else
set, so every limit below is the auth-on default."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import nnsight
import psutil
import pytest
import torch
import websocket
from nnsight.intervention.backends.remote import RemoteError

from ndif_celery import config
from ndif_celery.accounts import auth, db, limits
from tests.support.clients.remote import final_status, poll, slow_job, wait_status
from tests.support.stacks.stack import client_on_stack
from tests.support.cases.tiny_model import PROMPT

MiB = 1024 * 1024
LIMITS = ("NDIF_MAX_CONCURRENT_JOBS", "NDIF_MAX_QUEUE_DEPTH", "NDIF_RATE_LIMIT_PER_MIN",
          "NDIF_MAX_RESULT_BYTES", "NDIF_MAX_PAYLOAD_BYTES", "NDIF_MAX_WEBSOCKETS_PER_KEY")
FIELDS = ("max_concurrent_jobs", "max_queue_depth", "rate_limit_per_min",
          "max_result_bytes", "max_payload_bytes", "max_websockets_per_key")


# --- config -----------------------------------------------------------------------


# --- the auth cache ---------------------------------------------------------------


# --- the attacks, against a real stack with auth on and no limit set --------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory, hf_home):
    # The lease of a dead web process's sockets at its shortest (NDIF_SOCKET_LEASE_S, not a
    # limit the auth-on defaults set), so the test of their lapse waits 10 s, not 30. Two web
    # processes, as shipped: the per-process bounds below are counted for two.
    with client_on_stack(tmp_path_factory.mktemp("auth-defaults"), hf_home,
                         {"NDIF_AUTH": "1", "NDIF_SOCKET_LEASE_S": "10", "NDIF_WEB_WORKERS": "2",
                          "NDIF_ISOLATION": "fork"}) as stack:
        yield stack


@pytest.fixture(scope="module")
def engine(stack):
    return db.engine_for(config.load(stack.env).database_url)


def _key(engine, *tags, **limits_) -> str:
    return db.create_key(engine, f"{uuid.uuid4().hex[:8]}@example.org", tags, **limits_)


def _post(stack, key, model, blob=b"not a pickle"):
    envelope = {"model_key": model.to_model_key(), "session_id": "", "compress": False, "env": {}}
    return httpx.post(
        f"{stack.url}/request", data={"data": json.dumps(envelope)},
        files={"blob": ("request", blob, "application/octet-stream")}, headers={"ndif-api-key": key}, timeout=60,
    )


def _works(model, key, monkeypatch):
    monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", key)
    with model.trace(PROMPT, remote=True):
        remote = model.transformer.h[0].output.save()
    with model.trace(PROMPT):
        local = model.transformer.h[0].output.save()
    assert torch.equal(remote, local)


def test_the_stack_runs_with_the_auth_on_defaults(stack):
    settings = config.load(stack.env)
    assert not any(v in stack.env for v in LIMITS)
    assert [getattr(settings, f) for f in FIELDS] == [config.AUTH_ON_DEFAULTS[v] for v in LIMITS]


def test_one_key_cannot_queue_more_than_its_share_nor_overfill_a_model(stack, engine, model, monkeypatch):
    """A running job holds the only worker; one key then queues jobs as fast as
    it can: the 5th is refused (4 per key); a key given more in the database
    gets its own number; more keys together stop at 32 waiting (503)."""
    monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", _key(engine, "trusted"))
    blocker = slow_job(model, 200)  # 10 s on the only worker
    wait_status(stack.url, blocker.job_id, "RUNNING", headers={"ndif-api-key": blocker.api_key})
    greedy = _key(engine, "trusted")
    taken = [_post(stack, greedy, model) for _ in range(4)]
    assert [answer.status_code for answer in taken] == [200] * 4
    refused = _post(stack, greedy, model)
    assert refused.status_code == 429
    assert "at most 4 queued or running (NDIF_MAX_CONCURRENT_JOBS)" in refused.json()["detail"]
    generous = _key(engine, "trusted", max_concurrent_jobs=6)  # the database's per-key limit wins
    assert [_post(stack, generous, model).status_code for _ in range(6)] == [200] * 6
    fillers = [_key(engine, "trusted") for _ in range(6)]
    codes = [_post(stack, key, model).status_code for key in fillers for _ in range(4)]
    assert codes[:22] == [200] * 22 and set(codes[22:]) == {503}  # 4 + 6 + 22 = 32 waiting
    full = _post(stack, _key(engine, "trusted"), model)
    assert full.status_code == 503
    assert "queue for this model is full (32 jobs waiting; NDIF_MAX_QUEUE_DEPTH=32)" in full.json()["detail"]
    poll(blocker)
    for answer in taken:  # its four end (bad payloads: ERROR), however the worker batches the queue
        final_status(stack.url, answer.json()["id"], headers={"ndif-api-key": greedy})
    _works(model, greedy, monkeypatch)  # then the greedy key is served again


def test_a_payload_over_the_default_limit_is_refused(stack, engine, model, monkeypatch):
    key = _key(engine, "trusted")
    over = _post(stack, key, model, b"x" * (64 * MiB + 1))
    assert over.status_code == 413
    assert f"at most {64 * MiB} bytes (NDIF_MAX_PAYLOAD_BYTES)" in over.json()["detail"]
    monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", key)
    monkeypatch.setattr(nnsight.CONFIG.API, "COMPRESS", False)
    noise = torch.rand(17 * MiB)  # 68 MiB of floats saved by value into the payload
    with pytest.raises(RemoteError, match="NDIF_MAX_PAYLOAD_BYTES"):
        with model.trace(PROMPT, remote=True):
            out = (model.transformer.h[0].output.sum() + noise.sum()).save()  # noqa: F841
    _works(model, key, monkeypatch)


def _open(stack, key):
    return websocket.create_connection(f"ws{stack.url[4:]}/subscribe", header={"ndif-api-key": key}, timeout=30)


def _hold(stack, key, count):
    """Open ``count`` sockets for ``key`` at once: (open sockets, refusals)."""
    def one(_):
        try:
            ws = _open(stack, key)
            json.loads(ws.recv())["session_id"]
            return ws
        except websocket.WebSocketBadStatusException as error:
            return error

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(one, range(count)))
    return ([o for o in outcomes if not isinstance(o, Exception)],
            [o for o in outcomes if isinstance(o, Exception)])


def test_one_key_cannot_hold_more_than_16_websockets(stack, engine, model, monkeypatch):
    hog, other = _key(engine, "trusted"), _key(engine, "trusted")
    held, refused = _hold(stack, hog, 100)
    try:
        assert len(held) == 16 and len(refused) == 84
        assert {e.status_code for e in refused} == {429}
        assert all("already holds 16 /subscribe websockets (NDIF_MAX_WEBSOCKETS_PER_KEY)" in str(e) for e in refused)
        _works(model, other, monkeypatch)  # other keys are unaffected
        monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", hog)
        with pytest.raises(Exception, match="Handshake status 429.*NDIF_MAX_WEBSOCKETS_PER_KEY"):
            with model.trace(PROMPT, remote=True):  # what the researcher sees
                model.transformer.h[0].output.save()
    finally:
        for ws in held:
            ws.close()
    deadline = time.monotonic() + 10
    while limits.sockets_held(_redis(stack), auth.Identity(key_id=_key_id(engine, hog))) and time.monotonic() < deadline:
        time.sleep(0.1)
    _works(model, hog, monkeypatch)  # closed sockets free their slots at once


def test_sockets_of_a_killed_web_process_do_not_count_forever(stack, engine, model, monkeypatch):
    """A web process SIGKILLed with the key's sockets open cannot release them;
    their leases lapse instead, and the key can subscribe again."""
    key = _key(engine, "trusted")
    held, refused = _hold(stack, key, 16)
    assert len(held) == 16 and not refused
    holders = {p.pid for p in _web_workers(stack)}
    for pid in holders:
        os.kill(pid, signal.SIGKILL)  # gunicorn's master starts new ones
    for ws in held:
        ws.shutdown()  # the client's end; the server's end died with its process
    identity = auth.Identity(key_id=_key_id(engine, key))
    assert limits.sockets_held(_redis(stack), identity) == 16, "nobody released them"
    stack.wait_answers()
    deadline = time.monotonic() + config.load(stack.env).socket_lease_s + 15
    while limits.sockets_held(_redis(stack), identity) and time.monotonic() < deadline:
        time.sleep(1)
    assert limits.sockets_held(_redis(stack), identity) == 0
    _works(model, key, monkeypatch)


def test_a_flood_of_made_up_keys_is_refused_and_does_not_grow_the_web(stack, engine, model, monkeypatch):
    """20000 made-up keys from one address (127.0.0.2): all refused, the web's
    memory flat; a researcher at another address, with a key the web has never
    seen, is served right after."""
    envelope = json.dumps({"model_key": model.to_model_key(), "session_id": "", "compress": False, "env": {}})

    def flood(n):
        return _raw_flood(stack.url, envelope, n, source="127.0.0.2")

    def total(results):
        codes = {}
        for result in results:
            for code, n in result.items():
                codes[code] = codes.get(code, 0) + n
        return codes

    with ThreadPoolExecutor(8) as pool:
        warm = total(pool.map(flood, [250] * 8))  # the web's steady state: 2000 made-up keys
    rss_before = sum(p.memory_info().rss for p in _web_workers(stack))
    with ThreadPoolExecutor(8) as pool:
        codes = total(pool.map(flood, [2500] * 8))
    rss_after = sum(p.memory_info().rss for p in _web_workers(stack))
    assert set(warm) | set(codes) <= {403, 429}, (warm, codes)  # all refused
    assert sum(codes.values()) == 20000
    # Only the first 60 per web process per minute were looked up (403); the rest
    # were refused without a query (429). Two processes, the run spans under 3 minutes.
    looked_up = warm.get(403, 0) + codes.get(403, 0)
    assert looked_up <= 2 * 60 * 3, f"{looked_up} of 22000 made-up keys reached the database"
    grown = rss_after - rss_before
    assert grown < 8 * MiB, f"the web grew by {grown / MiB:.1f} MiB over 20000 made-up keys"
    _works(model, _key(engine, "trusted"), monkeypatch)  # from 127.0.0.1, unaffected


# --- helpers ----------------------------------------------------------------------


def _raw_flood(url: str, envelope: str, n: int, source: str) -> dict:
    """``n`` POST /request, each with a new made-up key, from ``source``, on one
    kept-alive connection (a new one whenever the web closes it): the status
    codes counted. Raw HTTP/1.1 with the multipart body built once, as a
    flooder would write it; an HTTP client library per request spent more of
    this machine's CPU than the web it attacked."""
    import socket
    from urllib.parse import urlsplit

    address = urlsplit(url)
    boundary = uuid.uuid4().hex
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"data\"\r\n\r\n{envelope}\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"blob\"; filename=\"request\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\nx\r\n--{boundary}--\r\n").encode()
    head = (f"POST /request HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Length: {len(body)}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\nndif-api-key: ")
    codes: dict = {}
    sock, buffer = None, b""
    for _ in range(n):
        if sock is None:
            sock = socket.create_connection((address.hostname, address.port), timeout=60, source_address=(source, 0))
            buffer = b""
        sock.sendall(f"{head}{uuid.uuid4()}\r\n\r\n".encode() + body)
        while b"\r\n\r\n" not in buffer:
            chunk = sock.recv(65536)
            assert chunk, "the web closed the connection mid-response"
            buffer += chunk
        header, _, buffer = buffer.partition(b"\r\n\r\n")
        lines = header.decode("latin-1").split("\r\n")
        code = int(lines[0].split()[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(fields.get("content-length", 0))
        while len(buffer) < length:
            chunk = sock.recv(65536)
            assert chunk, "the web closed the connection mid-body"
            buffer += chunk
        buffer = buffer[length:]
        codes[code] = codes.get(code, 0) + 1
        if fields.get("connection", "").lower() == "close":
            sock.close()
            sock = None
    if sock is not None:
        sock.close()
    return codes


def _redis(stack):
    import redis

    return redis.Redis.from_url(stack.redis_url)


def _key_id(engine, key) -> int:
    return db.find_key(engine, key)["key_id"]


def _web_workers(stack) -> list:
    """The gunicorn worker processes (the master's children)."""
    return psutil.Process(stack.pids()["web"]).children()
