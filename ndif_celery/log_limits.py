"""Repeated log records, bounded: a few per source per window, then one count.

A client can make a farm process log the same error once per thing it sends:
a malformed Socket.IO packet is a traceback in the web's log, ~700 bytes of
disk for a byte on the wire. So every farm process (the web under gunicorn,
the Celery worker, beat, Flower) passes each record through one
:class:`RepeatLimit`. A record's source is its logger, level, message template
(``record.msg``, before its arguments) and exception type. The first ``burst``
records of a source in a window pass; later ones are counted, not written
(tracebacks included). When the window ends one line says how many were left
out, and the next record of that source opens a new window. Only warnings,
errors and records with a traceback are limited: an INFO line per request or
job is what a log is for, and the rotation of the log files bounds it
(:mod:`ndif_celery.host.log_rotation`).

The limit sits on the loggers, not on handlers: libraries add handlers of
their own (engine.io writes to stderr through its own), and a record is
checked once, at the logger it was made on. Loggers made later get it too
(:func:`install` sets the logger class). Standard library only: every process
imports this, the web included.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Callable, Optional

#: Records below this level pass unless they carry a traceback: a line per
#: request or job (gunicorn's access log, a task received) is the log's purpose.
LEVEL = logging.WARNING
#: Records of one source that pass in each window.
BURST = 5
#: Seconds a source's window lasts.
WINDOW_S = 60.0
#: Sources remembered at once; the least recently seen is closed first.
MAX_SOURCES = 1024
#: A summary quotes this much of the message template.
TEMPLATE_CHARS = 160


class _Source:
    __slots__ = ("key", "started", "passed", "dropped")

    def __init__(self, key: tuple, started: float) -> None:
        self.key = key
        self.started = started
        self.passed = 0
        self.dropped = 0


def source_of(record: logging.LogRecord) -> tuple:
    """What makes two records repeats: logger, level, template and exception type."""
    template = record.msg if isinstance(record.msg, str) else type(record.msg).__name__
    exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
    return record.name, record.levelno, template, exc


class RepeatLimit(logging.Filter):
    """Passes ``burst`` records per source per ``window_s``; counts the rest and
    logs the count as the window ends. ``burst`` 0: everything passes."""

    def __init__(self, burst: int = BURST, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic, max_sources: int = MAX_SOURCES,
                 timer: bool = True) -> None:
        super().__init__()
        self.burst = burst
        self.window_s = window_s
        self.clock = clock
        self.max_sources = max_sources
        self.timer = timer  # a thread says the counts when windows end (tests pass False and call flush)
        self._sources: OrderedDict = OrderedDict()
        self._next_due = float("inf")  # the earliest end of a window with records left out
        self._timer_due = float("inf")
        self._timer_pid = 0
        self._lock = threading.Lock()

    def after_fork(self) -> None:
        """In a forked child: the lock may have been copied held, and the timer did not come along."""
        self._lock = threading.Lock()
        self._timer_due = float("inf")

    def filter(self, record: logging.LogRecord) -> bool:
        if self.burst <= 0 or getattr(record, "repeat_summary", False):
            return True
        if record.levelno < LEVEL and not record.exc_info:
            return True
        key = source_of(record)
        now = self.clock()
        with self._lock:
            ended = self._close_ended(now) if now >= self._next_due else []
            source = self._sources.get(key)
            if source is not None and now - source.started >= self.window_s:
                if source.dropped:
                    ended.append(source)
                source = None
            if source is None:
                source = self._sources[key] = _Source(key, now)
                while len(self._sources) > self.max_sources:
                    _, oldest = self._sources.popitem(last=False)
                    if oldest.dropped:
                        ended.append(oldest)
            else:
                self._sources.move_to_end(key)
            if source.passed < self.burst:
                source.passed += 1
                verdict = True
            else:
                source.dropped += 1
                verdict = False
                self._next_due = min(self._next_due, source.started + self.window_s)
            arm = self._arm(now)
        for closed in ended:
            self._say(closed, now)
        if arm:
            self._start_timer(arm)
        return verdict

    def flush(self, everything: bool = False) -> int:
        """Log the counts of windows that ended (all of them with ``everything``,
        at exit); how many counts were logged."""
        now = self.clock()
        with self._lock:
            ended = self._close_ended(now, everything)
            arm = self._arm(now)
        for closed in ended:
            self._say(closed, now)
        if arm:
            self._start_timer(arm)
        return len(ended)

    def _close_ended(self, now: float, everything: bool = False) -> list:
        """Take out the sources whose window ended by ``now`` (all with
        ``everything``); those that had records left out. Under the lock."""
        ended, self._next_due = [], float("inf")
        for key, source in list(self._sources.items()):
            end = source.started + self.window_s
            if everything or end <= now:
                del self._sources[key]
                if source.dropped:
                    ended.append(source)
            elif source.dropped:
                self._next_due = min(self._next_due, end)
        return ended

    def _arm(self, now: float) -> float:
        """The delay of a timer to start now (0: none needed); under the lock."""
        if not self.timer or self._next_due == float("inf"):
            return 0.0
        if self._timer_pid == os.getpid() and self._timer_due <= self._next_due:
            return 0.0
        self._timer_due, self._timer_pid = self._next_due, os.getpid()
        return max(self._next_due - now, 0.0) + 0.01

    def _start_timer(self, delay: float) -> None:
        timer = threading.Timer(delay, self._on_timer)
        timer.daemon = True
        timer.start()

    def _on_timer(self) -> None:
        with self._lock:
            self._timer_due = float("inf")
        self.flush()

    def _say(self, source: _Source, at: float) -> None:
        """One record on the source's logger: how many of its records were left out."""
        name, level, template, exc = source.key
        span = max(1, round(min(at - source.started, self.window_s)))
        quoted = " ".join(template.split())
        if len(quoted) > TEMPLATE_CHARS:
            quoted = quoted[:TEMPLATE_CHARS] + "..."
        logger = logging.getLogger(name)
        record = logger.makeRecord(
            name, level, __name__, 0,
            '%s "%s"%s repeated %s more %s in the last %d s, not logged (at most %d a window of %g s)',
            (name, quoted, f" ({exc})" if exc else "", f"{source.dropped:,}",
             "time" if source.dropped == 1 else "times", span, self.burst, self.window_s),
            None)
        record.repeat_summary = True
        logger.handle(record)


_installed: Optional[RepeatLimit] = None


def install(burst: int = BURST, window_s: float = WINDOW_S) -> RepeatLimit:
    """Put one :class:`RepeatLimit` on every logger of this process, those made
    later included; the counts left are logged at exit. Again: the same limit,
    with the new numbers."""
    global _installed
    if _installed is None:
        limit = _installed = RepeatLimit(burst, window_s)
        base = logging.getLoggerClass()

        class LimitedLogger(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **kwargs)
                self.addFilter(limit)

        logging.setLoggerClass(LimitedLogger)
        atexit.register(limit.flush, True)
    _installed.burst, _installed.window_s = burst, window_s
    loggers = [logging.getLogger()] + [
        logger for logger in list(logging.Logger.manager.loggerDict.values()) if isinstance(logger, logging.Logger)]
    for logger in loggers:
        logger.addFilter(_installed)  # once: addFilter skips a filter already there
    return _installed
