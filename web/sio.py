"""Socket.IO at ``/ws/socket.io``: where the nnsight 0.6 and 0.7 clients wait.

Those clients open a Socket.IO websocket before they submit a blocking job.
There is no API key on it. Then they POST ``/request`` with the socket's
session id, and read every status of the job from the socket.

The socket is ``WS /subscribe`` in another wire (``web/subscribe.py``):

* **Subscribed before handout.** The connect handler subscribes the session's
  Redis channel on the web's one pub/sub hub (``web/hub.py``) before it
  returns. The client learns its sid only after that, so no status of its job
  can be published into the void.
* **An unclaimed session.** The connect handler also records the session with
  an empty owner: no key has claimed it yet. The first key that POSTs with
  this session id claims it (``jobs.claim_session``). A socket still unclaimed
  after :data:`IDLE_S` is closed: its client never submitted.
* **Relayed, translated.** Workers publish each status as JSON. A relay per
  socket (a greenlet under gevent, a thread under gthread) writes each one as
  those clients read it: ``torch.save`` bytes of a dict, in one
  ``blocking_response`` event (``socketio_wire.frame``, no torch here).
* **Ends with its job.** After COMPLETED or ERROR nothing more is relayed.
  The client disconnects itself; the server does it after :data:`CLOSE_AFTER_S`
  if the client does not. A claimed socket has no fixed lifetime: its owner
  record is renewed while it lives.
* **Counted per key once claimed.** The claim counts the socket among its
  key's sockets (``NDIF_MAX_WEBSOCKETS_PER_KEY``, refused past it, as
  ``/subscribe``); the hub renews that lease while the socket lives, and its
  close frees it. Before a claim a socket has no key: it is bounded by
  :data:`IDLE_S`.
* **A client that went away.** A socket closed before its job ended cancels
  the job after ``NDIF_DISCONNECT_GRACE_S``, as ``/subscribe`` does.

If Redis fails at connect, the connection is refused with a sentence the client
shows. The sockets of a web process are bounded by gunicorn's
``worker_connections`` like every other connection. engine.io uses
simple-websocket, as ``/subscribe`` does.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import NamedTuple, Optional

import redis
import socketio
from flask import Flask

from ndif_celery import socketio_wire, wire
from ndif_celery.accounts import limits
from ndif_celery.state import jobs

from . import subscribe

log = logging.getLogger("ndif_celery.web.sio")

PATH = "ws/socket.io"
#: The event those clients read each status from.
EVENT = "blocking_response"
#: How long a socket no key has claimed stays open: the client POSTs right after it connects.
IDLE_S = 60
#: How long a socket stays open after its job's final status, should its client not close it.
CLOSE_AFTER_S = 30
#: How often the owner record's TTL is renewed (well inside ``subscribe.SESSION_OWNER_TTL_S``).
RENEW_S = subscribe.IDLE_WAIT_S
#: How soon an unclaimed socket's owner is read again when Redis could not answer.
CLAIM_RETRY_S = 5.0


class Socket:
    """One connected socket: its mailbox, and what its relay and its
    disconnect handler tell each other."""

    __slots__ = ("box", "closed", "ended")

    def __init__(self, box):
        self.box = box
        self.closed = False  # the socket disconnected: the relay stops
        self.ended = False  # its job's final status was relayed


def wrap(app: Flask, worker_class: str) -> socketio.WSGIApp:
    """``app.wsgi_app`` with the Socket.IO endpoint in front of it (other paths pass through).

    ``app`` gives the handlers, which run outside any Flask request, its Redis,
    settings and Celery app, and an app context for the hub."""
    server = socketio.Server(async_mode="gevent" if worker_class == "gevent" else "threading",
                             cors_allowed_origins=[], logger=False, engineio_logger=False,
                             max_http_buffer_size=1024)
    client: redis.Redis = app.config["NDIF_REDIS"]
    sockets: dict[str, Socket] = {}

    def hub():
        with app.app_context():
            return subscribe.hub()

    @server.event
    def connect(sid, environ, auth=None):
        try:
            client.set(jobs.session_owner_key(sid), "", ex=subscribe.SESSION_OWNER_TTL_S)
        except redis.RedisError as error:
            raise _refused(error) from error
        try:
            box = hub().open(sid, threading.Event())
        except redis.RedisError as error:
            _forget_owner(client, sid)
            raise _refused(error) from error
        sockets[sid] = Socket(box)
        server.start_background_task(_relay, server, client, sid, sockets[sid])

    @server.event
    def disconnect(sid, reason=None):
        socket = sockets.pop(sid, None)
        if socket is None:
            return
        socket.closed = True
        socket.box.wake.set()  # the relay stops
        hub().close(sid)
        _forget_owner(client, sid)
        if socket.box.lease is not None:  # the key's socket slot, free again
            try:
                limits.release_socket(client, *socket.box.lease)
            except redis.RedisError:
                pass  # its lease lapses on its own (NDIF_SOCKET_LEASE_S)
        if not socket.ended:  # the client left (or was closed) before its job's final status
            subscribe.client_left(client, app.config["NDIF_CELERY"], app.config["NDIF_SETTINGS"], sid)

    return socketio.WSGIApp(server, app.wsgi_app, socketio_path=PATH)


def _refused(error: redis.RedisError) -> socketio.exceptions.ConnectionRefusedError:
    """The client shows this message in its connect's error."""
    log.warning("socket.io: connect refused, Redis unreachable: %s", error)
    return socketio.exceptions.ConnectionRefusedError(
        f"The job broker (Redis) is unreachable, so this socket could not be opened; nothing was "
        f"submitted, please retry shortly. ({error})")


