"""The intake of a runtime's client, in-process: the real Flask app and a real
embedded Redis, a registered worker of nnsight 0.7.0 and no process behind it.

What a 0.7 client's ``POST /request`` (its envelope in headers, the payload
the body) leaves for that runtime's workers, who may report to its Socket.IO
session, and that its statuses are only those its client knows.
"""

from __future__ import annotations

import json
import time

import pytest

from ndif_celery import socketio_wire, statuses, wire
from ndif_celery.celery_app import queue_for
from ndif_celery.policy import client_versions
from ndif_celery.state import jobs, queues, registry
from tests.support.cases.tiny_model import REPO_ID

OLD = "0.7.0"
OLD_KEY = f'nnsight.modeling.language.LanguageModel:{{"repo_id": "{REPO_ID}", "revision": "main"}}'


@pytest.fixture(scope="module")
def web(embedded_settings):
    from web.app import create_app

    return create_app(embedded_settings).test_client()


@pytest.fixture
def client(redis_client):
    registry.register_worker(redis_client, {"name": "cpu-nnsight0.7.0@test", "nnsight": OLD,
                                            "memory_bytes": 1 << 30, "started_at": time.time()})
    yield redis_client
    registry.unregister_worker(redis_client, "cpu-nnsight0.7.0@test")


def submit_old(web, session_id: str = "", key: str = "", body: bytes = b"payload", compress: str = "False"):
    headers = {"nnsight-version": OLD, "nnsight-model-key": OLD_KEY, "nnsight-compress": compress,
               socketio_wire.SESSION_AS_READ: session_id, "Content-Type": "application/octet-stream"}
    if key:
        headers["ndif-api-key"] = key
    return web.post("/request", data=body, headers=headers)


def test_a_07_request_goes_to_its_runtimes_own_deployment(web, client):
    response = submit_old(web, body=b"the 0.7 payload")
    assert response.status_code == 200, response.get_json()
    job_id = response.get_json()["id"]
    (waiting,) = [entry for entry in queues.waiting(client, queue_for(waiting_key(client, job_id)))
                  if entry.job.id == job_id]
    assert waiting.job.protocol == socketio_wire.PROTOCOL
    assert waiting.job.model_key.endswith('"task": "text-generation", "nnsight": "0.7.0"}')
    assert client.get(jobs.payload_key(job_id)) == b"the 0.7 payload"
    # Its statuses are those its client knows, stored for GET /response too.
    channel = statuses.StatusChannel(client, waiting.job, 60)
    channel.send(wire.DEPLOYING, "Loading it.")
    assert json.loads(client.get(jobs.status_key(job_id)))["status"] == wire.QUEUED


def waiting_key(client, job_id: str) -> str:
    return json.loads(client.get(jobs.message_key(job_id)))["model_key"]


def test_the_first_key_that_submits_with_a_socket_claims_it(web, client):
    sid = "AbC_d-1234567890xyz"
    client.set(jobs.session_owner_key(sid), "", ex=60)  # what web/sio.py records when the socket connects
    assert submit_old(web, sid).status_code == 200
    assert client.get(jobs.session_owner_key(sid)) == b"anonymous"
    assert submit_old(web, sid).status_code == 200  # the same key again
    # No such socket: nobody's session to report to.
    refused = submit_old(web, "NoSocketHere")
    assert refused.status_code == 403 and "session_id was not opened by this API key" in refused.get_json()["detail"]


def test_a_refused_request_does_not_claim_the_socket(web, client):
    sid = "UnclaimedSocket123"
    client.set(jobs.session_owner_key(sid), "", ex=60)
    refused = submit_old(web, sid, body=b"not zstd", compress="True")
    assert refused.status_code == 400 and "not a valid zstd frame" in refused.get_json()["detail"]
    assert client.get(jobs.session_owner_key(sid)) == b""


def test_a_request_in_the_other_versions_protocol_is_refused(web, client):
    form = web.post("/request", headers={"nnsight-version": OLD},
                    data={"data": json.dumps({"model_key": OLD_KEY}), "blob": (b"x", "request")})
    assert form.status_code == 400
    assert form.get_json()["detail"] == (
        f"An nnsight {OLD} client sends its envelope in the nnsight-model-key and nnsight-compress headers; this "
        "request does not. Is the nnsight-version header the client's own?")
    headers = web.post("/request", data=b"x", headers={"nnsight-version": client_versions.MAIN,
                                                        "nnsight-model-key": OLD_KEY})
    assert headers.status_code == 400 and "sends a multipart form" in headers.get_json()["detail"]


def test_a_bad_header_is_named(web, client):
    response = submit_old(web, compress="yes")
    assert response.status_code == 422
    assert response.get_json()["detail"] == "Header 'nnsight-compress' must be True or False, got 'yes'."


def test_a_claimed_socket_counts_among_its_keys_sockets(embedded_settings, client):
    import dataclasses

    from ndif_celery.accounts import auth, limits
    from web.app import create_app

    web = create_app(dataclasses.replace(embedded_settings, max_websockets_per_key=1)).test_client()
    for sid in ("FirstSocket", "SecondSocket"):
        client.set(jobs.session_owner_key(sid), "", ex=60)
    assert submit_old(web, "FirstSocket").status_code == 200
    assert limits.sockets_held(client, auth.Identity()) == 1
    refused = submit_old(web, "SecondSocket")
    assert refused.status_code == 429 and "NDIF_MAX_WEBSOCKETS_PER_KEY" in refused.get_json()["detail"]
