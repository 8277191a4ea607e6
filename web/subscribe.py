"""``WS /subscribe``: a blocking client's live status stream.

The socket subscribes to its Redis channel *before* it hands out the session
id, because pub/sub has no replay: nothing the worker publishes afterwards can
be missed. All its Redis work is done before the websocket upgrade, where a
failure can still be answered over HTTP. The subscription is on the web process's one shared pub/sub
connection (``web/hub.py``), which routes each frame to the socket's mailbox;
a waiting socket holds no thread and no Redis connection of its own (under
gunicorn's gevent worker, the default: ``web/gunicorn_conf.py``). Frames are
forwarded verbatim: JSON as text, a pickled COMPLETED (an inline result) as
binary. The socket closes after a terminal status.

The client sends nothing after the handshake, so the socket reads nothing: a
message at all closes it (1008), one over :data:`INBOUND_MAX_BYTES` is cut
while it arrives, and permessage-deflate is declined (wsproto inflates a
compressed frame whole, so a few hundred KiB could claim gigabytes of the
web's memory before any size check).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import redis
import simple_websocket.ws
from flask import current_app, g, request
from flask_sock import ConnectionClosed, Sock
from wsproto.extensions import PerMessageDeflate

from ndif_celery import messages, wire
from ndif_celery.accounts import auth, limits
from ndif_celery.farm import actions
from ndif_celery.state import jobs

from .hub import Hub
from .identity import client_network, identify

log = logging.getLogger("ndif_celery.web.subscribe")
sock = Sock()
# The longest a socket sleeps without looking at its connection (a client that
# closes wakes it at once; this only bounds a missed wake-up).
IDLE_WAIT_S = 60.0
# How long a session's owner record outlives its socket's last look, should the
# web process die with the socket open (a closed socket deletes it at once):
# a handshake that never submits a job leaves nothing in Redis for long.
SESSION_OWNER_TTL_S = int(2 * IDLE_WAIT_S + 30)
# The most a client's message may be before it is cut (it should send none).
INBOUND_MAX_BYTES = 1024
SERVER_OPTIONS = {"max_message_size": INBOUND_MAX_BYTES}  # flask-sock's SOCK_SERVER_OPTIONS
# A missing (401), malformed (400) or unknown key (403) at the handshake.
KEY_REFUSALS = (400, 401, 403)
# How long a socket opened with a refused key waits for its client's POST.
KEY_REFUSED_HOLD_S = 10.0


class DeflateDeclined(PerMessageDeflate):
    """permessage-deflate, never accepted: a client that sends compressed
    frames anyway breaks the protocol, and its socket is closed."""

    def accept(self, offer):
        return None


# simple-websocket offers its server's extensions by this module-level name.
simple_websocket.ws.PerMessageDeflate = DeflateDeclined


def hub() -> Hub:
    """This web process's hub, made on first use (after gunicorn forked the worker)."""
    found = current_app.extensions.get("ndif_hub")
    if found is None:
        settings = current_app.config["NDIF_SETTINGS"]
        pubsub_client = jobs.connect(settings.redis_url, settings.redis_outage_s, health_check_s=0)
        found = current_app.extensions.setdefault(
            "ndif_hub", Hub(current_app.config["NDIF_REDIS"], pubsub_client, subscribe_timeout_s=settings.redis_outage_s + 5,
                            socket_lease_s=settings.socket_lease_s)
        )
    return found


def open_socket():
    """Before the websocket upgrade: everything that needs Redis.

    The socket counts among its address's (``web/open_sockets.py``). With auth
    on, only a valid key may subscribe, and only while it holds fewer
    than ``NDIF_MAX_WEBSOCKETS_PER_KEY`` sockets; then the session is recorded
    as the key's and its channel subscribed (confirmed by Redis). A refusal
    raises ``errors.Refused``, an unreachable Redis ``redis.ConnectionError``,
    here, so the handshake fails with the app's one JSON answer, as ``POST
    /request`` does (the nnsight client shows it in its ``Handshake status
    ...`` error). After the upgrade no HTTP answer can be given: an error there
    would write a 500 into the open socket, which the client reads as a broken
    frame ("rsv is not implemented").
    """
    if request.path != "/subscribe":
        return
    client, settings = current_app.config["NDIF_REDIS"], current_app.config["NDIF_SETTINGS"]
    session_id = uuid.uuid4().hex
    current_app.config["NDIF_OPEN_SOCKETS"].enter(session_id, client_network(request.remote_addr), claimed=True)
    g.ndif_counted = session_id
    g.ndif_session_id = session_id
    try:
        identity = identify()
    except auth.AuthError as refusal:
        if refusal.status not in KEY_REFUSALS:
            raise
        g.ndif_key_refused = True  # see subscribe(): its client reads the refusal at its POST
        return
    g.ndif_identity = identity
    lease = None
    limits.count_handshake(client, identity, settings)
    if limits.claim_socket(client, identity, session_id, settings):
        g.ndif_socket = session_id
        lease = (identity, session_id)
    # Only the key that opened the socket may submit jobs that report to it:
    # recorded while the socket lives (renewed at each look, deleted at its close).
    client.set(jobs.session_owner_key(session_id), identity.owner, ex=SESSION_OWNER_TTL_S)
    g.ndif_box = hub().open(session_id, threading.Event(), lease)


def close_socket(_error=None) -> None:
    """After the socket closed (or its handshake failed): leave the hub, forget
    the session's owner, free the key's slot."""
    if g.pop("ndif_box", None) is not None:
        hub().close(g.ndif_session_id)
        _forget_owner(g.ndif_session_id)
    counted = g.pop("ndif_counted", None)
    if counted is not None:
        current_app.config["NDIF_OPEN_SOCKETS"].leave(counted)
    session_id = g.pop("ndif_socket", None)
    if session_id is not None:
        limits.release_socket(current_app.config["NDIF_REDIS"], g.ndif_identity, session_id)


