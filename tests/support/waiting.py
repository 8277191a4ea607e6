"""Waiting for something to become true, the one loop the tests and their helpers share.

``wait_until`` calls a check until it returns something truthy, and fails
naming what it waited for. It does not scale ``timeout_s``: a caller whose
bound is a timing claim passes ``pace.bound(timeout_s)`` itself.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(check: Callable[[], T], timeout_s: float, what: str, *, report: Callable[[], str] = lambda: "",
               ignore: tuple[type[BaseException], ...] = (), interval_s: float = 0.1,
               done: Callable[[T], bool] = bool, error: type[Exception] = TimeoutError) -> T:
    """Call ``check`` every ``interval_s`` until ``done`` of what it returned
    (by default: it is truthy); return that. An exception of a class in
    ``ignore`` counts as not yet; any other propagates. Past ``timeout_s``,
    raise ``error`` saying what was waited for, the last value and ``report()``."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        try:
            last = check()
            if done(last):
                return last
        except ignore as exc:  # not answering yet
            last = exc
        if time.monotonic() > deadline:
            detail = report()
            raise error(f"timed out after {timeout_s:g} s waiting for {what} (last: {last!r})"
                        + (f"\n{detail}" if detail else ""))
        time.sleep(interval_s)
