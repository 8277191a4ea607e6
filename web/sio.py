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
* **Spaced, LOG lines merged.** Those clients' python-socketio handles each
  engine.io message in a thread of its own, and an event is two messages (its
  header, then its bytes). When they follow closely, a client's threads can
  run out of order: the bytes are read before the header that announces them,
  or the next event's header is taken for this one's bytes, and the client
  fails (``a bytes-like object is required, not 'str'``). So an event's bytes
  follow its header after :data:`ATTACHMENT_GAP_S`, the relay sends at most one
  event per :data:`EVENT_SPACING_S`, and LOG lines that wait meanwhile go as
  one LOG. The gaps make the race need a thread held back that long; only the
  client can close it.
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
shows.

Those clients only listen, so the door takes little (:class:`ListeningServer`):

* **Websocket only.** Their clients connect with ``transports=["websocket"]``;
  the polling transport is refused.
* **Messages cut as they arrive.** A message over :data:`MESSAGE_MAX_BYTES`
  is cut while its fragments arrive (simple-websocket's bound, which
  engine.io's drivers leave unset); permessage-deflate is declined, as on
  ``/subscribe``.
* **One CONNECT, nothing else.** Besides engine.io's pongs, a client sends its
  namespace CONNECT once and may DISCONNECT. Anything else (an event, a
  binary packet, a malformed packet, a second CONNECT) closes its connection.
* **A deadline for the CONNECT.** A connection that has not sent it within
  ``NDIF_SOCKETIO_CONNECT_S`` is closed; so is one whose namespace the server
  ends (the namespace alone would leave the connection open).
* **Counted before the upgrade** (``web/open_sockets.py``): per address, and
  while unclaimed per process, refused past either bound (401 with a sentence).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import NamedTuple, Optional

import redis
import simple_websocket
import socketio
from flask import Flask

from ndif_celery import socketio_wire, wire
from ndif_celery.accounts import limits
from ndif_celery.errors import Refused
from ndif_celery.state import jobs

from . import subscribe
from .identity import client_network
from .open_sockets import OpenSockets

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
#: The least time between two events on one socket (see "Spaced" above).
EVENT_SPACING_S = 0.05
#: Between an event's header and its bytes (see the module's doc): a thread start's worth, many times over.
ATTACHMENT_GAP_S = 0.05
#: How soon an unclaimed socket's owner is read again when Redis could not answer.
CLAIM_RETRY_S = 5.0
#: The largest message a client may send: its CONNECT is a few bytes.
MESSAGE_MAX_BYTES = 1024
#: engine.io packets a listening client sends: close, pong, message.
CLIENT_PACKETS = ("1", "3", "4")
#: socket.io packets inside its messages: CONNECT and DISCONNECT.
CONNECT, DISCONNECT = "0", "1"
#: How often connections late with their CONNECT are looked for.
REAP_EVERY_S = 1.0
#: How often a reading thread looks whether its connection closed (``threading`` mode only).
THREAD_LOOK_EVERY_S = 1.0


def _bounded(websocket: type, look_every_s: Optional[float]) -> type:
    """The driver's websocket class, cut at :data:`MESSAGE_MAX_BYTES` while a
    message arrives, and read as closed on any packet those clients never send.

    ``look_every_s``: under threads, a read looks at the connection this often.
    simple-websocket wakes a reader before it marks the connection closed, so
    a thread may wait on a closed one for good; greenlets do not race."""

    class BoundedWebSocket(websocket):
        def __init__(self, handler, server):
            super().__init__(handler, server)
            self.server_args["max_message_size"] = MESSAGE_MAX_BYTES

        def wait(self):
            try:
                data = self.ws.receive(timeout=look_every_s)
                while data is None and self.ws.connected:
                    data = self.ws.receive(timeout=look_every_s)
            except simple_websocket.ConnectionClosed:
                return None
            if data is not None and (not isinstance(data, str) or data[:1] not in CLIENT_PACKETS):
                return None  # engine.io then closes the connection, as if the client had
            return data

        def close(self):
            """The close frame, then the TCP connection: a client that never
            answers the close frame would otherwise hold the connection."""
            super().close()
            try:
                self.ws.sock.shutdown(socket.SHUT_RDWR)
            except (OSError, AttributeError):
                pass  # already closed, or never upgraded

    return BoundedWebSocket


class ListeningServer(socketio.Server):
    """Socket.IO for clients that only listen: one CONNECT, in time, and nothing else."""

    def __init__(self, open_sockets: OpenSockets, connect_s: float, **options) -> None:
        super().__init__(transports=["websocket"], max_http_buffer_size=MESSAGE_MAX_BYTES, **options)
        look_every_s = None if self.async_mode == "gevent" else THREAD_LOOK_EVERY_S
        self.eio._async = {**self.eio._async, "websocket": _bounded(self.eio._async["websocket"], look_every_s)}
        self.open_sockets = open_sockets
        self.connect_s = connect_s
        self.connect_due: dict[str, float] = {}  # engine.io sid -> when its CONNECT is late
        self.lock = threading.Lock()
        self.reaper_started = False

    def _handle_eio_connect(self, eio_sid, environ):
        """Before the upgrade: counted by address, or refused with a sentence (401)."""
        try:
            self.open_sockets.enter(_counted(eio_sid), client_network(environ.get("REMOTE_ADDR")), claimed=False)
        except Refused as refusal:
            return {"message": refusal.detail}
        with self.lock:
            self.connect_due[eio_sid] = time.monotonic() + self.connect_s
            start, self.reaper_started = not self.reaper_started, True
        if start:  # in the process that serves (after gunicorn's fork)
            self.start_background_task(self._reap)
        return super()._handle_eio_connect(eio_sid, environ)

    def emit_spaced(self, event: str, data, sid: str) -> None:
        """``emit(event, data, to=sid)``, a binary event's attachments each
        :data:`ATTACHMENT_GAP_S` after what precedes them (see the module's doc)."""
        eio_sid = self.manager.eio_sid_from_sid(sid, "/")
        if eio_sid is None:
            return  # disconnected meanwhile
        encoded = self.packet_class(socketio.packet.EVENT, namespace="/", data=[event, data]).encode()
        for index, part in enumerate(encoded if isinstance(encoded, list) else [encoded]):
            if index:
                self.sleep(ATTACHMENT_GAP_S)
            self.eio.send(eio_sid, part)

    def _handle_eio_message(self, eio_sid, data):
        kind = data[:1] if isinstance(data, str) else None
        if kind == CONNECT:
            with self.lock:
                first = self.connect_due.pop(eio_sid, None) is not None
            if not first:
                return self._shut(eio_sid)
        elif kind != DISCONNECT:
            return self._shut(eio_sid)
        try:
            super()._handle_eio_message(eio_sid, data)
        except ValueError:  # a malformed packet
            return self._shut(eio_sid)
        if kind == CONNECT and self.manager.sid_from_eio_sid(eio_sid, "/") is None:
            self._shut(eio_sid)  # its CONNECT was refused: nothing more will come of it

    def _handle_eio_disconnect(self, eio_sid, reason):
        with self.lock:
            self.connect_due.pop(eio_sid, None)
        self.open_sockets.leave(_counted(eio_sid))
        super()._handle_eio_disconnect(eio_sid, reason)

    def disconnect(self, sid, namespace=None, ignore_queue=False):
        """The namespace, and the connection under it: those clients have only the one."""
        eio_sid = self.manager.eio_sid_from_sid(sid, namespace or "/")
        super().disconnect(sid, namespace, ignore_queue)
        if eio_sid is not None:
            self._shut(eio_sid)

    def claimed(self, sid: str) -> None:
        """A request claimed the socket: it counts no more among the unclaimed."""
        eio_sid = self.manager.eio_sid_from_sid(sid, "/")
        if eio_sid is not None:
            self.open_sockets.claim(_counted(eio_sid))

    def _shut(self, eio_sid: str) -> None:
        try:
            self.eio.disconnect(eio_sid)
        except KeyError:
            pass  # already gone

    def _reap(self) -> None:
        """Close connections late with their CONNECT; forget counts of
        connections engine.io dropped without a disconnect (a failed upgrade)."""
        while True:
            self.sleep(REAP_EVERY_S)
            try:
                now = time.monotonic()
                with self.lock:
                    late = [eio_sid for eio_sid, due in self.connect_due.items() if due <= now]
                for eio_sid in late:
                    self._shut(eio_sid)
                live = {_counted(eio_sid) for eio_sid in list(self.eio.sockets)}
                for counted in self.open_sockets.held() - live:
                    if counted.startswith(_COUNTED_PREFIX):
                        with self.lock:
                            self.connect_due.pop(counted[len(_COUNTED_PREFIX):], None)
                        self.open_sockets.leave(counted)
            except Exception:  # noqa: BLE001 - the reaper outlives any one failure
                log.exception("socket.io: the reaper failed a round")


_COUNTED_PREFIX = "socket.io:"


def _counted(eio_sid: str) -> str:
    """An engine.io connection's name among the process's counted sockets."""
    return _COUNTED_PREFIX + eio_sid


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
    settings = app.config["NDIF_SETTINGS"]
    server = ListeningServer(app.config["NDIF_OPEN_SOCKETS"], settings.socketio_connect_s,
                             async_mode="gevent" if worker_class == "gevent" else "threading",
                             cors_allowed_origins=[], logger=False, engineio_logger=False)
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


def _relay(server: ListeningServer, client: redis.Redis, sid: str, socket: Socket) -> None:
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


def _relay_statuses(server: ListeningServer, client: redis.Redis, sid: str, socket: Socket) -> None:
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
                server.claimed(sid)
            except redis.RedisError:
                look_at_claim = now + CLAIM_RETRY_S  # Redis away: asked again, the socket kept meanwhile
        while box.frames and not socket.closed:
            look_at_claim = None  # a status came: a job was submitted with this session
            if box.lease is None:
                box.lease = _lease(client, sid)
                server.claimed(sid)
            if _send(server, sid, _next_frame(box.frames)):
                socket.ended = True
                return
            _wait(socket, EVENT_SPACING_S)
        if box.ended is not None and not socket.closed:  # ended while its frame was lost (see hub.ended_unheard)
            _send(server, sid, box.ended)
            socket.ended = True
            return
        wake_at = renewed + RENEW_S if look_at_claim is None else min(renewed + RENEW_S, look_at_claim)
        box.wake.wait(max(0.0, wake_at - time.monotonic()))
        box.wake.clear()


def _next_frame(frames) -> bytes:
    """The first waiting frame; a LOG with the LOG lines of its job right behind it joined in."""
    frame = frames.popleft()
    fields = _log_fields(frame)
    if fields is None:
        return frame
    lines = [fields.get("description") or ""]
    while frames:
        following = _log_fields(frames[0])
        if following is None or following.get("id") != fields.get("id"):
            break
        frames.popleft()
        lines.append(following.get("description") or "")
    if len(lines) == 1:
        return frame
    return wire.response_json(fields["id"], wire.LOG, "\n".join(lines)).encode()


def _log_fields(frame: bytes) -> Optional[dict]:
    if frame[:1] != b"{":
        return None
    try:
        fields = json.loads(frame)
    except ValueError:
        return None
    return fields if isinstance(fields, dict) and fields.get("status") == wire.LOG and "id" in fields else None


def _send(server: ListeningServer, sid: str, frame: bytes) -> bool:
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
    server.emit_spaced(EVENT, translated, sid)
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