def _forget_owner(session_id: str) -> None:
    try:
        current_app.config["NDIF_REDIS"].delete(jobs.session_owner_key(session_id))
    except redis.RedisError:
        pass  # Redis away: the record expires on its own (SESSION_OWNER_TTL_S)


def _renew_owner(session_id: str) -> None:
    try:
        current_app.config["NDIF_REDIS"].expire(jobs.session_owner_key(session_id), SESSION_OWNER_TTL_S)
    except redis.RedisError:
        pass


def client_left(client: redis.Redis, celery, settings, session_id: str) -> None:
    """The socket closed before its jobs ended: its client went away (Ctrl-C,
    a dead process). Each job still open is marked gone; a poll by its key
    (``GET /response/<id>``) unmarks it; one still marked after
    ``NDIF_DISCONNECT_GRACE_S`` is cancelled, so nobody's model waits on a
    result nobody will read. Called by ``/subscribe`` and by the Socket.IO
    sockets (``web/sio.py``), which run outside any Flask request: hence the
    explicit Redis client, Celery app and settings."""
    grace_s = settings.disconnect_grace_s
    if not grace_s:
        return
    try:
        ids = [job_id.decode() for job_id in client.smembers(jobs.session_jobs_key(session_id))]
        latest = client.mget([jobs.status_key(job_id) for job_id in ids]) if ids else []
        left = [job_id for job_id, status in zip(ids, latest) if not jobs.ended(status)]
        if not left:
            return
        pipe = client.pipeline(transaction=False)
        for job_id in left:
            pipe.set(jobs.gone_key(job_id), 1, ex=int(grace_s) + 60)
        pipe.execute()
    except redis.RedisError:
        log.warning("session %s closed with jobs open; Redis away, not cancelling them", session_id, exc_info=True)
        return
    timer = threading.Timer(grace_s, _cancel_gone, (client, celery, settings, left))
    timer.daemon = True
    timer.start()


def _cancel_gone(client, celery, settings, job_ids: list) -> None:
    """At the grace's end: cancel each job whose client did not come back."""
    for job_id in job_ids:
        try:
            if client.delete(jobs.gone_key(job_id)) and not jobs.finished(client, job_id):
                done = actions.kill(client, celery, job_id, settings.job_ttl_s,
                                    messages.client_gone(settings.disconnect_grace_s))
                log.info("job %s: its client went away; %s", job_id, done)
        except actions.FarmError:
            pass  # it ended meanwhile
        except Exception:  # noqa: BLE001 - a timer's failure is logged, never raised into the web
            log.exception("job %s: could not cancel it after its client went away", job_id)


def _hold_key_refused(ws) -> None:
    """A handshake whose key was refused: a session id that leads nowhere.

    Refused at the handshake, the nnsight client would raise a
    ``WebSocketBadStatusException`` with the sentence lost in a header dump. So
    the socket opens, names a session nothing is published to, and the
    client's POST, refused with the same key, shows ``RemoteError: Failed to
    send request: <why>``. Such a socket holds no Redis state, counts among
    its address's sockets, and closes within :data:`KEY_REFUSED_HOLD_S`."""
    ws.send('{"session_id": "%s"}' % g.ndif_session_id)
    deadline = time.monotonic() + KEY_REFUSED_HOLD_S
    while ws.connected and (left := deadline - time.monotonic()) > 0:
        ws.event.wait(left)
        ws.event.clear()
        if ws.input_buffer:
            break
    if ws.connected:
        ws.close(reason=1008, message="API key refused")


@sock.route("/subscribe")
def subscribe(ws) -> None:
    if g.get("ndif_key_refused"):
        return _hold_key_refused(ws)
    box = g.ndif_box
    # simple-websocket sets ws.event when the client closes (or sends): the
    # mailbox wakes the same event when a frame arrives, so one wait serves
    # both. Set once, for a frame that came before the upgrade.
    box.wake = ws.event
    ws.event.set()
    ended = False
    renewed = time.monotonic()  # the owner record was written at the handshake
    try:
        ws.send('{"session_id": "%s"}' % g.ndif_session_id)
        while ws.connected:
            ws.event.wait(IDLE_WAIT_S)
            ws.event.clear()
            if time.monotonic() - renewed >= IDLE_WAIT_S:  # not at every frame: well inside its TTL
                _renew_owner(g.ndif_session_id)
                renewed = time.monotonic()
            if ws.input_buffer:  # the client sent a message: this socket takes none
                ws.close(reason=1008, message="this socket takes no messages")
                return
            while box.frames:
                frame = box.frames.popleft()
                ws.send(frame.decode() if frame[:1] == b"{" else frame)
                if wire.frame_status(frame) in wire.TERMINAL:
                    ended = True
                    return
            if box.ended is not None:  # ended while its frame was lost (see hub.ended_unheard)
                ws.send(box.ended.decode())
                ended = True
                return
    except ConnectionClosed:
        raise
    except Exception:  # noqa: BLE001 - never let it become an HTTP answer inside the socket
        log.exception("subscribe: session %s failed", g.ndif_session_id)
        ws.close(reason=1011, message="internal server error")
    finally:
        if not ended:  # the client left (or was closed) before its job's final status
            config = current_app.config
            client_left(config["NDIF_REDIS"], config["NDIF_CELERY"], config["NDIF_SETTINGS"], g.ndif_session_id)
