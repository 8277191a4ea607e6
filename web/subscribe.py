"""``WS /subscribe``: a blocking client's live status stream.

The socket subscribes to its Redis channel *before* it hands out the session
id, because pub/sub has no replay: nothing the worker publishes afterwards can
be missed. Frames are forwarded verbatim: JSON as text, a pickled COMPLETED
(an inline result) as binary. The socket closes after a terminal status.
"""

from __future__ import annotations

import json
import uuid

from flask import current_app
from flask_sock import Sock

from ndif_celery import jobs, wire

sock = Sock()
POLL_S = 1.0


@sock.route("/subscribe")
def subscribe(ws) -> None:
    session_id = uuid.uuid4().hex
    pubsub = current_app.config["NDIF_REDIS"].pubsub(ignore_subscribe_messages=True)
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
