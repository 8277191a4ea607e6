"""What the dashboard's page and its admin actions share: who the operator
is, the refusal a browser reads, and the database handle.

With ``NDIF_AUTH=1`` an operator is an API key tagged ``admin``, shown as the
HTTP Basic password (a browser asks for it after a 401 with a
``WWW-Authenticate`` challenge); a key without the tag gets 403. With auth
off the page is open and nobody is an operator: no admin actions.
"""

from __future__ import annotations

from typing import Optional

from flask import Response, current_app, render_template_string, request

from ndif_celery.accounts import db
from ndif_celery.accounts.auth import AuthError, Identity

from .identity import identify

REALM = 'Basic realm="ndif-celery dashboard", charset="UTF-8"'


def challenge(detail: str, status: int = 401) -> Response:
    """The one refusal that is not the app's JSON ``errors.Refused`` answer: a
    person's browser reads it, so it is an HTML page, and for 401 it carries
    the challenge that makes the browser ask for the key."""
    page = render_template_string(
        "<!doctype html><title>{{ status }}</title><h1>{{ status }}</h1><p>{{ detail }}</p>",
        status=status, detail=detail,
    )
    response = Response(page, status=status, mimetype="text/html")
    if status == 401:
        response.headers["WWW-Authenticate"] = REALM
    return response


def sign_in() -> tuple[Optional[Identity], Optional[Response]]:
    """``(the admin's identity, None)``; ``(None, None)`` with auth off (an open
    page, no operator); ``(None, the refusal to send)`` otherwise."""
    if not current_app.config["NDIF_SETTINGS"].auth:
        return None, None
    credentials = request.authorization
    key = credentials.password if credentials is not None and credentials.type == "basic" else None
    if not key:
        return None, challenge("The dashboard needs an admin API key: sign in with any user name and the key as "
                               "password.")
    try:
        identity = identify(key)
    except AuthError as error:
        if error.status == 503:
            return None, challenge(error.detail, 503)
        return None, challenge(f"{error.detail} Sign in with any user name and an admin API key as password.")
    if "admin" not in identity.tags:
        return None, challenge("This API key is not an admin key (ndif-celery keys create --admin).", 403)
    return identity, None


def ledger_engine():
    """The keys, ledger and audit database, opened once per web process."""
    engine = current_app.config.get("NDIF_LEDGER_ENGINE")
    if engine is None:
        engine = current_app.config["NDIF_LEDGER_ENGINE"] = db.engine_for(current_app.config["NDIF_SETTINGS"].database_url)
    return engine
