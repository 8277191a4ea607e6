"""The S3 result store: results as objects in a bucket of any S3 server
(MinIO first), downloaded by clients through presigned GET URLs that never
pass through the web app. What a farm spread over several hosts uses.
"""

from __future__ import annotations

import io
import os
from datetime import timedelta
from urllib.parse import urlsplit

import certifi
import urllib3
from minio import Minio
from minio.error import MinioException, S3Error

from .base import Data, StoreUnavailable, bytes_view, check_key

#: What the SDK and its HTTP pool raise when the server is unreachable or
#: answers with an error (S3Error is a MinioException).
_TRANSPORT_ERRORS = (MinioException, urllib3.exceptions.HTTPError, OSError)

#: Longest validity S3 accepts for a presigned URL (SigV4: seven days).
_MAX_PRESIGN_S = 7 * 24 * 3600


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
        view = bytes_view(data)
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
