"""The Socket.IO relay of the nnsight 0.6/0.7 clients (``web/sio.py``), in-process.

The real Flask app (``create_app``) is served by werkzeug's threaded WSGI
server on a loopback port, in a thread of this process, so Socket.IO runs in
its ``threading`` async mode (``NDIF_WEB_WORKER_CLASS=gthread``; gunicorn's
gevent worker is the e2e tier's). A real Redis (the module's embedded one)
carries the statuses, and a real ``socketio.SimpleClient`` connects as those
clients do: ``/ws/socket.io``, websocket transport only, no key.

Why: those clients read every status of their job from that socket. A status
published before the socket's channel was subscribed is lost, one they cannot
unpickle (or a DEPLOYING, which their enum lacks) crashes them, and a socket
that never closes holds a connection of the web for good.
"""

from __future__ import annotations

import dataclasses
import io
import json
import threading
import time
import types

import pytest
import socketio
import torch

from ndif_celery import wire
from ndif_celery.state import jobs
from tests.support import pace
from tests.support.stacks.servers import serving
from web import hub
from web import sio, subscribe


@pytest.fixture(scope="module")
def app(embedded_settings):
    from web.app import create_app

    # The threading async mode (not gevent: this process is not monkey-patched);
    # a grace long enough that no cancellation timer fires during the tests.
    settings = dataclasses.replace(embedded_settings, web_worker_class="gthread", disconnect_grace_s=3600.0)
    return create_app(settings)


@pytest.fixture(scope="module")
def url(app):
    with serving(app) as found:
        yield found


@pytest.fixture
def connect(url, redis_client):
    """``connect() -> SimpleClient``, connected as a 0.6/0.7 client connects; all closed after the test."""
    opened = []

    def make() -> socketio.SimpleClient:
        client = socketio.SimpleClient()
        opened.append(client)
        client.connect(url, socketio_path="/ws/socket.io", transports=["websocket"], wait_timeout=pace.bound(10))
        return client

    yield make
    for client in opened:
        client.disconnect()


def eventually(condition, what: str, timeout_s: float = 10.0):
    """``condition()``'s first true value within ``timeout_s`` (scaled to this machine)."""
    deadline = time.monotonic() + pace.bound(timeout_s)
    while True:
        found = condition()
        if found:
            return found
        assert time.monotonic() < deadline, f"{what}: not within {pace.bound(timeout_s):.1f} s ({pace.describe()})"
        time.sleep(0.05)


def publish(redis_client, sid: str, status: str, description: str = "", data=None) -> int:
    return redis_client.publish(jobs.session_channel(sid), wire.response_json("job1", status, description, data))


def received(client: socketio.SimpleClient) -> dict:
    event, *args = client.receive(timeout=pace.bound(10))
    assert event == sio.EVENT and len(args) == 1
    return torch.load(io.BytesIO(args[0]), weights_only=True)


def test_a_connected_socket_is_an_unclaimed_session_already_subscribed(connect, redis_client):
    client = connect()
    sid = client.sid
    assert redis_client.get(jobs.session_owner_key(sid)) == b""
    assert 0 < redis_client.ttl(jobs.session_owner_key(sid)) <= subscribe.SESSION_OWNER_TTL_S
    # Right after connect returned: the first status of a job reaches the client.
    assert publish(redis_client, sid, wire.QUEUED, "Queued.") >= 1
    assert received(client)["status"] == wire.QUEUED


def test_statuses_arrive_as_the_old_clients_read_them_and_nothing_after_the_last(connect, redis_client, monkeypatch):
    monkeypatch.setattr(sio, "CLOSE_AFTER_S", 1.0)
    client = connect()
    sid = client.sid
    url = "http://farm/result/job1"
    for status, description, data in ((wire.QUEUED, "Queued (position 2).", None),
                                      (wire.DEPLOYING, "Loading org/a onto gpu0.", None),
                                      (wire.RUNNING, "Your job has started running.", None),
                                      (wire.COMPLETED, "Done.", url)):
        assert publish(redis_client, sid, status, description, data) >= 1
    assert [received(client) for _ in range(4)] == [
        {"id": "job1", "status": "QUEUED", "description": "Queued (position 2)."},
        {"id": "job1", "status": "QUEUED", "description": "Loading org/a onto gpu0."},  # DEPLOYING, said as QUEUED
        {"id": "job1", "status": "RUNNING", "description": "Your job has started running."},
        {"id": "job1", "status": "COMPLETED", "description": "Done.", "data": url},
    ]
    publish(redis_client, sid, wire.RUNNING, "after the end")
    # The client here does not close it: the server does, CLOSE_AFTER_S after the final status.
    eventually(lambda: not client.connected, "the server closed the socket after its job's final status")
    assert client.input_buffer == [], "a status was relayed after COMPLETED"
    eventually(lambda: redis_client.exists(jobs.session_owner_key(sid)) == 0, "the owner record was deleted")


def test_a_socket_never_claimed_is_closed_after_the_idle_limit(connect, redis_client, monkeypatch):
    monkeypatch.setattr(sio, "IDLE_S", 1.0)
    client = connect()
    sid = client.sid
    eventually(lambda: not client.connected, "the unclaimed socket was closed")
    eventually(lambda: redis_client.exists(jobs.session_owner_key(sid)) == 0, "its owner record was deleted")


