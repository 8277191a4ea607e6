"""``WS /subscribe``: a blocking client's live status stream.

The socket subscribes to its Redis channel *before* it hands out the session
id, because pub/sub has no replay: nothing the worker publishes afterwards can
be missed. Frames are forwarded verbatim: JSON as text, a pickled COMPLETED
(an inline result) as binary. The socket closes after a terminal status.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Optional

from flask import current_app, g, request
from flask_sock import Sock

from ndif_celery import jobs, limits, wire

from .identity import identify

sock = Sock()
POLL_S = 1.0
# How often a quiet socket checks whether its job ended unheard (see _ended_meanwhile).
RESYNC_S = 5.0


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
    counted = "ndif_socket" in g
    client = current_app.config["NDIF_REDIS"]
    # Only the key that opened the socket may submit jobs that report to it.
    client.set(jobs.session_owner_key(session_id), identity.owner, ex=current_app.config["NDIF_SETTINGS"].job_ttl_s)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(jobs.session_channel(session_id))
    try:
        ws.send(json.dumps({"session_id": session_id}))
        checked = renewed = time.monotonic()
        while ws.connected:
            if counted and time.monotonic() - renewed >= RESYNC_S:
                renewed = time.monotonic()
                limits.renew_socket(client, identity, session_id)
            message = pubsub.get_message(timeout=POLL_S)
            if message is None:
                if time.monotonic() - checked >= RESYNC_S:
                    checked = time.monotonic()
                    ended = _ended_meanwhile(client, session_id)
                    if ended is not None:
                        ws.send(ended.decode())
                        break
                continue
            frame = message["data"]
            if frame[:1] == b"{":
                ws.send(frame.decode())
            else:
                ws.send(frame)
            if wire.frame_status(frame) in wire.TERMINAL:
                break
    finally:
        pubsub.close()


def _ended_meanwhile(client, session_id: str) -> Optional[bytes]:
    """The final status of a job of this session that ended without its frame
    reaching us, else None.

    Pub/sub has no replay: a status published while the subscription was being
    re-established (Redis restarted) is gone. The latest-status key is not, and
    a result that found nobody listening was kept in the store, so the status
    stored for pollers is complete. An inline result was, by definition,
    delivered to a subscriber (this socket): it is waiting to be read.
    """
    for job_id in client.smembers(jobs.session_jobs_key(session_id)):
        latest = jobs.latest_status(client, job_id.decode())
        if not jobs.ended(latest):
            continue
        if (json.loads(latest).get("meta") or {}).get("inline"):
            continue  # its result frame was delivered to this socket: read it next
        return latest
    return None
