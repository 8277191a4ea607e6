"""Who is asking, for the request being handled: one lookup for every route.

``POST /request``, ``GET /response``, ``/whoami``, the ``/subscribe``
handshake and the dashboard all ask the app's ``auth.Authenticator`` the same
question with the same client address (for its failed-lookup throttle); only
where the key comes from differs (the ``ndif-api-key`` header, or the
dashboard's HTTP Basic password). A refusal raises ``auth.AuthError``, which
the app's one ``errors.Refused`` handler answers.
"""

from __future__ import annotations

from typing import Optional

from flask import current_app, request

from ndif_celery.accounts import auth


def identify(key: Optional[str] = None) -> auth.Identity:
    """The caller's identity from ``key``, by default the ``ndif-api-key`` header."""
    if key is None:
        key = request.headers.get(auth.HEADER)
    return current_app.config["NDIF_AUTH"].identify(key, request.remote_addr)
