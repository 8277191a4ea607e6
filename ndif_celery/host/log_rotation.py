"""Logs under ``$NDIF_HOME/logs`` that keep to a disk budget.

Each log is rotated once it reaches ``NDIF_LOG_MAX_BYTES``, and
``NDIF_LOG_BACKUPS`` older copies are kept (``web.log.1`` the newest).
The services write through a descriptor ``up`` opened in append mode, and
never reopen their log. So a log is rotated by copy and truncate: its bytes
go to ``<name>.log.1`` (older copies move up one, the oldest is deleted), then
the file is cut to nothing in place, and each writer's next append lands
at its start. A line written in the instant between the copy and the cut is
lost.

The supervisor rotates every ``*.log`` of the folder at each look it takes
at the services (five a second): it lives as long as the stack, in the
foreground or detached. Copies are whole, and the oldest gives up its
oldest lines when the copies together would hold more than ``NDIF_LOG_BACKUPS``
x ``NDIF_LOG_MAX_BYTES``. So a log and its copies hold at most
(``NDIF_LOG_BACKUPS`` + 1) x ``NDIF_LOG_MAX_BYTES``, plus what its service
writes between two looks.
"""

from __future__ import annotations

import os
from pathlib import Path

from ndif_celery import config

CHUNK = 1024 * 1024


def backup(path: Path, n: int) -> Path:
    """The ``n``-th newest rotated copy of ``path`` (``web.log.1``)."""
    return path.with_name(f"{path.name}.{n}")


def files_of(path: Path) -> list[Path]:
    """``path`` and its rotated copies that exist, newest first."""
    found = [path] if path.exists() else []
    n = 1
    while backup(path, n).exists():
        found.append(backup(path, n))
        n += 1
    return found


def budget(settings: config.Settings) -> int:
    """Bytes one log and its copies may hold (0: no bound)."""
    return settings.log_max_bytes * (settings.log_backups + 1)


def rotate(path: Path, max_bytes: int, backups: int) -> bool:
    """Rotate ``path`` if it holds ``max_bytes`` or more; whether it did.

    ``max_bytes`` 0 never rotates. With ``backups`` 0 the log is only cut.
    """
    if max_bytes <= 0:
        return False
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False
    if size < max_bytes:
        return False
    extra = backups + 1
    while backup(path, extra).exists():  # left by a larger NDIF_LOG_BACKUPS before
        backup(path, extra).unlink()
        extra += 1
    if backups:
        backup(path, backups).unlink(missing_ok=True)
        for n in range(backups - 1, 0, -1):
            if backup(path, n).exists():
                os.replace(backup(path, n), backup(path, n + 1))
        _copy(path, backup(path, 1), backups * max_bytes)
        _trim_oldest(path, backups, backups * max_bytes)
    os.truncate(path, 0)
    return True


def _copy(source: Path, target: Path, most: int) -> None:
    """``source`` to ``target``, read to its end as it is now (what a service
    appends meanwhile comes too); no more than its newest ``most`` bytes."""
    tmp = target.with_name(target.name + ".tmp")
    with open(source, "rb") as src:
        _stream(src, most, tmp)
    os.replace(tmp, target)


def _trim_oldest(path: Path, backups: int, most: int) -> None:
    """Keep the copies of ``path`` to ``most`` bytes in all, by taking from the oldest."""
    copies = [backup(path, n) for n in range(1, backups + 1) if backup(path, n).exists()]
    excess = sum(p.stat().st_size for p in copies) - most
    for oldest in reversed(copies):
        if excess <= 0:
            return
        size = oldest.stat().st_size
        if size <= excess:
            oldest.unlink()
        else:
            tmp = oldest.with_name(oldest.name + ".tmp")
            with open(oldest, "rb") as src:
                kept = _stream(src, size - excess, tmp)
            os.replace(tmp, oldest)
            if not kept:
                oldest.unlink()
        excess -= size


def _stream(src, most: int, target: Path) -> int:
    """From ``src``'s last ``most`` bytes (from a line's start, where one is
    near) to its end, into ``target``; the bytes written."""
    size = src.seek(0, os.SEEK_END)
    src.seek(max(0, size - most))
    data = src.read(CHUNK)
    if size > most and b"\n" in data:
        data = data[data.index(b"\n") + 1:]
    written = 0
    with open(target, "wb") as dst:
        while data:
            dst.write(data)
            written += len(data)
            data = src.read(CHUNK)
    return written


def rotate_all(settings: config.Settings) -> list[str]:
    """Rotate every log of ``$NDIF_HOME/logs`` that reached its size; their names."""
    folder = settings.home / "logs"
    if settings.log_max_bytes <= 0 or not folder.is_dir():
        return []
    return [path.name for path in sorted(folder.glob("*.log"))
            if rotate(path, settings.log_max_bytes, settings.log_backups)]
