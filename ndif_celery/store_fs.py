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

from .store_common import Data, StoreUnavailable, bytes_view, check_key


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
