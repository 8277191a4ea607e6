"""Auth on (``NDIF_AUTH=1``), on SQLite and on PostgreSQL: keys made with the
CLI, requests without a key, with a revoked key, and for another key's job are
refused with NDIF's messages; with a valid key everything works, and the key
decides whether a job runs in-process (trusted) or isolated."""

from __future__ import annotations

import json
import uuid

import httpx
import nnsight
import pytest
import torch
from nnsight.intervention.backends.remote import RemoteBackend, RemoteError

from tests.support.clients import raw_websocket
from tests.support.clients.remote import client_pointed_at, poll
from tests.support.stacks.servers import postgres_database
from tests.support.stacks.stack import client_on_stack
from tests.support.stacks.stack_pool import AUTH_LIMITS_OFF
from tests.support.cases.tiny_model import PROMPT


@pytest.fixture(scope="module", params=[pytest.param("sqlite", marks=pytest.mark.pools("auth")), "postgresql"])
def stack(request, tmp_path_factory, hf_home):
    """The shared auth farm (SQLite keys; tests/support/stacks/stack_pool.py), and a
    stack of the same settings whose keys live in PostgreSQL."""
    if request.param == "sqlite":
        stack = request.getfixturevalue("stack_pool").get("auth")
        with client_pointed_at(stack.url):
            yield stack
        return
    url, drop = postgres_database()
    env = {"NDIF_AUTH": "1", "NDIF_AUTH_CACHE_S": "0", "NDIF_ISOLATION": "fork", **AUTH_LIMITS_OFF,
           "NDIF_DATABASE_URL": url}
    try:
        with client_on_stack(tmp_path_factory.mktemp("auth-postgresql"), hf_home, env) as stack:
            yield stack
    finally:
        drop()


def make_key(stack, email, *flags) -> str:
    result = stack.cli("keys", "create", "--email", email, *flags)
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip().splitlines()[-1]
    uuid.UUID(key)  # alone on its last line, and a UUID as NDIF's are
    return key


@pytest.fixture
def use_key(monkeypatch):
    def use(key):
        monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", key)

    return use


def _trace(model):
    with model.trace(PROMPT, remote=True) as tracer:
        hidden = model.transformer.h[1].output.save()
    return hidden, tracer.backend.meta


@pytest.mark.parametrize("key, said", [
    (None, "Failed to send request: Missing or invalid API key. Set one with"),
    ("not-a-uuid", "Failed to send request: Invalid API key format: the key sent is not one this server issues"),
    ("0b0e6f3c-9d2a-4f6e-8a51-3c2d1e0f9a7b", "Failed to send request: Invalid API key."),
], ids=["missing", "malformed", "wrong"])
def test_a_blocking_trace_with_a_bad_key_reads_one_clean_sentence(stack, model, use_key, key, said):
    """The first error every researcher meets on an auth farm: a RemoteError
    with the server's sentence, not a websocket handshake's header dump. The
    socket its handshake opened closes within seconds, holding nothing."""
    use_key(key)
    with pytest.raises(RemoteError) as refused:
        _trace(model)
    assert str(refused.value).startswith(said), str(refused.value)
    assert "\n" not in str(refused.value) and "Handshake" not in str(refused.value)


def test_a_socket_opened_with_a_refused_key_closes_within_seconds(stack):
    from web.subscribe import KEY_REFUSED_HOLD_S

    sock, head = raw_websocket.upgrade(stack.url, headers={"ndif-api-key": "not-a-uuid"})
    try:
        assert head.startswith("HTTP/1.1 101"), head
        reply = raw_websocket.read(sock, quiet_s=KEY_REFUSED_HOLD_S + 10, within_s=KEY_REFUSED_HOLD_S + 10)
        assert reply.closed and reply.close_code == 1008, (reply.closed, reply.close_code)
        assert len(reply.texts) == 1 and '"session_id"' in reply.texts[0], reply.texts
    finally:
        sock.close()


def test_no_key_is_refused(stack, model, use_key):
    use_key(None)
    with pytest.raises(RemoteError, match="Missing or invalid API key"):
        with model.trace(PROMPT, remote=True, blocking=False):
            model.output.logits.save()


def test_malformed_and_unknown_keys_are_refused(stack, model, use_key):
    use_key("not-a-uuid")
    with pytest.raises(RemoteError, match="Invalid API key format: the key sent is not one") as refused:
        with model.trace(PROMPT, remote=True, blocking=False):
            model.output.logits.save()
    assert "not-a-uuid" not in str(refused.value)
    use_key(str(uuid.uuid4()))
    with pytest.raises(RemoteError, match="Invalid API key."):
        with model.trace(PROMPT, remote=True, blocking=False):
            model.output.logits.save()


def test_valid_keys_work_and_decide_trust(stack, model, use_key):
    with model.trace(PROMPT):
        local = model.transformer.h[1].output.save()
    untrusted, trusted = make_key(stack, "ada@example.org"), make_key(stack, "grace@example.org", "--trusted")
    use_key(untrusted)
    hidden, meta = _trace(model)
    assert torch.equal(hidden, local) and meta["isolated"] is True
    assert nnsight.whoami() == {"email": "ada@example.org", "tags": []}
    use_key(trusted)
    hidden, meta = _trace(model)
    assert torch.equal(hidden, local) and meta["isolated"] is False
    assert nnsight.whoami() == {"email": "grace@example.org", "tags": ["trusted"]}
    listed = json.loads(stack.cli("keys", "list", "--json").stdout)
    assert {row["email"] for row in listed} >= {"ada@example.org", "grace@example.org"}
    assert all(untrusted not in json.dumps(row) for row in listed), "keys list must not show keys"


