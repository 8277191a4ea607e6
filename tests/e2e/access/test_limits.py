"""Each limit at its edge: just under passes, just over is refused with a
message naming the limit, and the next request is fine. The client version
gate (NDIF_MIN_NNSIGHT_VERSION, NDIF_MIN_PYTHON_VERSION) is one more: this
stack's minimums are exactly this client's nnsight and Python, so the real
client is at the gate, and one that reports an older version is below it.
Each check at its edges: tests/inprocess/test_versions.py."""

from __future__ import annotations

import importlib.metadata
import json
import math
import re
import sys
import time

import httpx
import nnsight
import pytest
import torch
from nnsight.intervention.backends.remote import RemoteError

from tests.support import pace
from tests.support.remote import poll, slow_job, wait_status
from tests.support.stack import client_on_stack
from tests.support.tiny_model import PROMPT

PAYLOAD_LIMIT = 200_000
RESULT_LIMIT = 100_000
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
        "NDIF_EXECUTION_TIMEOUT_S": str(timeout_s), "NDIF_MAX_QUEUE_DEPTH": "2",
        "NDIF_MIN_NNSIGHT_VERSION": INSTALLED, "NDIF_MIN_PYTHON_VERSION": HERE,
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
    from tests.support import raw_websocket

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
