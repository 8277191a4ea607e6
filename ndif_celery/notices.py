"""Warnings that repeat, logged once per change and then as a rare reminder.

Why: loops that tick every half second (the controller, the web's hub, the
watchdogs) meet the same trouble on every tick while it lasts: a model no
worker can take, Redis away. Logged every time, one condition filled the logs
with thousands of identical lines ("no live worker can take another replica"
every 0.5 s, for hours) and buried everything else. A :class:`Notices` logs a
subject's message when it first appears or changes, then at most every
``remind_s`` while it stays the same (saying how often it recurred meanwhile),
and once more, at INFO, when the subject is :meth:`cleared`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

#: While a warning stays the same, how often it is logged again.
REMIND_S = 300.0


@dataclass
class _Seen:
    message: str
    logged_at: float
    repeats: int = 0  # since it was last logged


class Notices:
    """One per loop (or per logger): ``warn(subject, message)`` instead of ``log.warning``."""

    def __init__(self, log: logging.Logger, remind_s: float = REMIND_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.remind_s = remind_s
        self.clock = clock
        self._seen: dict[str, _Seen] = {}
        self._lock = threading.Lock()

    def warn(self, subject: str, message: str, exc_info=None) -> bool:
        """Log ``message`` for ``subject`` unless it is the one already logged
        less than ``remind_s`` ago; True when it was logged."""
        now = self.clock()
        with self._lock:
            seen = self._seen.get(subject)
            if seen is not None and seen.message == message and now - seen.logged_at < self.remind_s:
                seen.repeats += 1
                return False
            again = seen is not None and seen.message == message
            repeats = seen.repeats if again else 0
            self._seen[subject] = _Seen(message, now)
        if again:
            self.log.warning("%s (still so: %d more times in the last %.0f s)", message, repeats, self.remind_s,
                             exc_info=exc_info)
        else:
            self.log.warning("%s", message, exc_info=exc_info)
        return True

    def cleared(self, subject: str, message: str = "") -> None:
        """The trouble of ``subject`` is over: say so once (if it was warned about) and forget it."""
        with self._lock:
            seen = self._seen.pop(subject, None)
        if seen is not None:
            self.log.info("%s", message or f"no longer: {seen.message}")
