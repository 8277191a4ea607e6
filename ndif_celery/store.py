"""Where finished results live until the client downloads them.

Two backends with the same small interface:

* :class:`FilesystemStore` keeps results as files under a directory and hands
  out URLs to the web app (``/results/<key>``) signed with an HMAC, so the web
  app can serve them without a database lookup. This is the default: one host,
  nothing else to run.
* :class:`S3Store` keeps results in a bucket of any S3 server (MinIO first) and
  hands out presigned GET URLs, so downloads never pass through the web app.
  This is what a farm spread over several hosts uses.

Both take the same keys: relative, ``/``-separated names without ``..`` or
hidden components. The rule is the filesystem's (a key must never escape the
result directory), applied to S3 too so a key that works on one backend works
on the other.

Missing results raise :class:`FileNotFoundError` from ``get`` on both
backends; a backend that cannot be reached raises :class:`StoreUnavailable`.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Union
from urllib.parse import quote, urlsplit

import certifi
import urllib3
from minio import Minio
from minio.error import MinioException, S3Error

if TYPE_CHECKING:
    from .config import Settings

Data = Union[bytes, bytearray, memoryview]

#: What the SDK and its HTTP pool raise when the server is unreachable or
#: answers with an error (S3Error is a MinioException).
_TRANSPORT_ERRORS = (MinioException, urllib3.exceptions.HTTPError, OSError)

#: Longest validity S3 accepts for a presigned URL (SigV4: seven days).
_MAX_PRESIGN_S = 7 * 24 * 3600


class StoreUnavailable(Exception):
    """The result store cannot be reached or refused the request.

    Callers treat this as "try again later" (a 503 to clients, a retry in
    workers) rather than a bug, so every backend wraps its transport and
    server errors in it with a message naming the store.
    """


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe result name, else raise ValueError.

    A key is a relative path of ``/``-separated components. Absolute paths,
    backslashes, ``.``/``..`` and empty components would let a key escape the
    result directory or alias another key; components starting with ``.`` are
    refused so the store's own temporary files are never addressable; control
    characters would make URLs and signed messages ambiguous.
    """
    if not isinstance(key, str) or not key:
        raise ValueError("result key must be a non-empty string")
    if key.startswith("/") or "\\" in key:
        raise ValueError(f"result key must be a relative '/'-separated path: {key!r}")
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise ValueError(f"result key must not contain control characters: {key!r}")
    for part in key.split("/"):
        if not part or part.startswith("."):
            raise ValueError(f"result key has an empty, '..' or hidden component: {key!r}")
    return key


def _bytes_view(data: Data) -> memoryview:
    """A flat byte view of ``data``, so lengths are bytes, not items."""
    return memoryview(data).cast("B")


