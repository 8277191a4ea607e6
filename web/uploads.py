"""Request bodies: checked before a byte is read, read against a clock, bounded in number.

A ``POST /request`` names its key and its size in its headers, so whatever
can refuse it without the body does so first (:func:`reading`): the key
(checked by the route), a declared length (411 without one) within
NDIF_MAX_PAYLOAD_BYTES (413), the key's rate and concurrency (429, counting
nothing), a place among the bodies this web process reads at once
(NDIF_WEB_UPLOADS, 503), of which one client address may hold
NDIF_UPLOADS_PER_ADDRESS and one key NDIF_WEB_UPLOADS_PER_KEY (429), and a
place among the key's uploads in flight (NDIF_UPLOADS_PER_KEY, counted in
Redis across webs, 429). With auth off every client is "anonymous", so the
address is the only party there is to count. Holding every place of a
process takes NDIF_WEB_UPLOADS / NDIF_UPLOADS_PER_ADDRESS addresses (8 by
default), and with auth on NDIF_WEB_UPLOADS / NDIF_WEB_UPLOADS_PER_KEY keys (8).

Then the body is read against a schedule (:class:`Upload`): it must begin
within NDIF_UPLOAD_FIRST_BYTE_S, and ``t`` seconds after it started, at least
``NDIF_UPLOAD_MIN_BYTES_PER_S * (t - NDIF_UPLOAD_GRACE_S)`` bytes of it must
have arrived. One watcher per web process (:class:`Watcher`) looks at every
body being read a few times a second; one behind its schedule has its
socket's read side shut, which wakes the read blocked on it, and the request
is answered 408. A client that sends nothing holds its place for the first
byte's deadline, one that trickles a body for about the grace.

Headers are gunicorn's to bound: it reads them, and drains the body of a
request refused unread, within its keepalive (``web/gunicorn_conf.py``).
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections import Counter
from contextlib import contextmanager
from typing import Iterator, Optional

import redis
from flask import current_app, request
from werkzeug.exceptions import RequestEntityTooLarge

from ndif_celery import config
from ndif_celery.accounts import auth, limits
from ndif_celery.errors import Refused

from .identity import client_network

WATCH_S = 0.25  # how often the watcher looks at the bodies being read
FORM_OVERHEAD_BYTES = 1024 * 1024  # the multipart envelope around the payload (as MAX_CONTENT_LENGTH)


class UploadTooSlow(Refused):
    """A request body that did not begin in time or fell behind the minimum rate: cut, answered 408."""

    status = 408


class Upload:
    """One request body being read, and the schedule it must keep."""

    def __init__(self, stream, length: int, settings: config.Settings, sock: Optional[socket.socket],
                 address: str = "", owner: Optional[str] = None) -> None:
        self.stream = stream
        self.length = length
        self.first_byte_s = settings.upload_first_byte_s
        self.grace_s = settings.upload_grace_s
        self.min_rate = settings.upload_min_bytes_per_s
        self.sock = sock
        self.address = address  # the party it counts for (client_network)
        self.owner = owner  # its key's owner (auth off: "anonymous"); None: counted for no key
        self.started = time.monotonic()
        self.received = 0
        self.cut_for: Optional[str] = None

    @property
    def lease_s(self) -> float:
        """The longest the whole body may take: the grace, then its size at the minimum rate."""
        return self.grace_s + self.length / self.min_rate

    def late(self, now: float) -> Optional[str]:
        """Why this body is behind its schedule at ``now``, or None while it keeps it."""
        elapsed = now - self.started
        if self.length and not self.received and elapsed > self.first_byte_s:
            return (f"The request body did not begin: none of it had arrived {elapsed:.1f} s after its headers, "
                    f"and this server cuts a body that has not begun within {self.first_byte_s:g} s "
                    "(NDIF_UPLOAD_FIRST_BYTE_S).")
        if self.received < min(self.length, self.min_rate * (elapsed - self.grace_s)):
            return (f"The request body arrived too slowly: {self.received} of {self.length} bytes after "
                    f"{elapsed:.1f} s; this server reads bodies at {self.min_rate} bytes/s or faster after "
                    f"{self.grace_s:g} s (NDIF_UPLOAD_MIN_BYTES_PER_S, NDIF_UPLOAD_GRACE_S).")
        return None

    def shut(self, reason: str) -> None:
        """Wake the read blocked on this body: its socket reads end of file from now on."""
        if self.cut_for is None:
            self.cut_for = reason
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass

    def read(self, size: int = -1) -> bytes:
        if self.received or size == 0:
            return self._take(self.stream.read, size)
        # The first read asks for one byte, so it returns as soon as the body
        # begins, not once a whole chunk is in: the first byte's deadline is met then.
        first = self._take(self.stream.read, 1)
        if size > 0 or not first:
            return first  # a short read, as a raw stream may give
        return first + self._take(self.stream.read, size)

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
        reason = self.cut_for or self.late(time.monotonic())
        if reason:
            self.shut(reason)
            raise UploadTooSlow(reason)


class Watcher:
    """The bodies one web process is reading: at most ``limit`` at once, each
    cut when it falls behind (by one thread, a greenlet under gevent)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.reading: set[Upload] = set()
        self.by_address: Counter = Counter()
        self.by_owner: Counter = Counter()
        self.lock = threading.Lock()
        self.thread: Optional[threading.Thread] = None

    def add(self, upload: Upload, per_address: int = 0, per_key: int = 0) -> None:
        """Admit ``upload``, or refuse it: 429 past its address's or key's share, 503 when full."""
        with self.lock:
            if per_address and self.by_address[upload.address] >= per_address:
                raise Refused(
                    f"Too many uploads at once from your address: at most {per_address} request bodies "
                    "per web process (NDIF_UPLOADS_PER_ADDRESS); nothing was queued. "
                    "Wait for them to arrive, then try again.",
                    429,
                )
            if per_key and upload.owner is not None and self.by_owner[upload.owner] >= per_key:
                raise Refused(
                    f"Too many uploads at once: this API key is already sending {per_key} request bodies "
                    "to this web process (NDIF_WEB_UPLOADS_PER_KEY); nothing was queued. "
                    "Wait for them to arrive, then try again.",
                    429,
                )
            if len(self.reading) >= self.limit:
                raise Refused(
                    f"This server is reading {self.limit} request bodies at once (NDIF_WEB_UPLOADS), "
                    "its most; nothing was queued. Retry shortly.",
                    503,
                )
            self.reading.add(upload)
            self.by_address[upload.address] += 1
            if upload.owner is not None:
                self.by_owner[upload.owner] += 1
            if self.thread is None:  # after the fork: started in the process that serves
                self.thread = threading.Thread(target=self._watch, name="ndif-uploads", daemon=True)
                self.thread.start()

    def discard(self, upload: Upload) -> None:
        """The body is read (or refused): its places are free. Safe to call twice."""
        with self.lock:
            if upload not in self.reading:
                return
            self.reading.discard(upload)
            _less(self.by_address, upload.address)
            if upload.owner is not None:
                _less(self.by_owner, upload.owner)

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH_S)
            now = time.monotonic()
            with self.lock:
                late = [(upload, reason) for upload in self.reading
                        if upload.cut_for is None and (reason := upload.late(now))]
            for upload, reason in late:
                upload.shut(reason)


def _less(counts: Counter, party: str) -> None:
    """One fewer for ``party``; a party holding none is dropped, so the table holds only those reading."""
    counts[party] -= 1
    if counts[party] <= 0:
        del counts[party]


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
    upload = Upload(request.environ["wsgi.input"], length, settings, request.environ.get("gunicorn.socket"),
                    address=client_network(request.remote_addr), owner=identity.owner)
    watcher: Watcher = current_app.config["NDIF_UPLOADS"]
    watcher.add(upload, per_address=settings.uploads_per_address, per_key=settings.web_uploads_per_key)
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
