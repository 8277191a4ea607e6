"""A ``tracer.cache()`` result as the 0.5 and 0.6 clients can unpickle it.

Their ``CacheDict`` asks its own ``__getattr__`` for ``__setstate__`` while
unpickling, before it has any attribute, which recurses forever: a saved
cache would crash the client. Pickled to be rebuilt by its ``__init__``, it
loads. Registered by the adapters of those versions (0.7's loads either way).
"""

from __future__ import annotations

import copyreg
from typing import Any


def _rebuilt_through_init(cache: Any) -> tuple:
    items = {key: dict.__getitem__(cache, key) for key in dict.keys(cache)}
    return type(cache), (items, cache._path, cache._alias, cache._rename, cache._alias_paths)


def register(cache_dict: type) -> None:
    copyreg.pickle(cache_dict, _rebuilt_through_init)
