"""Where finished results live until the client downloads them.

This module chooses the backend (:func:`open_store`) and names the public types.
Each backend is its own module:

``base`` - what both backends share: the key rule, the byte view, the error.
``fs`` - :class:`FilesystemStore`, results as files under a directory.
``s3`` - :class:`S3Store`, results in a bucket of any S3 server (MinIO first).

:class:`FilesystemStore` hands out URLs to the web app (``/results/<key>``),
signed with an HMAC. So the web app can serve them without a database lookup.
It is the default: one host, nothing else to run.

:class:`S3Store` hands out presigned GET URLs, so downloads never pass through
the web app. A farm spread over several hosts uses it.

Both take the same keys: relative, ``/``-separated names without ``..`` or
hidden components. The rule is the filesystem's: a key must never escape the
result directory. S3 applies it too, so a key that works on one backend works
on the other.

On both backends, ``get`` raises :class:`FileNotFoundError` for a missing
result. A backend that cannot be reached raises :class:`StoreUnavailable`.

A backend's module is imported only when it is opened or named. A filesystem
farm never loads the S3 client, and importing this package loads neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from .base import Data, StoreUnavailable, check_key

if TYPE_CHECKING:
    from ndif_celery.config import Settings

    from .fs import FilesystemStore
    from .s3 import S3Store

    Store = Union[FilesystemStore, S3Store]

__all__ = ["Data", "FilesystemStore", "S3Store", "Store", "StoreUnavailable", "check_key", "open_store"]


def __getattr__(name: str):
    """The backends' names, each imported on first use (PEP 562)."""
    if name == "FilesystemStore":
        from .fs import FilesystemStore

        return FilesystemStore
    if name == "S3Store":
        from .s3 import S3Store

        return S3Store
    if name == "Store":
        from .fs import FilesystemStore
        from .s3 import S3Store

        return Union[FilesystemStore, S3Store]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_store(settings: "Settings") -> "Store":
    """The store the settings describe: S3 when an object store URL is set."""
    if settings.uses_s3:
        from .s3 import S3Store

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
    from .fs import FilesystemStore

    return FilesystemStore(
        settings.results_dir,
        settings.api_url,
        settings.secret_key,
        settings.result_url_ttl_s,
    )
