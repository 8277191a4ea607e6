"""Bounds on what user code can make the server say: status texts and LOG output.

User code decides what it prints and what its exceptions say. Without bounds
one ``print`` of 100 MB, or an exception carrying a 100 MB message, becomes a
100 MB status published through Redis, kept there for ``NDIF_JOB_TTL_S``, and
re-encoded by every process it passes. Everything here is plain Python (no
torch): ``ndif_celery.state.jobs`` applies it to every status on every path (trusted
in-process jobs and isolated children alike), and ``workers.isolation.frames`` uses the
same limits for the frames an isolated child sends.

- :func:`truncate`: a text cut so that its JSON encoding (as ``json.dumps``
  writes it, non-ASCII escaped) fits a byte limit, ending with a note that
  says how much was cut ("... [truncated: 312 MB more]").
- :class:`LogLimiter`: at most so many LOG lines a second (a token bucket)
  and so many LOG bytes per job; what is dropped is counted, and reported in
  a note ("LOG output suppressed: N lines dropped ..."): at the job's end,
  and during a long flood at most once every ``LOG_BURST_S``.

JSON is never smaller than UTF-8, so a text bounded here also fits a frame
of the same number of bytes.
"""

from __future__ import annotations

import json
import time
from typing import Optional

KiB = 1024

#: The longest LOG line, ERROR text and status description, as stored/published JSON.
LOG_LINE_BYTES = 64 * KiB
ERROR_BYTES = 64 * KiB
DESCRIPTION_BYTES = 64 * KiB
#: The largest meta frame an isolated child may send (its jail layers and timings).
META_BYTES = 16 * KiB

#: LOG bursts may reach this many seconds' worth of lines before the rate applies.
LOG_BURST_S = 10.0

_NOTE_ROOM = 64  # bytes kept free for the note itself


def human_bytes(size: int) -> str:
    """``312 MB``, ``64 KB``, ``17 bytes``: sizes as a person reads them (powers of 1000)."""
    size = int(size)
    for unit, scale in (("EB", 10**18), ("PB", 10**15), ("TB", 10**12), ("GB", 10**9), ("MB", 10**6),
                        ("KB", 10**3)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} bytes"


def _json_size(text: str) -> int:
    return len(json.dumps(text)) - 2


def truncate(text: str, limit: int, dropped: int = 0) -> str:
    """``text`` if its JSON encoding fits ``limit`` bytes, else its head and a note.

    Measured as JSON because that is what is stored and published: a
    character can take up to 12 bytes there (an escaped surrogate pair), so a
    limit in characters would not bound the bytes. ``dropped``: bytes already
    cut before ``text`` got here (they count in the note, which is then
    always added)."""
    if not dropped and len(text) * 12 <= limit:  # the common case, without encoding anything
        return text
    head = text[:limit]  # every character takes at least one byte
    if not dropped and len(head) == len(text) and _json_size(text) <= limit:
        return text
    room = max(0, limit - _NOTE_ROOM)
    size = _json_size(head)
    while size > room:
        head = head[: max(0, int(len(head) * room / size) - 1)]
        size = _json_size(head)
    dropped += len(text[len(head):].encode("utf-8", "replace"))
    return f"{head}... [truncated: {human_bytes(dropped)} more]"


class LogLimiter:
    """How much LOG output one job may publish.

    At most ``lines_per_s`` lines a second on average (bursts up to
    ``LOG_BURST_S`` seconds' worth) and ``bytes_per_job`` bytes in all; 0
    turns a bound off. Lines over either bound are dropped and counted;
    :meth:`note` says so when the job ends, and during a long flood at most
    once every ``LOG_BURST_S``, so the note itself cannot become a flood.
    """

    def __init__(self, lines_per_s: float, bytes_per_job: int) -> None:
        self.lines_per_s = float(lines_per_s)
        self.bytes_per_job = int(bytes_per_job)
        self.capacity = max(1.0, self.lines_per_s * LOG_BURST_S)
        self._tokens = self.capacity
        self._last = time.monotonic()
        self.sent_bytes = 0
        self.dropped_lines = 0
        self.dropped_bytes = 0
        self._reported = 0  # dropped lines already reported in a note
        self._noted_at = self._last

    def admit(self, size: int) -> bool:
        """Whether a line of ``size`` bytes may go out now (counted if so)."""
        if self.bytes_per_job and self.sent_bytes + size > self.bytes_per_job:
            return self._drop(size)
        if self.lines_per_s > 0:
            now = time.monotonic()
            self._tokens = min(self.capacity, self._tokens + (now - self._last) * self.lines_per_s)
            self._last = now
            if self._tokens < 1.0:
                return self._drop(size)
            self._tokens -= 1.0
        self.sent_bytes += size
        return True

    def _drop(self, size: int) -> bool:
        self.dropped_lines += 1
        self.dropped_bytes += size
        return False

    def note(self, final: bool = False) -> Optional[str]:
        """The line saying what was dropped since the last note, or None (also
        while the last note is under ``LOG_BURST_S`` old, unless ``final``)."""
        dropped = self.dropped_lines - self._reported
        now = time.monotonic()
        if not dropped or (not final and now - self._noted_at < LOG_BURST_S):
            return None
        self._reported, self._noted_at = self.dropped_lines, now
        limits = []
        if self.lines_per_s > 0:
            limits.append(f"{self.lines_per_s:g} lines/s, NDIF_LOG_LINES_PER_S")
        if self.bytes_per_job:
            limits.append(f"{human_bytes(self.bytes_per_job)} per job, NDIF_LOG_BYTES_PER_JOB")
        return (f"LOG output suppressed: {dropped} lines dropped (this server's LOG limits: "
                f"{'; '.join(limits)}).")
