"""``ndif-celery logs``: the tail of ``$NDIF_HOME/logs/<service>.log``, optionally followed.

``up`` appends each service's output to its own file (see
:func:`ndif_celery.host.stack.log_path`), one run after another, so the tail is the
latest run's last lines; extra processes started by hand next to the stack
(``worker-<name>.log``) are listed and can be tailed by that name too. A log
is rotated in place (:mod:`ndif_celery.host.log_rotation`): the tail goes on
into its newest copy when the log itself holds too few lines, and a follower
reads the log from its start again once it was cut.
"""

from __future__ import annotations

import codecs
import os
import time
from pathlib import Path
from typing import Callable, Iterator

from ndif_celery import config

from . import log_rotation, services, stack

POLL_S = 0.25
# How much of what it read last a follower keeps, to see a rotation (a cut in place).
SEEN_BYTES = 256
# How far back from the end of a rotated copy a follower looks for where it was.
COPY_SEARCH_BYTES = 4 * 1024 * 1024


class LogError(Exception):
    """A service or log that does not exist; the message lists what does."""


def existing(settings: config.Settings) -> list[str]:
    """The names of the logs under ``$NDIF_HOME/logs``, without ``.log``."""
    folder = settings.home / "logs"
    return sorted(p.name[:-4] for p in folder.glob("*.log")) if folder.is_dir() else []


def resolve(settings: config.Settings, service: str) -> Path:
    """The log file of ``service``; LogError naming the services and logs that exist."""
    logs = existing(settings)
    where = settings.home / "logs"
    have = f"logs in {where}: {', '.join(logs)}" if logs else \
        f"there are no logs in {where} yet (start the stack with `ndif-celery up`)"
    if service not in services.SERVICES and service not in logs:
        raise LogError(f"unknown service {service!r}; the services are {', '.join(services.SERVICES)}; {have}")
    path = stack.log_path(settings, service)
    if not path.is_file():
        raise LogError(f"no log for {service} at {path} (it has not run in NDIF_HOME={settings.home}); {have}")
    return path


def tail(path: Path, lines: int) -> tuple[list[str], int]:
    """The last ``lines`` lines of ``path`` (the first of them from its newest
    rotated copy, when ``path`` holds fewer) and the offset its end was at."""
    shown, end = _tail_one(path, lines)
    older = log_rotation.backup(path, 1)
    if len(shown) < lines and older.is_file():
        shown = _tail_one(older, lines - len(shown))[0] + shown
    return shown, end


def _tail_one(path: Path, lines: int) -> tuple[list[str], int]:
    """Reads backwards in blocks, so a long log costs only what is shown."""
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        if lines <= 0:
            return [], end
        data, position = b"", end
        while position > 0 and data.count(b"\n") <= lines:
            step = min(64 * 1024, position)
            position -= step
            f.seek(position)
            data = f.read(step) + data
    text = data.decode("utf-8", "replace").splitlines()
    return text[-lines:], end


def follow(path: Path, offset: int, keep_going: Callable[[], bool] = lambda: True) -> Iterator[str]:
    """Text appended to ``path`` after ``offset``, as it comes (until ``keep_going`` says stop).

    A log rotated since the last look (cut in place: shorter, or no longer
    holding the bytes last read where they were) goes on at the end of its
    newest copy, after those bytes, then from the log's start; one replaced
    by another file is read from its start.
    """
    decoder = codecs.getincrementaldecoder("utf-8")("replace")  # a character split across reads
    seen = _read(path, max(0, offset - SEEN_BYTES), min(offset, SEEN_BYTES))  # the bytes just before offset
    inode = None
    while keep_going():
        try:
            stat = path.stat()
        except FileNotFoundError:
            stat = None
        size = stat.st_size if stat is not None else 0
        replaced = stat is not None and inode is not None and stat.st_ino != inode
        inode = stat.st_ino if stat is not None else inode
        if replaced or size < offset or (seen and _read(path, offset - len(seen), len(seen)) != seen):
            if not replaced and seen:
                missed = _after(log_rotation.backup(path, 1), seen)
                if missed:
                    yield decoder.decode(missed)
            offset, seen = 0, b""
        if size > offset:
            chunk = _read(path, offset, size - offset)
            offset += len(chunk)
            seen = (seen + chunk)[-SEEN_BYTES:]
            yield decoder.decode(chunk)
            continue
        time.sleep(POLL_S)


def _read(path: Path, offset: int, size: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(size)
    except FileNotFoundError:
        return b""


def _after(copy: Path, seen: bytes) -> bytes:
    """What follows the last ``seen`` in the end of ``copy`` (b"" when it is not there)."""
    try:
        size = copy.stat().st_size
    except FileNotFoundError:
        return b""
    start = max(0, size - COPY_SEARCH_BYTES)
    tail = _read(copy, start, size - start)
    at = tail.rfind(seen)
    return tail[at + len(seen):] if at >= 0 else b""
