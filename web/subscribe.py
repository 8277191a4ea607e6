"""``WS /subscribe``: a blocking client's live status stream.

The socket subscribes to its Redis channel *before* it hands out the session
id, because pub/sub has no replay: nothing the worker publishes afterwards can
be missed. Frames are forwarded verbatim: JSON as text, a pickled COMPLETED
(an inline result) as binary. The socket closes after a terminal status.
"""

from __future__ import annotations

import json
import uuid

from flask import current_app, request
from flask_sock import Sock

from ndif_celery import auth, jobs, wire

sock = Sock()
POLL_S = 1.0


def refuse_unknown_keys():
    """Before the websocket upgrade: with auth on, only a valid key may subscribe
    (the handshake fails with the same JSON refusal as ``POST /request``)."""
    if request.path == "/subscribe":
        current_app.config["NDIF_AUTH"].identify(request.headers.get(auth.HEADER))


@sock.route("/subscribe")
def subscribe(ws) -> None:
    identity = current_app.config["NDIF_AUTH"].identify(request.headers.get(auth.HEADER))
    session_id = uuid.uuid4().hex
    client = current_app.config["NDIF_REDIS"]
    # Only the key that opened the socket may submit jobs that report to it.
    client.set(jobs.session_owner_key(session_id), identity.owner, ex=current_app.config["NDIF_SETTINGS"].job_ttl_s)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(jobs.session_channel(session_id))
    try:
        ws.send(json.dumps({"session_id": session_id}))
        while ws.connected:
            message = pubsub.get_message(timeout=POLL_S)
            if message is None:
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
