"""``/dtype/<name>/...``: a client picks a quantized deployment by its URL.

nnsight 0.8.1's model key names a repo and revision, never how the weights are
held, so two quantizations of one repo cannot be told apart by the key. The
client does choose its host, per call (``remote="http://farm:8001/dtype/nf4"``)
or in ``CONFIG.API.HOST``, and composes every URL from it by appending. So the
prefix is stripped here, before any route or Socket.IO sees the path, and the
name it gave is kept in the request's environ for the intake.
"""

from __future__ import annotations

from typing import Callable

#: The path segment that opens the prefix.
SEGMENT = "/dtype/"
#: Where the name the URL gave is kept for the routes (as written; the intake checks it).
ENVIRON_KEY = "ndif.dtype"
#: A longer name is not a format: the intake would refuse it anyway.
MAX_NAME_CHARS = 40


def wrap(wsgi_app: Callable) -> Callable:
    """``wsgi_app`` served under ``/dtype/<name>`` as at the root."""

    def app(environ: dict, start_response: Callable):
        path = environ.get("PATH_INFO", "")
        if path.startswith(SEGMENT):
            name, slash, rest = path[len(SEGMENT):].partition("/")
            if name and len(name) <= MAX_NAME_CHARS:
                environ[ENVIRON_KEY] = name
                environ["SCRIPT_NAME"] = environ.get("SCRIPT_NAME", "") + SEGMENT + name
                environ["PATH_INFO"] = slash + rest
        return wsgi_app(environ, start_response)

    return app