def _relay(server: socketio.Server, client: redis.Redis, sid: str, socket: Socket) -> None:
    """The socket's life: relay its job's statuses, renew its owner record,
    close it when nobody claimed it or some time after its job ended."""
    try:
        _relay_statuses(server, client, sid, socket)
        if socket.ended:
            _wait(socket, CLOSE_AFTER_S)
        if not socket.closed:
            server.disconnect(sid)
    except Exception:  # noqa: BLE001 - a relay's failure is logged, never raised into the server
        log.exception("socket.io: session %s failed", sid)
        if not socket.closed:
            server.disconnect(sid)


def _relay_statuses(server: socketio.Server, client: redis.Redis, sid: str, socket: Socket) -> None:
    """Until the job's final status, the socket's close, or its idle limit while unclaimed."""
    box = socket.box
    renewed = time.monotonic()  # the owner record was written at connect
    look_at_claim: Optional[float] = renewed + IDLE_S  # None once claimed
    while not socket.closed:
        now = time.monotonic()
        if now - renewed >= RENEW_S:  # not at every frame: well inside its TTL
            _renew_owner(client, sid)
            renewed = now
        if look_at_claim is not None and now >= look_at_claim:
            try:
                if not client.get(jobs.session_owner_key(sid)):
                    return  # never claimed (or its record is gone): its client connected and never submitted
                look_at_claim = None
            except redis.RedisError:
                look_at_claim = now + CLAIM_RETRY_S  # Redis away: asked again, the socket kept meanwhile
        while box.frames and not socket.closed:
            look_at_claim = None  # a status came: a job was submitted with this session
            if box.lease is None:
                box.lease = _lease(client, sid)
            if _send(server, sid, box.frames.popleft()):
                socket.ended = True
                return
        if box.ended is not None and not socket.closed:  # ended while its frame was lost (see hub.ended_unheard)
            _send(server, sid, box.ended)
            socket.ended = True
            return
        wake_at = renewed + RENEW_S if look_at_claim is None else min(renewed + RENEW_S, look_at_claim)
        box.wake.wait(max(0.0, wake_at - time.monotonic()))
        box.wake.clear()


def _send(server: socketio.Server, sid: str, frame: bytes) -> bool:
    """Emit one published status as those clients read it; whether it was final."""
    if frame[:1] != b"{":  # an inline result, pickled: never published for these jobs
        log.warning("socket.io: session %s: dropped a binary frame (%d bytes)", sid, len(frame))
        return False
    try:
        fields = json.loads(frame)
        translated = socketio_wire.frame(fields["id"], fields["status"], fields.get("description") or "",
                                         fields.get("data"), fields.get("session_id"))
    except (ValueError, KeyError, TypeError, AttributeError):
        log.warning("socket.io: session %s: dropped a frame it could not translate: %.200r", sid, frame)
        return False
    server.emit(EVENT, translated, to=sid)
    return fields["status"] in wire.TERMINAL


def _wait(socket: Socket, seconds: float) -> None:
    """Up to ``seconds``, or until the socket closed."""
    deadline = time.monotonic() + seconds
    while not socket.closed and (left := deadline - time.monotonic()) > 0:
        socket.box.wake.wait(left)
        socket.box.wake.clear()


class Claimant(NamedTuple):
    """Who claimed a socket, as ``limits`` counts sockets: by owner."""

    owner: str


def _lease(client: redis.Redis, sid: str) -> Optional[tuple]:
    """The claimed socket's place among its key's sockets (``limits.claim_socket``,
    at the intake's claim): the hub renews it while the socket lives."""
    try:
        owner = client.get(jobs.session_owner_key(sid))
    except redis.RedisError:
        return None
    return (Claimant(owner.decode()), sid) if owner else None


def _forget_owner(client: redis.Redis, sid: str) -> None:
    try:
        client.delete(jobs.session_owner_key(sid))
    except redis.RedisError:
        pass  # Redis away: the record expires on its own (SESSION_OWNER_TTL_S)


def _renew_owner(client: redis.Redis, sid: str) -> None:
    try:
        client.expire(jobs.session_owner_key(sid), subscribe.SESSION_OWNER_TTL_S)
    except redis.RedisError:
        pass
