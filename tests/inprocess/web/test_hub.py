"""The web's one pub/sub connection (``web/hub.py``) against a real Redis.

A Redis restart (or anything else that closes the hub's pub/sub connection
server-side) must not leave the hub reading a dead socket: the sockets that were
waiting keep receiving, and a new socket's subscription is confirmed. Before the
fix, redis-py's ``can_read`` raised "Connection closed by server" on every poll
without dropping the socket, so no handshake succeeded again until the web was
restarted (the CI failure of stop 18: the next blocking request after a Redis
``kill -9`` got an HTTP 500 written into its upgraded websocket).
"""

from __future__ import annotations

import threading
import time

import redis

from ndif_celery.state import jobs
from tests.support import pace
from web.hub import Hub


def _hub(embedded_settings) -> Hub:
    client = jobs.connect(embedded_settings.redis_url, 5)
    return Hub(client, jobs.connect(embedded_settings.redis_url, 5, health_check_s=0), subscribe_timeout_s=10)


def _received(box, timeout_s: float = 10) -> bytes:
    deadline = time.monotonic() + timeout_s
    while not box.frames:
        assert time.monotonic() < deadline, "no frame reached the socket's mailbox"
        box.wake.wait(0.1)
    return box.frames.popleft()


def _kill_pubsub(client: redis.Redis) -> None:
    """What a Redis restart does to the hub's connection: the server closes it."""
    deadline = time.monotonic() + 5
    while client.client_kill_filter(_type="pubsub") == 0:
        assert time.monotonic() < deadline, "the hub holds no pub/sub connection"
        time.sleep(0.05)


def test_a_pubsub_closed_by_the_server_is_reopened_with_its_channels(embedded_settings, redis_client):
    hub = _hub(embedded_settings)
    waiting = hub.open("before", threading.Event())
    redis_client.publish(jobs.session_channel("before"), b'{"status": "QUEUED"}')
    assert _received(waiting) == b'{"status": "QUEUED"}'

    _kill_pubsub(redis_client)
    time.sleep(0.3)  # the dispatcher has seen the closed socket

    started = time.monotonic()
    later = hub.open("after", threading.Event())  # a new handshake is confirmed
    assert time.monotonic() - started < pace.bound(5)
    # The re-subscription of the waiting socket went out before the new one's,
    # on the same connection: a frame published now reaches both.
    redis_client.publish(jobs.session_channel("after"), b'{"status": "RUNNING"}')
    redis_client.publish(jobs.session_channel("before"), b'{"status": "COMPLETED"}')
    assert _received(later) == b'{"status": "RUNNING"}'
    assert _received(waiting) == b'{"status": "COMPLETED"}'


def test_subscriptions_asked_for_during_an_outage_are_made_when_it_ends(embedded_settings, redis_client):
    hub = _hub(embedded_settings)
    hub.open("first", threading.Event())
    for _ in range(3):  # closed again and again, as while Redis comes back
        _kill_pubsub(redis_client)
        time.sleep(0.1)
    box = hub.open("second", threading.Event())
    redis_client.publish(jobs.session_channel("second"), b"{}")
    assert _received(box) == b"{}"


def test_a_new_socket_wakes_the_dispatcher_which_does_not_poll_while_idle(embedded_settings, redis_client,
                                                                          monkeypatch):
    """The dispatcher sleeps on the pub/sub socket (it polled every 20 ms); a
    handshake wakes it through the hub's own anchor channel. With its idle
    sleep made a minute long, a new socket is still confirmed at once, and a
    quiet hub makes almost no passes."""
    from web import hub as hub_module

    monkeypatch.setattr(hub_module, "DISPATCH_IDLE_S", 60.0)
    hub = _hub(embedded_settings)
    passes = []
    original = hub._pass
    monkeypatch.setattr(hub, "_pass", lambda pubsub, pending: (passes.append(1), original(pubsub, pending)))
    hub.open("first", threading.Event())
    time.sleep(1.0)  # idle
    quiet = len(passes)
    started = time.monotonic()
    box = hub.open("second", threading.Event())
    assert time.monotonic() - started < pace.bound(10), "the handshake waited for the idle sleep, not a wake-up"
    redis_client.publish(jobs.session_channel("second"), b"{}")
    assert _received(box) == b"{}"
    assert quiet <= 5, f"{quiet} passes in a second of quiet: the dispatcher polls"
    # Each hub wakes on its own anchor only: another web process's handshakes do not wake this one.
    assert hub.anchor != _hub(embedded_settings).anchor