def test_a_claimed_socket_outlives_the_idle_limit(connect, redis_client, monkeypatch):
    monkeypatch.setattr(sio, "IDLE_S", 2.0)
    client = connect()
    sid = client.sid
    assert jobs.claim_session(redis_client, client.sid, "key:alice") == b"key:alice"
    time.sleep(2.0 + pace.bound(2.0))  # past the idle limit's look at the owner
    assert client.connected
    assert redis_client.get(jobs.session_owner_key(sid)) == b"key:alice"
    assert publish(redis_client, sid, wire.RUNNING, "Running.") >= 1
    assert received(client)["status"] == wire.RUNNING


def test_a_disconnect_deletes_the_owner_record_and_unsubscribes(connect, redis_client):
    client = connect()
    sid = client.sid
    client.disconnect()
    eventually(lambda: redis_client.exists(jobs.session_owner_key(sid)) == 0, "the owner record was deleted")
    eventually(lambda: publish(redis_client, sid, wire.RUNNING) == 0, "the session's channel was unsubscribed")


def test_a_claimed_socket_keeps_its_keys_slot_while_it_lives_and_frees_it_at_its_close(connect, redis_client):
    from ndif_celery.accounts import limits

    client = connect()
    sid = client.sid
    alice = sio.Claimant("key:alice")
    assert jobs.claim_session(redis_client, sid, alice.owner) == b"key:alice"
    settings = types.SimpleNamespace(max_websockets_per_key=4, socket_lease_s=10.0)
    assert limits.claim_socket(redis_client, alice, sid, settings)  # as the intake's claim does
    claimed_until = redis_client.zscore(f"ndif:sockets:{alice.owner}", sid)
    assert publish(redis_client, sid, wire.QUEUED, "Queued.") >= 1
    assert received(client)["status"] == wire.QUEUED
    # The hub's resync renews it (its lease from the claim's time, the web's own from then).
    eventually(lambda: redis_client.zscore(f"ndif:sockets:{alice.owner}", sid) > claimed_until,
               "the web renewed the socket's lease", timeout_s=3 * hub.RESYNC_S)
    assert limits.sockets_held(redis_client, alice) == 1
    client.disconnect()
    eventually(lambda: limits.sockets_held(redis_client, alice) == 0, "the key's socket slot was freed")


def test_a_client_that_leaves_before_its_job_ended_has_its_open_jobs_marked_gone(connect, redis_client):
    client = connect()
    sid = client.sid
    redis_client.sadd(jobs.session_jobs_key(sid), "open", "done")
    redis_client.set(jobs.status_key("open"), wire.response_json("open", wire.RUNNING))
    redis_client.set(jobs.status_key("done"), wire.response_json("done", wire.COMPLETED, data="http://farm/r"))
    client.disconnect()
    eventually(lambda: redis_client.exists(jobs.gone_key("open")), "the open job was marked gone")
    assert not redis_client.exists(jobs.gone_key("done"))


def test_a_connect_while_redis_fails_is_refused(app, url, redis_client, monkeypatch):
    import redis

    def unreachable(*args, **kwargs):
        raise redis.ConnectionError("Error 111 connecting to redis")

    monkeypatch.setattr(app.config["NDIF_REDIS"], "set", unreachable)
    client = socketio.SimpleClient()
    with pytest.raises(socketio.exceptions.ConnectionError):
        client.connect(url, socketio_path="/ws/socket.io", transports=["websocket"], wait_timeout=pace.bound(10))
    client.disconnect()
    assert not redis_client.keys("ndif:session:*")


def test_log_lines_that_wait_go_as_one_event_in_order(connect, redis_client, monkeypatch):
    # Spaced wide here, so the lines published together all wait behind the first.
    monkeypatch.setattr(sio, "EVENT_SPACING_S", 1.0)
    client = connect()
    sid = client.sid
    lines = [f"line {n}" for n in range(6)]
    pipe = redis_client.pipeline()
    for line in lines:
        pipe.publish(jobs.session_channel(sid), wire.response_json("job1", wire.LOG, line))
    pipe.publish(jobs.session_channel(sid), wire.response_json("job1", wire.COMPLETED, "Done.", "http://farm/r"))
    pipe.execute()
    events = [received(client)]
    while events[-1]["status"] != "COMPLETED":
        events.append(received(client))
    logs = [event["description"] for event in events if event["status"] == "LOG"]
    assert "\n".join(logs).split("\n") == lines, logs
    assert len(events) <= 3, events  # the first line, the rest as one, the end


def test_an_events_bytes_follow_its_header_after_a_gap(connect, redis_client, monkeypatch):
    # The old clients start a thread per engine.io message: bytes sent right behind
    # their header can be read first. Timed as the server sends them.
    import engineio

    sent = []
    original = engineio.Server.send

    def timed(self, sid, data):
        sent.append((time.monotonic(), data))
        return original(self, sid, data)

    monkeypatch.setattr(engineio.Server, "send", timed)
    client = connect()
    publish(redis_client, client.sid, wire.QUEUED, "Queued.")
    publish(redis_client, client.sid, wire.COMPLETED, "Done.", "http://farm/r")
    assert [event["status"] for event in (received(client), received(client))] == ["QUEUED", "COMPLETED"]
    headers = [n for n, (_, data) in enumerate(sent) if isinstance(data, str) and data.startswith("51-")]
    assert len(headers) == 2, sent
    for n in headers:
        (at, _), (following_at, following) = sent[n], sent[n + 1]
        assert isinstance(following, bytes), "the header's attachment comes next"
        assert following_at - at >= sio.ATTACHMENT_GAP_S, following_at - at
