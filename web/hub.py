"""One Redis pub/sub connection per web process, fanned out to its websockets.

Why: a blocking client holds ``/subscribe`` for its job's whole life, minutes
when the model's queue is long. A pub/sub connection and a thread per waiting
socket would cap the web's capacity at the thread count (128 by default). It
would also grow Redis's client count with every waiting researcher. So a web
process holds ONE pub/sub connection, owned by one dispatcher. The dispatcher
is a greenlet under gunicorn's gevent worker and a thread under gthread: it
is written with ``threading``, which gevent patches. A waiting socket is a
mailbox and an event, a few KiB. The choice of gevent:
docs/decisions/gevent-web.md.

* **Subscribe before handout.** Pub/sub has no replay. So :meth:`Hub.open`
  returns only after Redis *confirmed* the SUBSCRIBE for the session's channel
  (the dispatcher reads the confirmation). No status of the session id the
  socket then hands out can be published into the void.
* **One owner.** Only the dispatcher reads or writes the pub/sub connection
  (redis-py's ``PubSub`` is not safe to share); sockets ask it to subscribe and
  unsubscribe through a list it drains between reads, many channels per
  command. redis-py re-subscribes every channel itself when it reconnects
  after a Redis restart.
* **Woken, not polling.** The dispatcher sleeps on the pub/sub socket; a new
  socket wakes it by PUBLISHing to the hub's own anchor channel (one per web
  process), so a handshake waits one round trip instead of a poll interval,
  and an idle web process costs nothing (a 20 ms poll would cost ~1.5 % of
  a core per process, at rest). Unsubscribes of closed sockets wait for the
  next wake, ``DISPATCH_IDLE_S`` at most.
* **A connection of its own, never unsubscribed to zero, no health-check
  PING.** The pub/sub has its own client (``health_check_s=0``) and a
  permanent anchor channel: redis-py's health check races with an
  unsubscribe from the last channel (github.com/redis/redis-py/issues/1720)
  and a reply misread
  there reconnects the pub/sub, and a frame published in that gap is lost
  (an inline result with it). TCP keepalive still watches the connection.
* **Resync in bulk.** A quiet socket's job may end while its frame is lost (a
  status published while Redis restarted). Every ``RESYNC_S`` the hub reads the
  stored statuses of every open session's jobs in pipelines (not a round trip
  per socket) and hands an ended job's final status to its socket; the same
  pass renews the per-key socket leases (``limits.renew_sockets``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from collections import deque
from typing import Callable, Optional

import redis

from ndif_celery.accounts import limits
from ndif_celery.notices import Notices
from ndif_celery.state import jobs

log = logging.getLogger("ndif_celery.web.hub")

# The longest the dispatcher sleeps on a quiet pub/sub socket before it looks
# at its list of requests: a new subscription wakes it at once (it publishes to
# the hub's anchor), so this only bounds how long a closed socket's channel
# stays subscribed.
DISPATCH_IDLE_S = 1.0
# How often open sessions are checked for a job that ended unheard, and their
# per-key socket leases renewed (well within NDIF_SOCKET_LEASE_S, at least 10 s).
RESYNC_S = 5.0
# Each hub's own anchor channel (this prefix, the process id, a random part):
# subscribed for the hub's whole life, so the pub/sub never drops to no
# channel, and what a new socket publishes to to wake the dispatcher.
ANCHOR = "ndif:web:hub"
# Sessions per pipeline in the resync pass.
_CHUNK = 500


class Mailbox:
    """What a waiting socket costs here: its frames and a way to wake it.

    ``wake`` becomes the socket's own event once it is upgraded
    (simple-websocket sets it when the client closes or sends), so one wait
    wakes the handler for either; the subscription is made before the upgrade,
    with an event of its own (``web/subscribe.py``)."""

    __slots__ = ("frames", "wake", "subscribed", "lease", "ended")

    def __init__(self, wake: threading.Event, lease=None):
        self.frames: deque = deque()
        self.wake = wake
        self.subscribed = threading.Event()
        self.lease = lease  # (identity, session_id) when the key's sockets are counted
        self.ended: Optional[bytes] = None  # a final status found by the resync

    def put(self, frame: bytes) -> None:
        self.frames.append(frame)
        self.wake.set()


class Hub:
    def __init__(self, client: redis.Redis, pubsub_client: Optional[redis.Redis] = None,
                 subscribe_timeout_s: float = 30.0, socket_lease_s: float = 30.0):
        self.client = client
        self.pubsub_client = pubsub_client or client
        self.subscribe_timeout_s = subscribe_timeout_s
        self.socket_lease_s = socket_lease_s
        self.boxes: dict[bytes, Mailbox] = {}
        self._pending: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        self._pubsub = None
        self._started = False
        self.anchor = f"{ANCHOR}:{os.getpid()}:{secrets.token_hex(4)}".encode()
        self._anchored = threading.Event()  # Redis confirmed the anchor: a wake-up is heard

    # -- the socket's side -------------------------------------------------
    def open(self, session_id: str, wake: threading.Event, lease=None) -> Mailbox:
        """A mailbox for ``session_id``'s channel, returned once Redis confirmed
        the subscription (raises ``redis.ConnectionError`` if it did not in time)."""
        channel = jobs.session_channel(session_id).encode()
        box = Mailbox(wake, lease)
        self._ensure_started()
        with self._lock:
            self.boxes[channel] = box
            self._pending.append(("s", channel))
        if self._anchored.wait(self.subscribe_timeout_s):
            self.client.publish(self.anchor, b"")  # wake the dispatcher: it takes the request now
        if not box.subscribed.wait(self.subscribe_timeout_s):
            self.close(session_id)
            raise redis.ConnectionError(f"Redis did not confirm the subscription to {channel.decode()} in time")
        return box

    def close(self, session_id: str) -> None:
        channel = jobs.session_channel(session_id).encode()
        with self._lock:
            if self.boxes.pop(channel, None) is not None:
                self._pending.append(("u", channel))

    def __len__(self) -> int:
        return len(self.boxes)

    # -- the dispatcher ----------------------------------------------------
    def _ensure_started(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        for target, name in ((self._dispatch, "ndif-hub-dispatch"), (self._resync_loop, "ndif-hub-resync")):
            threading.Thread(target=_forever(target, name), name=name, daemon=True).start()

    def _dispatch(self) -> None:
        if self._pubsub is None:
            self._pubsub = self.pubsub_client.pubsub(ignore_subscribe_messages=False)
            self._pubsub.subscribe(self.anchor)
        pubsub = self._pubsub
        while True:
            with self._lock:
                pending, self._pending = self._pending, []
            try:
                self._pass(pubsub, pending)
            except (redis.ConnectionError, redis.TimeoutError):
                self._lost(pubsub, pending)
                raise

    def _lost(self, pubsub, pending: list) -> None:
        """The pub/sub connection failed (Redis restarted, or closed it).

        Drop the socket, so the next pass reconnects. redis-py's ``can_read``
        raises ``ConnectionError`` on a socket the server closed, *without*
        dropping it. Every later poll would read the same dead socket, and no
        new subscription would be confirmed: a blocking client's handshake
        would fail after the subscribe timeout. The reconnect re-subscribes
        every channel redis-py knows (its ``on_connect``). This pass's requests
        go back on the list, since a failed SUBSCRIBE is not among those
        channels; subscribing twice is harmless."""
        if pubsub.connection is not None:
            pubsub.connection.disconnect()
        with self._lock:
            self._pending[:0] = pending

    def _pass(self, pubsub, pending: list) -> None:
        """One turn: (un)subscribe what sockets asked for, then read what came."""
        subscribe = [channel for kind, channel in pending if kind == "s"]
        unsubscribe = [channel for kind, channel in pending if kind == "u"]
        if subscribe:
            pubsub.subscribe(*subscribe)
        if unsubscribe:
            pubsub.unsubscribe(*unsubscribe)
        # Wait for something to read, then read whole replies. Not
        # get_message(timeout=t): redis-py reads the rest of a reply with
        # the same timeout, so a reply split across TCP segments (bursts
        # under load) times out half-read, and the retry reconnects the
        # pub/sub, losing what was published meanwhile. get_message(None)
        # blocks until the reply is complete.
        conn = pubsub.connection
        if conn is None or not conn.can_read(timeout=DISPATCH_IDLE_S):
            return
        while True:
            message = pubsub.get_message(timeout=None)
            if message is not None:
                self._route(message)
            if not conn.can_read(timeout=0):
                break

    def _route(self, message: dict) -> None:
        if message["channel"] == self.anchor:
            if message["type"] == "subscribe":
                self._anchored.set()
            return  # a wake-up: the pass is over, the next one takes the requests
        box = self.boxes.get(message["channel"])
        if box is None:
            return  # the socket already left
        if message["type"] == "message":
            box.put(message["data"])
        elif message["type"] == "subscribe":
            box.subscribed.set()

    # -- the resync pass ---------------------------------------------------
    def _resync_loop(self) -> None:
        while True:
            time.sleep(RESYNC_S)
            self.resync()

    def resync(self) -> None:
        """Hand each open session's ended-unheard job its final status, and
        renew the counted sockets' leases: a few pipelines for all sessions."""
        boxes = list(self.boxes.items())
        leases = [box.lease for _, box in boxes if box.lease is not None]
        if leases:
            limits.renew_sockets(self.client, leases, self.socket_lease_s)
        for start in range(0, len(boxes), _CHUNK):
            chunk = boxes[start:start + _CHUNK]
            pipe = self.client.pipeline(transaction=False)
            for channel, _ in chunk:
                pipe.smembers(jobs.session_jobs_key(_session_of(channel)))
            members = pipe.execute()
            asked = [(box, job_id.decode()) for (_, box), ids in zip(chunk, members) for job_id in ids]
            if not asked:
                continue
            pipe = self.client.pipeline(transaction=False)
            for _, job_id in asked:
                pipe.get(jobs.status_key(job_id))
            for (box, _), latest in zip(asked, pipe.execute()):
                if box.ended is None and ended_unheard(latest):
                    box.ended = latest
                    box.wake.set()


def ended_unheard(latest: Optional[bytes]) -> bool:
    """Whether a stored status is final and was not an inline result.

    Pub/sub has no replay: a status published while the subscription was being
    re-established (Redis restarted) is gone. The latest-status key is not, and
    a result that found nobody listening was kept in the store, so the status
    stored for pollers is complete. An inline result was, by definition,
    delivered to a subscriber (this process): it is in the socket's mailbox.
    """
    if not jobs.ended(latest):
        return False
    return not (json.loads(latest).get("meta") or {}).get("inline")


def _session_of(channel: bytes) -> str:
    return channel.decode().rsplit(":", 1)[-1]


def _forever(target: Callable[[], None], name: str) -> Callable[[], None]:
    """Keep a hub loop alive through Redis outages longer than the client's retries
    (the same error, met every half second while Redis is away, logged once per change)."""
    notices = Notices(log)

    def run() -> None:
        while True:
            try:
                target()
            except Exception as error:  # noqa: BLE001 - logged; the loop must not die
                notices.warn(name, f"{name}: retrying after {type(error).__name__}: {error}", exc_info=True)
                time.sleep(0.5)

    return run
