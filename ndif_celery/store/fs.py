"""The filesystem result store: results as files under a directory, served by
the web app (``web/results.py``) at URLs signed with an HMAC, so no database
lookup is needed. The default: one host, nothing else to run.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

from .base import Data, StoreUnavailable, bytes_view, check_key


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
        view = bytes_view(data)
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


#: The marker file naming a result directory (dot-named: never a result key, never cleaned up).
MARKER = ".ndif-store-id"
#: Redis key: the marker of the directory the farm's first process found (web or worker).
SHARED_KEY = "ndif:store:fs-id"
#: How long the farm remembers it after the last process checked in (a moved directory is accepted then).
SHARED_TTL_S = 24 * 3600


class NotShared(RuntimeError):
    """This host's result directory is not the one the farm's other hosts use."""


def check_shared(store: FilesystemStore, client, host: str) -> str:
    """Refuse a filesystem store that the web and worker hosts do not share.

    Why: a worker writes a result into *its* ``NDIF_RESULTS_DIR`` and the web
    serves downloads from *its own*; on two hosts without a shared mount the
    client's URL finds nothing (404), long after the job said COMPLETED. Every
    web and worker process, as it starts, reads the directory's marker (made
    once, with a random id: O_EXCL, so processes starting together agree) and
    compares it with the one the farm recorded in Redis first. Another id means
    another directory: refused, with what to do instead. Returns the id.
    """
    store.root.mkdir(parents=True, exist_ok=True)
    marker = store.root / MARKER
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as out:
            out.write(os.urandom(16).hex())
    mine = ""
    for _ in range(50):  # a process that just created it may not have written it yet
        mine = marker.read_text().strip()
        if mine:
            break
        time.sleep(0.01)
    if not mine:
        raise NotShared(f"the result directory's marker {marker} is empty; remove it and start again")
    client.set(SHARED_KEY, mine, nx=True, ex=SHARED_TTL_S)
    farm = (client.get(SHARED_KEY) or b"").decode()
    if farm and farm != mine:
        raise NotShared(
            f"NDIF_RESULTS_DIR {store.root} on {host} is not the result directory the farm's other hosts use "
            f"(its marker {MARKER} says {mine[:8]}..., the farm's says {farm[:8]}...). A filesystem result store "
            "must be one directory every web and worker host shares (one host, or a shared mount); across hosts "
            "use MinIO or another S3 store (NDIF_OBJECT_STORE_URL). If the directory was moved on purpose, "
            f"delete the Redis key {SHARED_KEY} and start again.")
    client.expire(SHARED_KEY, SHARED_TTL_S)
    return mine
