"""The logs under ``$NDIF_HOME/logs`` kept to their budget
(``ndif_celery.host.log_rotation``), rotated in place while a writer holds
them open in append mode, as ``up``'s services do; ``ndif-celery logs``
(tail and follow) across a rotation. The flood on a real stack is
tests/e2e/api/test_log_flood.py."""

from __future__ import annotations

import os

from ndif_celery import config
from ndif_celery.host import log_rotation, logs, supervisor


def _line(n: int) -> bytes:
    return f"{n:06d} {'x' * 90}\n".encode()  # 98 bytes


def _numbers(text: str) -> list[int]:
    return [int(line.split()[0]) for line in text.splitlines() if line.strip()]


def test_a_log_written_through_an_append_descriptor_stays_within_its_budget(tmp_path):
    path = tmp_path / "web.log"
    writer = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # as up hands it to a service
    max_bytes, backups = 10_000, 2
    try:
        for n in range(5000):
            os.write(writer, _line(n))
            if n % 7 == 0:  # the supervisor's looks, between writes
                log_rotation.rotate(path, max_bytes, backups)
    finally:
        os.close(writer)
    files = log_rotation.files_of(path)
    sizes = {p.name: p.stat().st_size for p in files}
    print(f"\n{5000 * 98:,} bytes written; kept {sizes}")
    assert [p.name for p in files] == ["web.log", "web.log.1", "web.log.2"]
    assert sizes["web.log"] < max_bytes + 7 * 98  # plus what came between two looks
    assert sizes["web.log.1"] + sizes["web.log.2"] <= backups * max_bytes
    # Whole lines, newest last, no gap between the files: the writer never reopened.
    kept = _numbers("".join(p.read_text() for p in reversed(files)))
    assert kept == list(range(kept[0], 5000))
    assert b"\0" not in path.read_bytes()  # the next append after the cut went to its start


def test_what_is_under_its_size_stays_and_0_never_rotates(tmp_path):
    path = tmp_path / "beat.log"
    path.write_bytes(b"a\n" * 100)
    assert not log_rotation.rotate(path, 1000, 3)
    assert not log_rotation.rotate(path, 0, 3)
    assert log_rotation.files_of(path) == [path]
    assert log_rotation.rotate(path, 200, 0)  # no copies: only cut
    assert log_rotation.files_of(path) == [path] and path.stat().st_size == 0


def test_copies_beyond_fewer_backups_are_removed_and_the_oldest_gives_way(tmp_path):
    path = tmp_path / "worker.log"
    for n in range(1, 6):
        log_rotation.backup(path, n).write_bytes(b"".join(_line(1000 * n + i) for i in range(10)))
    path.write_bytes(b"".join(_line(i) for i in range(15)))  # 1,470 bytes
    assert log_rotation.rotate(path, 1000, 2)
    files = log_rotation.files_of(path)
    assert [p.name for p in files] == ["worker.log", "worker.log.1", "worker.log.2"]
    assert _numbers(files[1].read_text()) == list(range(15))  # whole
    assert _numbers(files[2].read_text()) == list(range(1005, 1010))  # the old .1, its oldest lines given up
    assert files[1].stat().st_size + files[2].stat().st_size <= 2000


def test_the_supervisor_rotates_every_log_of_the_folder_at_its_look(tmp_path):
    settings = config.load({"NDIF_HOME": str(tmp_path), "NDIF_LOG_MAX_BYTES": "1000", "NDIF_LOG_BACKUPS": "1"})
    folder = tmp_path / "logs"
    folder.mkdir()
    for name in ("web.log", "worker-gpu1-host.log", "supervisor.log"):
        (folder / name).write_bytes(_line(1) * 20)
    (folder / "small.log").write_bytes(_line(1))
    keeper = supervisor.Supervisor(settings, {}, lambda line: None)
    keeper.rotate_logs()
    assert sorted(p.name for p in folder.iterdir()) == [
        "small.log", "supervisor.log", "supervisor.log.1", "web.log", "web.log.1",
        "worker-gpu1-host.log", "worker-gpu1-host.log.1"]
    assert log_rotation.budget(settings) == 2000
    assert logs.existing(settings) == ["small", "supervisor", "web", "worker-gpu1-host"]


def test_logs_tail_goes_on_into_the_newest_copy(tmp_path):
    path = tmp_path / "web.log"
    path.write_bytes(b"".join(_line(n) for n in range(50)))
    log_rotation.rotate(path, 1000, 1)
    with open(path, "ab") as f:
        f.write(_line(50) + _line(51))
    shown, end = logs.tail(path, 5)
    assert _numbers("\n".join(shown)) == [47, 48, 49, 50, 51]
    assert end == path.stat().st_size


def test_logs_follow_goes_on_across_a_rotation_without_a_gap(tmp_path):
    """The follower reads; the log gets more lines, is cut, and grows past
    where the follower was before its next look: it reads the lines it missed
    from the copy, then the log from its start. Then a cut that leaves the log
    shorter than where the follower was."""
    path = tmp_path / "web.log"
    writer = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def write(first: int, last: int) -> None:
        os.write(writer, b"".join(_line(n) for n in range(first, last)))

    try:
        write(0, 10)
        _, offset = logs.tail(path, 0)
        reader = logs.follow(path, offset)
        got = ""

        def read_to(last: int) -> None:
            nonlocal got
            while _numbers(got)[-1:] != [last]:
                got += next(reader)

        write(10, 20)
        read_to(19)
        write(20, 40)
        assert log_rotation.rotate(path, 3000, 2)
        write(40, 80)  # past where the follower was
        read_to(79)
        write(80, 81)
        assert log_rotation.rotate(path, 3000, 2)
        write(81, 82)  # shorter than where the follower was
        read_to(81)
    finally:
        os.close(writer)
    assert _numbers(got) == list(range(10, 82))
