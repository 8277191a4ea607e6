"""Downloads of results kept by the filesystem store.

:class:`ndif_celery.store.FilesystemStore` hands clients URLs of the form
``/results/<key>?expires=...&signature=...``; this blueprint checks the
signature and streams the file. No session or database is involved: the
signature is the whole authorisation, which is why it covers the key and the
expiry. With an S3 store clients download from the object store directly and
this route only says so.

Must stay free of torch (and anything else heavy): the web process imports it.
"""

from __future__ import annotations

from flask import Blueprint, current_app, request, send_file

from ndif_celery.errors import Refused
from ndif_celery.store import FilesystemStore

bp = Blueprint("results", __name__)


@bp.get("/results/<path:key>")
def download(key: str):
    store = current_app.config["NDIF_STORE"]
    if not isinstance(store, FilesystemStore):
        raise Refused("results are served by the object store", 404)

    expires = request.args.get("expires")
    signature = request.args.get("signature")
    if not expires or not signature:
        raise Refused("Result URL is missing its expires or signature parameter", 403)
    # Check the signature before the clock, so a forged URL is reported as
    # invalid whatever expiry it claims.
    if not store.signature_valid(key, expires, signature):
        raise Refused("Result URL signature is invalid", 403)
    if not store.verify(key, expires, signature):
        raise Refused("Result URL has expired; ask the API for a new one", 403)

    try:
        path = store.path(key)
        # send_file stats and opens the file itself, so a result deleted in
        # between is caught here too.
        response = send_file(
            path,
            mimetype="application/octet-stream",
            conditional=False,
            etag=False,
        )
    except (ValueError, FileNotFoundError, IsADirectoryError):
        raise Refused(f"No result {key!r}: it was never stored, or has been deleted", 404) from None
    response.headers["Cache-Control"] = "private, no-store"
    return response
