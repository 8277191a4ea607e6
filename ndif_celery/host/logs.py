"""``ndif-celery logs``: the tail of ``$NDIF_HOME/logs/<service>.log``, optionally followed.

``up`` appends each service's output to its own file (see
:func:`ndif_celery.host.stack.log_path`), one run after another, so the tail is the
latest run's last lines; extra processes started by hand next to the stack
(``worker-<name>.log``) are listed and can be tailed by that name too.
"""

from __future__ import annotations

import codecs
import os
import time
from pathlib import Path
from typing import Callable, Iterator

from ndif_celery import config

from . import services, stack

POLL_S = 0.25


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
    """The last ``lines`` lines of ``path`` and the offset its end was at.

    Reads backwards in blocks, so a long log costs only what is shown.
    """
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

    A file that got shorter (truncated, or replaced) is read again from its start.
    """
    decoder = codecs.getincrementaldecoder("utf-8")("replace")  # a character split across reads
    while keep_going():
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = 0
        if size < offset:
            offset = 0
        if size > offset:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read(size - offset)
            offset += len(chunk)
            yield decoder.decode(chunk)
            continue
        time.sleep(POLL_S)
