"""Who is asking, for the request being handled: one lookup for every route.

``POST /request``, ``GET /response``, ``/whoami``, the ``/subscribe``
handshake and the dashboard all ask the app's ``auth.Authenticator`` the same
question with the same client address (for its failed-lookup throttle); only
where the key comes from differs (the ``ndif-api-key`` header, or the
dashboard's HTTP Basic password). A refusal raises ``auth.AuthError``, which
the app's one ``errors.Refused`` handler answers.
"""

from __future__ import annotations

import ipaddress
from typing import Optional

from flask import current_app, request

from ndif_celery.accounts import auth


def identify(key: Optional[str] = None) -> auth.Identity:
    """The caller's identity from ``key``, by default the ``ndif-api-key`` header."""
    if key is None:
        key = request.headers.get(auth.HEADER)
    return current_app.config["NDIF_AUTH"].identify(key, request.remote_addr)


def client_network(address: Optional[str]) -> str:
    """The party a client address counts as: an IPv4 address, or an IPv6 /64.

    One host is usually given a whole /64, so counting its addresses one by
    one would give it billions of shares."""
    try:
        ip = ipaddress.ip_address(address or "")
    except ValueError:
        return address or ""
    if ip.version == 4:
        return str(ip)
    if ip.ipv4_mapped is not None:  # an IPv4 client of a dual-stack socket
        return str(ip.ipv4_mapped)
    return str(ipaddress.ip_network(f"{ip}/64", strict=False))
