"""What both result stores share: the key rule, the byte view, the error.

A key that works on one backend must work on the other, and callers must see
one error type for "the store is away" whichever backend is configured, so
these live once, below both backends (``store.fs``, ``store.s3``) and the
chooser (``store``, its ``__init__``).
"""

from __future__ import annotations

from typing import Union

Data = Union[bytes, bytearray, memoryview]


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


def bytes_view(data: Data) -> memoryview:
    """A flat byte view of ``data``, so lengths are bytes, not items."""
    return memoryview(data).cast("B")
