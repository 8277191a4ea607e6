"""Socket.IO at ``/ws/socket.io``: where the nnsight 0.6 and 0.7 clients wait.

Those clients open a Socket.IO websocket before they submit a blocking job
(no API key on it), then POST ``/request`` with its session id. This farm runs
no worker for them yet, so the socket is accepted only so that the POST that
follows is made, and answered with the sentence that names the client's
version and the versions this farm serves (``intake.check_runtime``): without
it the client dies in its connect with an opaque "Connection error".

An accepted socket carries nothing and is closed after :data:`IDLE_S`; the
sockets of a web process are bounded by gunicorn's ``worker_connections`` like
every other connection. Under the gevent worker the socket is a greenlet;
engine.io uses simple-websocket, as ``/subscribe`` does.
"""

from __future__ import annotations

import logging

import socketio

log = logging.getLogger("ndif_celery.web.sio")

PATH = "ws/socket.io"
#: How long an accepted socket stays open: the client POSTs right after it connects.
IDLE_S = 60


def wrap(wsgi_app, worker_class: str):
    """``wsgi_app`` with the Socket.IO endpoint in front of it (other paths pass through)."""
    server = socketio.Server(async_mode="gevent" if worker_class == "gevent" else "threading",
                             cors_allowed_origins=[], logger=False, engineio_logger=False,
                             max_http_buffer_size=1024)

    @server.event
    def connect(sid, environ, auth=None):
        server.start_background_task(_close_later, server, sid)

    return socketio.WSGIApp(server, wsgi_app, socketio_path=PATH)


def _close_later(server, sid: str) -> None:
    server.sleep(IDLE_S)
    try:
        server.disconnect(sid)
    except Exception:  # noqa: BLE001 - already gone
        pass
