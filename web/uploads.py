"""Request bodies: checked before a byte is read, read against a clock, bounded in number.

A ``POST /request`` names its key and its size in its headers, so whatever
can refuse it without the body does so first (:func:`reading`): the key
(checked by the route), a declared length (411 without one) within
NDIF_MAX_PAYLOAD_BYTES (413), the key's rate and concurrency (429, counting
nothing), a place among the bodies this web process reads at once
(NDIF_WEB_UPLOADS, 503) and among the key's uploads in flight
(NDIF_UPLOADS_PER_KEY, counted in Redis across webs, 429).

Then the body is read against a schedule (:class:`Upload`): ``t`` seconds
after it started, at least ``NDIF_UPLOAD_MIN_BYTES_PER_S * (t - NDIF_UPLOAD_GRACE_S)``
bytes of it must have arrived. One watcher per web process (:class:`Watcher`)
looks at every body being read a few times a second; one behind its
schedule has its socket's read side shut, which wakes the read blocked on
it, and the request is answered 408. A client that trickles a body holds its
place for about the grace, and any number of slow uploads from one key hold
at most NDIF_UPLOADS_PER_KEY places between them.

Headers are gunicorn's to bound: it reads them, and drains the body of a
request refused unread, within its keepalive (``web/gunicorn_conf.py``).
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Iterator, Optional

import redis
from flask import current_app, request
from werkzeug.exceptions import RequestEntityTooLarge

from ndif_celery import config
from ndif_celery.accounts import auth, limits
from ndif_celery.errors import Refused

WATCH_S = 0.25  # how often the watcher looks at the bodies being read
FORM_OVERHEAD_BYTES = 1024 * 1024  # the multipart envelope around the payload (as MAX_CONTENT_LENGTH)


class UploadTooSlow(Refused):
    """A request body that fell behind the minimum rate: cut, answered 408."""

    status = 408


class Upload:
    """One request body being read, and the schedule it must keep."""

    def __init__(self, stream, length: int, settings: config.Settings, sock: Optional[socket.socket]) -> None:
        self.stream = stream
        self.length = length
        self.grace_s = settings.upload_grace_s
        self.min_rate = settings.upload_min_bytes_per_s
        self.sock = sock
        self.started = time.monotonic()
        self.received = 0
        self.cut = False

    @property
    def lease_s(self) -> float:
        """The longest the whole body may take: the grace, then its size at the minimum rate."""
        return self.grace_s + self.length / self.min_rate

    def behind(self, now: float) -> bool:
        owed = min(self.length, self.min_rate * (now - self.started - self.grace_s))
        return self.received < owed

    def shut(self) -> None:
        """Wake the read blocked on this body: its socket reads end of file from now on."""
        self.cut = True
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass

    def read(self, size: int = -1) -> bytes:
        return self._take(self.stream.read, size)

    def readline(self, size: int = -1) -> bytes:
        return self._take(self.stream.readline, size)

    def _take(self, read, size: int) -> bytes:
        self._keep_up()
        try:
            data = read(size)
        except OSError:  # gunicorn's end of data on a socket shut by the watcher
            self._keep_up()
            raise
        self.received += len(data)
        self._keep_up()
        return data

    def _keep_up(self) -> None:
        if self.cut or self.behind(time.monotonic()):
            self.shut()
            raise UploadTooSlow(
                f"The request body arrived too slowly: {self.received} of {self.length} bytes after "
                f"{time.monotonic() - self.started:.1f} s; this server reads bodies at "
                f"{self.min_rate} bytes/s or faster after {self.grace_s:g} s "
                "(NDIF_UPLOAD_MIN_BYTES_PER_S, NDIF_UPLOAD_GRACE_S).",
            )


class Watcher:
    """The bodies one web process is reading: at most ``limit`` at once, each
    cut when it falls behind (by one thread, a greenlet under gevent)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.reading: set[Upload] = set()
        self.lock = threading.Lock()
        self.thread: Optional[threading.Thread] = None

    def add(self, upload: Upload) -> None:
        with self.lock:
            if len(self.reading) >= self.limit:
                raise Refused(
                    f"This server is reading {self.limit} request bodies at once (NDIF_WEB_UPLOADS), "
                    "its most; nothing was queued. Retry shortly.",
                    503,
                )
            self.reading.add(upload)
            if self.thread is None:  # after the fork: started in the process that serves
                self.thread = threading.Thread(target=self._watch, name="ndif-uploads", daemon=True)
                self.thread.start()

    def discard(self, upload: Upload) -> None:
        with self.lock:
            self.reading.discard(upload)

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH_S)
            now = time.monotonic()
            with self.lock:
                late = [upload for upload in self.reading if not upload.cut and upload.behind(now)]
            for upload in late:
                upload.shut()


def declared_length(settings: config.Settings) -> int:
    """The body's size from its headers: required, and within the payload bound."""
    length = request.content_length
    if length is None or "chunked" in request.headers.get("Transfer-Encoding", "").lower():
        raise Refused("A request body must declare its size in a Content-Length header "
                      "(chunked uploads are not accepted).", 411)
    if settings.max_payload_bytes and length > settings.max_payload_bytes + FORM_OVERHEAD_BYTES:
        raise RequestEntityTooLarge()
    return length


@contextmanager
def reading(client: redis.Redis, settings: config.Settings, identity: auth.Identity) -> Iterator[Upload]:
    """Admit this request's body for ``identity`` (or refuse it unread), and
    read it against its schedule within the block."""
    length = declared_length(settings)
    limits.check_headroom(client, identity, settings)
    upload = Upload(request.environ["wsgi.input"], length, settings, request.environ.get("gunicorn.socket"))
    watcher: Watcher = current_app.config["NDIF_UPLOADS"]
    watcher.add(upload)
    upload_id = uuid.uuid4().hex
    counted = False
    try:
        counted = limits.claim_upload(client, identity, upload_id, upload.lease_s + 1, settings)
        request.environ["wsgi.input"] = upload
        yield upload
    finally:
        watcher.discard(upload)
        if counted:
            limits.release_upload(client, identity, upload_id)
