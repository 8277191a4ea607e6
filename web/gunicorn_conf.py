"""gunicorn settings for the web, derived from the ``NDIF_*`` environment.

The web is mostly *waiting*: every blocking client holds one ``/subscribe``
websocket for its job's whole life, minutes when a queue is long. Under the
default gevent worker (``NDIF_WEB_WORKER_CLASS=gevent``) a waiting socket is a
greenlet pair and a mailbox (a few KiB), and all of a process's sockets share
one Redis pub/sub connection (``web/hub.py``); gunicorn monkey-patches the
worker before it imports the app, so Flask, flask-sock, simple-websocket and
redis-py cooperate unchanged. ``gthread`` (a thread per open socket, the old
model) stays selectable; docs/jobs.md ("The web tier waits cheaply") says why gevent is the default
and docs/performance.md shows the measurements.

Each open socket is a file descriptor: the master raises its ``RLIMIT_NOFILE``
soft limit to the hard limit before it forks (the workers inherit it).
``deploy/gunicorn.conf.py`` re-exports this for operators who run gunicorn
themselves.
"""

import resource

from ndif_celery import config as _config
from ndif_celery import socketio_wire

_settings = _config.load()

# The API's port, and one per runtime (NDIF_RUNTIME_PORTS: there /env and /status are that runtime's).
bind = [f"{_settings.api_host}:{_settings.api_port}",
        *(f"{_settings.api_host}:{port}" for port in _settings.runtime_ports.values())]
workers = _settings.web_workers
worker_class = _settings.web_worker_class
threads = _settings.web_threads
worker_connections = _settings.web_connections
# A listen backlog large enough for thousands of clients connecting at once
# (the kernel caps it at net.core.somaxconn).
backlog = 4096
# Websockets live as long as their job; the worker's heartbeat (which is all
# gunicorn's timeout watches) comes from its own loop, so it can stay short.
timeout = 120
graceful_timeout = 30
# Also the most gunicorn waits for a request's headers, and to drain the body of
# a request refused before it was read (web/uploads.py): a slow client's hold.
keepalive = 2
# A header with an underscore is dropped: WSGI names `a_b` and `a-b` alike, so
# keeping it would merge it with its twin (and a proxy may filter one spelling,
# not the other). The one the nnsight 0.6/0.7 clients send is kept apart: see
# keep_socketio_session_header below.
header_map = "drop"
# Repeated warnings and errors written a few times a window, then counted (ndif_celery/log_limits.py).
logger_class = "web.gunicorn_logging.Logger"
accesslog = "-"
errorlog = "-"
loglevel = _settings.log_level.lower()
proc_name = "ndif-celery-web"


def raise_open_files_limit() -> tuple:
    """RLIMIT_NOFILE soft -> hard (each websocket is a file descriptor); the
    (soft, hard) limits now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def keep_socketio_session_header() -> None:
    """Keep the header ``ndif-session_id`` under a name of the server's own.

    The 0.6/0.7 clients name their Socket.IO session there. It reaches the
    app as ``socketio_wire.SESSION_AS_READ``, a name no client header takes:
    a client's own header of that name is dropped, as is every other
    header with an underscore. So nothing can merge with it."""
    from gunicorn.http.message import Message

    policy = Message._apply_header_policy
    if getattr(policy, "keeps_socketio_session", False):
        return
    sent, read = socketio_wire.SESSION.upper(), socketio_wire.SESSION_AS_READ.upper()

    def apply(self, name, value, *args, **kwargs):
        if name == sent:
            return read, value
        if name == read:
            return None
        return policy(self, name, value, *args, **kwargs)

    apply.keeps_socketio_session = True
    Message._apply_header_policy = apply


keep_socketio_session_header()


def on_starting(server) -> None:
    soft, _ = raise_open_files_limit()
    # The limit is per process: each worker holds its own connections.
    per_worker = worker_connections if worker_class == "gevent" else threads
    if soft != resource.RLIM_INFINITY and soft < per_worker + 256:
        server.log.warning(
            "open-files limit %d is below the %d connections a web worker may hold plus 256 for its other "
            "files; raise the hard limit (systemd LimitNOFILE, compose ulimits nofile, ulimit -Hn) or lower "
            "NDIF_WEB_CONNECTIONS",
            soft, per_worker,
        )
