"""``WS /subscribe``: a blocking client's live status stream.

The socket subscribes to its Redis channel *before* it hands out the session
id, because pub/sub has no replay: nothing the worker publishes afterwards can
be missed. The subscription is on the web process's one shared pub/sub
connection (``web/hub.py``), which routes each frame to the socket's mailbox;
a waiting socket holds no thread and no Redis connection of its own (under
gunicorn's gevent worker, the default: ``web/gunicorn_conf.py``). Frames are
forwarded verbatim: JSON as text, a pickled COMPLETED (an inline result) as
binary. The socket closes after a terminal status.
"""

from __future__ import annotations

import uuid

from flask import current_app, g, request
from flask_sock import Sock

from ndif_celery import jobs, limits, wire

from .hub import Hub
from .identity import identify

sock = Sock()
# The longest a socket sleeps without looking at its connection (a client that
# closes wakes it at once; this only bounds a missed wake-up).
IDLE_WAIT_S = 60.0


def hub() -> Hub:
    """This web process's hub, made on first use (after gunicorn forked the worker)."""
    found = current_app.extensions.get("ndif_hub")
    if found is None:
        settings = current_app.config["NDIF_SETTINGS"]
        pubsub_client = jobs.connect(settings.redis_url, settings.redis_outage_s, health_check_s=0)
        found = current_app.extensions.setdefault(
            "ndif_hub", Hub(current_app.config["NDIF_REDIS"], pubsub_client, subscribe_timeout_s=settings.redis_outage_s + 5)
        )
    return found


def refuse_unknown_keys():
    """Before the websocket upgrade: with auth on, only a valid key may subscribe,
    and only while it holds fewer than ``NDIF_MAX_WEBSOCKETS_PER_KEY`` sockets
    (a refusal raises ``errors.Refused`` here, before the upgrade, so the
    handshake fails with the app's one JSON refusal, as ``POST /request`` does;
    the nnsight client shows it in its ``Handshake status 429 ...`` error)."""
    if request.path == "/subscribe":
        identity = identify()
        session_id = uuid.uuid4().hex
        if limits.claim_socket(current_app.config["NDIF_REDIS"], identity, session_id, current_app.config["NDIF_SETTINGS"]):
            g.ndif_socket = session_id
        g.ndif_identity, g.ndif_session_id = identity, session_id


def release_socket(_error=None) -> None:
    """After the socket closed (or its handshake failed): free the key's slot."""
    session_id = g.pop("ndif_socket", None)
    if session_id is not None:
        limits.release_socket(current_app.config["NDIF_REDIS"], g.ndif_identity, session_id)


@sock.route("/subscribe")
def subscribe(ws) -> None:
    identity, session_id = g.ndif_identity, g.ndif_session_id
    lease = (identity, session_id) if "ndif_socket" in g else None
    client = current_app.config["NDIF_REDIS"]
    # Only the key that opened the socket may submit jobs that report to it.
    client.set(jobs.session_owner_key(session_id), identity.owner, ex=current_app.config["NDIF_SETTINGS"].job_ttl_s)
    the_hub = hub()
    # simple-websocket sets ws.event when the client closes (or sends): the hub
    # sets the same event when a frame arrives, so one wait serves both.
    box = the_hub.open(session_id, ws.event, lease)
    try:
        ws.send('{"session_id": "%s"}' % session_id)
        while ws.connected:
            ws.event.wait(IDLE_WAIT_S)
            ws.event.clear()
            while box.frames:
                frame = box.frames.popleft()
                ws.send(frame.decode() if frame[:1] == b"{" else frame)
                if wire.frame_status(frame) in wire.TERMINAL:
                    return
            if box.ended is not None:  # ended while its frame was lost (see hub.ended_unheard)
                ws.send(box.ended.decode())
                return
    finally:
        the_hub.close(session_id)