def test_a_revoked_key_is_refused(stack, model, use_key):
    key = make_key(stack, "revoked@example.org")
    use_key(key)
    _trace(model)
    assert stack.cli("keys", "revoke", key).returncode == 0
    with pytest.raises(RemoteError, match="Invalid API key."):
        with model.trace(PROMPT, remote=True, blocking=False):
            model.output.logits.save()


def test_another_keys_job_is_out_of_reach(stack, model, use_key):
    owner, other = make_key(stack, "owner@example.org"), make_key(stack, "other@example.org")
    use_key(owner)
    with model.trace(PROMPT, remote=True, blocking=False) as tracer:
        logits = model.output.logits.save()  # noqa: F841
    job_id = tracer.backend.job_id
    thief = RemoteBackend(model.to_model_key(), blocking=False, job_id=job_id, api_key=other)
    with pytest.raises(httpx.HTTPStatusError) as caught:
        thief()
    assert caught.value.response.status_code == 403
    assert "another API key" in caught.value.response.json()["detail"]
    response = httpx.get(f"{stack.url}/response/{job_id}")
    assert response.status_code == 401, "a job id alone is not a bearer token"
    mine = RemoteBackend(model.to_model_key(), blocking=False, job_id=job_id, api_key=owner)
    assert poll(mine)["logits"].shape[-1] > 0


def test_a_session_opened_by_one_key_cannot_carry_anothers_job(stack, model):
    import websocket

    owner, other = make_key(stack, "ws-owner@example.org"), make_key(stack, "ws-other@example.org")
    ws = websocket.create_connection(f"ws{stack.url[4:]}/subscribe", header={"ndif-api-key": owner})
    try:
        session_id = json.loads(ws.recv())["session_id"]
        envelope = {"model_key": model.to_model_key(), "session_id": session_id, "compress": False, "env": {}}
        response = httpx.post(
            f"{stack.url}/request", data={"data": json.dumps(envelope)},
            files={"blob": ("request", b"x", "application/octet-stream")}, headers={"ndif-api-key": other},
        )
        assert response.status_code == 403
        assert "session_id was not opened by this API key" in response.json()["detail"]
    finally:
        ws.close()


def _recording_start(model):
    """A non-blocking job that saves when (server time) it began running."""
    import time

    with model.trace(PROMPT, remote=True, blocking=False) as tracer:
        model.transformer.h[0].output.save()
        began = nnsight.save(time.time())  # noqa: F841
    return tracer.backend


def test_a_priority_key_is_served_before_the_queue(stack, model, use_key):
    """Four jobs wait behind a running one; the last, from a key tagged
    ``priority``, runs first, and is told position 1 when it is queued."""
    from tests.support.clients.remote import slow_job, wait_status

    ordinary = make_key(stack, "queue@example.org", "--trusted")
    vip = make_key(stack, "first@example.org", "--trusted", "--priority")  # both made before the clock runs
    use_key(ordinary)
    blocker = slow_job(model, 100)  # 5 s: the queue forms behind it
    wait_status(stack.url, blocker.job_id, "RUNNING", headers={"ndif-api-key": blocker.api_key})
    normal = [_recording_start(model) for _ in range(3)]
    use_key(vip)
    first = _recording_start(model)
    queued = httpx.get(f"{stack.url}/response/{first.job_id}", headers={"ndif-api-key": first.api_key}).json()
    began = {backend.job_id: poll(backend)["began"] for backend in [first, *normal]}
    assert queued["status"] == "QUEUED" and "(position 1" in queued["description"], queued
    assert began[first.job_id] < min(began[b.job_id] for b in normal), began
    assert sorted(began[b.job_id] for b in normal) == [began[b.job_id] for b in normal]  # the rest in order


def test_no_error_echoes_any_part_of_a_key(stack):
    """Behind a proxy that adds the farm's key as ``ndif_api_key``, a client's
    own malformed ``ndif-api-key`` used to merge with it (gunicorn's
    "dangerous" header map), and the 400 echoed the merged value: the proxy's
    key. Now the underscore header is dropped and no error quotes a key."""
    proxy_key = make_key(stack, "proxy@example.org")
    pieces = [piece for piece in proxy_key.split("-") if len(piece) >= 4]
    attempts = [{"ndif_api_key": proxy_key, "ndif-api-key": "zz"},
                {"ndif-api-key": "zz" + proxy_key},
                {"ndif-api-key": proxy_key[:-1] + "!"}]
    envelope = '{"model_key": "x", "session_id": "", "compress": false, "env": {}}'
    for headers in attempts:
        answers = [
            httpx.post(f"{stack.url}/request", headers=headers, data={"data": envelope},
                       files={"blob": ("request", b"x", "application/octet-stream")}, timeout=30),
            httpx.get(f"{stack.url}/response/{uuid.uuid4().hex}", headers=headers, timeout=30),
        ]
        for answer in answers:
            assert answer.status_code in (400, 401), (headers, answer.status_code, answer.text)
            assert not [piece for piece in pieces if piece in answer.text], (headers, answer.text)
        sock, head = raw_websocket.upgrade(stack.url, headers=headers)  # the handshake opens, says nothing of keys
        try:
            said = head + "".join(raw_websocket.read(sock, quiet_s=1).texts)
        finally:
            sock.close()
        assert not [piece for piece in pieces if piece in said], (headers, said)