class _ViewReader(io.RawIOBase):
    """Reads a memoryview in chunks without first copying all of it (as
    ``io.BytesIO`` would): a big result is not held twice during upload."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        end = self._view.nbytes if size is None or size < 0 else min(self._pos + size, self._view.nbytes)
        chunk = self._view[self._pos:end].tobytes()
        self._pos = end
        return chunk


class FilesystemStore:
    """Results as files under ``root``, served by the web app.

    URLs carry ``expires`` and an HMAC-SHA256 ``signature`` over the key and
    the expiry, keyed with ``secret_key``: anyone holding the URL may download
    until it expires, nobody can forge one for another key. Every process that
    signs or checks URLs must share ``secret_key``.
    """

    def __init__(self, root: Path, base_url: str, secret_key: str, url_ttl_s: int):
        if not secret_key:
            raise ValueError("FilesystemStore needs a secret_key to sign result URLs")
        # Absolute, so the web app (which may run from another directory than
        # the workers) finds the same files.
        self.root = Path(root).expanduser().absolute()
        self.base_url = base_url.rstrip("/")
        self._secret = secret_key.encode()
        self.url_ttl_s = int(url_ttl_s)

    def __repr__(self) -> str:
        return f"FilesystemStore({str(self.root)!r}, {self.base_url!r})"

    def path(self, key: str) -> Path:
        """The file that holds ``key``; ValueError if the key is unsafe."""
        path = self.root / check_key(key)
        # Belt and braces: a symlink planted inside root must not lead out.
        root = self.root.resolve()
        if not path.resolve().is_relative_to(root):
            raise ValueError(f"result key escapes the result directory: {key!r}")
        return path

    def put(self, key: str, data: Data) -> int:
        """Store ``data`` under ``key`` and return its size in bytes.

        Written to a temporary file in the same directory and renamed over the
        target, so a concurrent reader sees the old file or the whole new one,
        never a partial write. (Not fsynced: results are short-lived and a
        crash loses the job anyway.) The file is readable by this user only.
        """
        path = self.path(key)
        view = _bytes_view(data)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(view)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return view.nbytes

    def get(self, key: str) -> bytes:
        """The bytes stored under ``key``; FileNotFoundError if there are none."""
        return self.path(key).read_bytes()

    def delete(self, key: str) -> None:
        """Remove ``key``; removing a missing key is not an error."""
        self.path(key).unlink(missing_ok=True)

    def older_than(self, prefix: str, cutoff: float) -> list[str]:
        """Keys under ``prefix`` last written before ``cutoff`` (a Unix time),
        for the cleanup to delete."""
        folder = self.path(prefix.strip("/"))
        if not folder.is_dir():
            return []
        found = []
        for path in folder.rglob("*"):
            try:
                if not path.name.startswith(".") and path.is_file() and path.stat().st_mtime < cutoff:
                    found.append(path.relative_to(self.root).as_posix())
            except FileNotFoundError:
                continue  # deleted while we looked
        return found

    def sign(self, key: str, expires: int) -> str:
        """Hex HMAC-SHA256 of ``key`` and ``expires``.

        The newline separates the two fields so ``("a1", 23)`` and
        ``("a12", 3)`` sign different messages (keys cannot contain one).
        """
        message = f"{key}\n{int(expires)}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def url(self, key: str) -> str:
        """A URL on the web app that downloads ``key`` for ``url_ttl_s`` seconds."""
        check_key(key)
        expires = int(time.time()) + self.url_ttl_s
        return (
            f"{self.base_url}/results/{quote(key, safe='/')}"
            f"?expires={expires}&signature={self.sign(key, expires)}"
        )

    def signature_valid(self, key: str, expires, signature) -> bool:
        """Whether ``signature`` was made by :meth:`sign` for this key/expiry.

        Ignores the clock, so the web app can tell an expired URL from a
        forged one; use :meth:`verify` to decide whether to serve.
        """
        try:
            expected = self.sign(key, int(expires)).encode()
            given = str(signature).encode("ascii")
        except (TypeError, ValueError, UnicodeEncodeError):
            return False
        return hmac.compare_digest(expected, given)

    def verify(self, key: str, expires, signature) -> bool:
        """Whether a URL with these query args may be served now.

        False when the signature does not match, the expiry is malformed, or
        the expiry has passed.
        """
        if not self.signature_valid(key, expires, signature):
            return False
        return int(expires) >= time.time()

    def ping(self) -> None:
        """Raise StoreUnavailable unless ``root`` exists (or can be made) and is writable."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=self.root, prefix=".tmp-ping-")
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise StoreUnavailable(
                f"result directory {self.root} is not writable: {exc}"
            ) from exc


def _parse_endpoint(url: str, what: str) -> tuple[str, bool]:
    """``http://host:port`` -> ``("host:port", secure)``, as the minio SDK wants it."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{what} must be a URL like http://host:port, got {url!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{what} must not have a path or query (S3 needs the server root): {url!r}")
    if "@" in parts.netloc:
        raise ValueError(f"{what} must not carry credentials; use the access/secret key settings")
    return parts.netloc, parts.scheme == "https"


class S3Store:
    """Results as objects in an S3 bucket (MinIO, or any S3 server).

    Two SDK clients: one talks to ``endpoint_url`` (how this host reaches the
    server), the other only signs download URLs for ``public_url`` (how
    clients reach it; often a different hostname). SigV4 signs the Host
    header, so a URL signed for one host cannot simply be rewritten to
    another. Both clients are given the region so presigning is pure
    computation, never a GetBucketLocation request.

    The bucket is created on first use when missing; after a server that lost
    its state comes back, the next ``put`` or ``ping`` creates it again.
    """

    def __init__(
        self,
        endpoint_url: str,
        public_url: str,
        access_key: str,
        secret_key: str,
        bucket: str,
        region: str,
        verify: bool,
        url_ttl_s: int,
    ):
        self.endpoint_url = endpoint_url.rstrip("/")
        self.public_url = (public_url or endpoint_url).rstrip("/")
        self.bucket = bucket
        self.region = region or "us-east-1"
        self.url_ttl_s = int(url_ttl_s)
        endpoint, secure = _parse_endpoint(self.endpoint_url, "object store URL")
        public, public_secure = _parse_endpoint(self.public_url, "object store public URL")

        # Our own pool instead of the SDK default: that one retries a refused
        # connection five times with backoff and waits five minutes to
        # connect, which turns an outage into a hang instead of an error.
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=10, read=300),
            maxsize=32,
            cert_reqs="CERT_REQUIRED" if verify else "CERT_NONE",
            ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
            retries=urllib3.Retry(
                total=2, connect=1, backoff_factor=0.2,
                status_forcelist=[500, 502, 503, 504],
            ),
        )
        self._client = Minio(
            endpoint, access_key=access_key, secret_key=secret_key,
            secure=secure, region=self.region, http_client=http,
        )
        self._signer = Minio(
            public, access_key=access_key, secret_key=secret_key,
            secure=public_secure, region=self.region, http_client=http,
        )
        self._bucket_ready = False

    def __repr__(self) -> str:
        return f"S3Store({self.endpoint_url!r}, bucket={self.bucket!r})"

    def _unavailable(self, action: str, exc: BaseException) -> StoreUnavailable:
        if isinstance(exc, S3Error):
            reason = f"{exc.code}: {exc.message}"
        else:
            reason = str(getattr(exc, "reason", None) or exc)
        return StoreUnavailable(
            f"object store at {self.endpoint_url} failed to {action} "
            f"(bucket {self.bucket!r}): {reason}"
        )

    def _ensure_bucket(self) -> None:
        """Create the bucket if it is missing, tolerating a concurrent creator."""
        try:
            if not self._client.bucket_exists(self.bucket):
                try:
                    self._client.make_bucket(self.bucket)
                except S3Error as exc:
                    if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                        raise
        except _TRANSPORT_ERRORS as exc:
            raise self._unavailable("check or create the bucket", exc) from exc
        self._bucket_ready = True

    def put(self, key: str, data: Data) -> int:
        """Upload ``data`` as ``key`` and return its size in bytes."""
        check_key(key)
        view = _bytes_view(data)
        size = view.nbytes
        if not self._bucket_ready:
            self._ensure_bucket()
        for attempt in (1, 2):
            try:
                self._client.put_object(
                    self.bucket, key, _ViewReader(view), size,
                    content_type="application/octet-stream",
                )
                return size
            except S3Error as exc:
                if exc.code == "NoSuchBucket" and attempt == 1:
                    # The server lost the bucket (restarted without state).
                    self._ensure_bucket()
                    continue
                raise self._unavailable(f"store {key!r}", exc) from exc
            except _TRANSPORT_ERRORS as exc:
                raise self._unavailable(f"store {key!r}", exc) from exc
        raise AssertionError("unreachable")

    def get(self, key: str) -> bytes:
        """The bytes stored under ``key``; FileNotFoundError if there are none."""
        check_key(key)
        try:
            response = self._client.get_object(self.bucket, key)
            try:
                return response.read()
            finally:
                response.close()
                response.release_conn()
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchBucket"):
                raise FileNotFoundError(f"no result {key!r} in bucket {self.bucket!r}") from None
            raise self._unavailable(f"read {key!r}", exc) from exc
        except _TRANSPORT_ERRORS as exc:
            raise self._unavailable(f"read {key!r}", exc) from exc

    def delete(self, key: str) -> None:
        """Remove ``key``; removing a missing key is not an error."""
        check_key(key)
        try:
            self._client.remove_object(self.bucket, key)
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchBucket"):
                return
            raise self._unavailable(f"delete {key!r}", exc) from exc
        except _TRANSPORT_ERRORS as exc:
            raise self._unavailable(f"delete {key!r}", exc) from exc

    def older_than(self, prefix: str, cutoff: float) -> list[str]:
        """Keys under ``prefix`` last modified before ``cutoff`` (a Unix time).

        The cleanup's safety net for results whose job record is gone; in
        production a bucket lifecycle rule does the same (``deploy/``)."""
        try:
            return [
                item.object_name
                for item in self._client.list_objects(self.bucket, prefix=prefix, recursive=True)
                if item.last_modified is not None and item.last_modified.timestamp() < cutoff
            ]
        except S3Error as exc:
            if exc.code == "NoSuchBucket":
                return []
            raise self._unavailable(f"list {prefix!r}", exc) from exc
        except _TRANSPORT_ERRORS as exc:
            raise self._unavailable(f"list {prefix!r}", exc) from exc

    def url(self, key: str) -> str:
        """A presigned GET URL on ``public_url`` valid for ``url_ttl_s`` seconds.

        S3 limits presigned URLs to between one second and seven days, so the
        TTL is clamped to that range.
        """
        check_key(key)
        ttl = min(max(self.url_ttl_s, 1), _MAX_PRESIGN_S)
        return self._signer.presigned_get_object(
            self.bucket, key, expires=timedelta(seconds=ttl)
        )

    def ping(self) -> None:
        """Raise StoreUnavailable unless the server answers; create the bucket if missing."""
        self._ensure_bucket()


Store = Union[FilesystemStore, S3Store]


def open_store(settings: "Settings") -> Store:
    """The store the settings describe: S3 when an object store URL is set."""
    if settings.uses_s3:
        return S3Store(
            endpoint_url=settings.object_store_url,
            public_url=settings.object_store_public_url,
            access_key=settings.object_store_access_key,
            secret_key=settings.object_store_secret_key,
            bucket=settings.object_store_bucket,
            region=settings.object_store_region,
            verify=settings.object_store_verify,
            url_ttl_s=settings.result_url_ttl_s,
        )
    return FilesystemStore(
        settings.results_dir,
        settings.api_url,
        settings.secret_key,
        settings.result_url_ttl_s,
    )
