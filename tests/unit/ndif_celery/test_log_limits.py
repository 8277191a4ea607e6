"""Repeated log records (``ndif_celery.log_limits``): the first few of a source
pass, the rest are counted, and one line with the count closes the window;
sources are counted apart. The flood on a real web is
tests/e2e/api/test_log_flood.py."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap

from ndif_celery import log_limits
from tests.support.paths import ROOT


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self) -> list[str]:
        return [record.getMessage() for record in self.records]


def _logger(name: str, limit: log_limits.RepeatLimit) -> tuple[logging.Logger, Kept]:
    logger = logging.getLogger(f"test_log_limits.{name}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    logger.handlers[:] = [kept := Kept()]
    logger.filters[:] = [limit]
    return logger, kept


def _fail(logger: logging.Logger, error: type = TypeError, packet: str = "4") -> None:
    try:
        raise error("not subscriptable")
    except error:
        logger.exception("message handler error on packet %r", packet)


def test_the_first_pass_the_rest_are_counted_and_one_line_says_how_many():
    clock = Clock()
    limit = log_limits.RepeatLimit(burst=3, window_s=60, clock=clock, timer=False)
    logger, kept = _logger("burst", limit)
    for n in range(5000):
        _fail(logger, packet=str(n))  # arguments differ: still one source
        clock.now += 0.001
    assert len(kept.records) == 3
    assert all(record.exc_info for record in kept.records)  # the ones that pass keep their traceback
    assert limit.flush() == 0  # the window has not ended
    clock.now += 60
    assert limit.flush() == 1
    summary = kept.records[-1]
    assert summary.levelno == logging.ERROR and summary.exc_info is None
    assert summary.getMessage().startswith(
        'test_log_limits.burst "message handler error on packet %r" (TypeError) repeated 4,997 more times '
        "in the last 60 s, not logged")
    assert limit.flush() == 0  # said once


def test_the_next_record_after_the_window_says_the_count_first_and_opens_a_new_window():
    clock = Clock()
    limit = log_limits.RepeatLimit(burst=2, window_s=10, clock=clock, timer=False)
    logger, kept = _logger("next", limit)
    for _ in range(10):
        logger.warning("Invalid session %s", "x")
    clock.now += 11
    for _ in range(3):
        logger.warning("Invalid session %s", "y")
    assert kept.lines() == [
        "Invalid session x", "Invalid session x",
        'test_log_limits.next "Invalid session %s" repeated 8 more times in the last 10 s, not logged '
        "(at most 2 a window of 10 s)",
        "Invalid session y", "Invalid session y",
    ]


def test_sources_are_counted_apart():
    clock = Clock()
    limit = log_limits.RepeatLimit(burst=2, window_s=60, clock=clock, timer=False)
    one, kept_one = _logger("one", limit)
    two, kept_two = _logger("two", limit)
    for _ in range(50):
        _fail(one, TypeError)
        _fail(one, ValueError)  # another exception type: another source
        one.error("message handler error on packet %r", "4")  # no exception: another source
        one.warning("message handler error on packet %r", "4")  # another level: another source
        _fail(two, TypeError)  # another logger: another source
    assert len(kept_one.records) == 8 and len(kept_two.records) == 2
    clock.now += 61
    assert limit.flush() == 5
    counts = [line.split(" repeated ")[1].split(" ")[0] for line in kept_one.lines() + kept_two.lines()
              if " repeated " in line]
    assert counts == ["48"] * 5


def test_sources_past_the_most_remembered_are_closed_oldest_first_with_their_count():
    clock = Clock()
    limit = log_limits.RepeatLimit(burst=1, window_s=60, clock=clock, timer=False, max_sources=4)
    logger, kept = _logger("many", limit)
    logger.warning("first")
    logger.warning("first")
    for n in range(10):
        logger.warning(f"unique {n}")  # a preformatted message is its own source
    assert len(limit._sources) == 4
    assert 'test_log_limits.many "first" repeated 1 more time in' in " | ".join(kept.lines())


def test_lines_below_warning_pass_unless_they_carry_a_traceback():
    """An access line per request (one template, gunicorn's) is the log's
    purpose; the rotation of the files bounds it, not this."""
    clock = Clock()
    limit = log_limits.RepeatLimit(burst=2, window_s=60, clock=clock, timer=False)
    logger, kept = _logger("info", limit)
    for n in range(100):
        logger.info("%(h)s %(r)s %(s)s", {"h": "127.0.0.1", "r": f"GET /ping?{n}", "s": 200})
        try:
            raise KeyError(n)
        except KeyError:
            logger.info("dropped a message", exc_info=True)
    assert len(kept.records) == 102
    assert [r.exc_info is not None for r in kept.records].count(True) == 2


def test_no_limit_with_a_burst_of_0():
    limit = log_limits.RepeatLimit(burst=0, timer=False)
    logger, kept = _logger("off", limit)
    for _ in range(100):
        _fail(logger)
    assert len(kept.records) == 100


def test_the_timer_says_the_count_when_the_window_ends_without_another_record():
    limit = log_limits.RepeatLimit(burst=1, window_s=0.3)
    logger, kept = _logger("timer", limit)
    for _ in range(20):
        _fail(logger)
    import time

    deadline = time.monotonic() + 10
    while len(kept.records) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [line.split(" more times")[0] for line in kept.lines()[1:]] == [
        'test_log_limits.timer "message handler error on packet %r" (TypeError) repeated 19']


def test_install_limits_every_logger_of_the_process_and_says_what_is_left_at_exit():
    """In a process of its own: install changes the whole process's logging.
    A library's logger with its own stderr handler (engine.io's), made before
    install, and a logger made after it, are both limited; the counts come at exit."""
    script = textwrap.dedent("""
        import logging, sys
        early = logging.getLogger("engineio.server")
        early.addHandler(logging.StreamHandler())
        early.setLevel(logging.ERROR)
        from ndif_celery import log_limits
        log_limits.install(burst=3, window_s=60)
        late = logging.getLogger("made.later")
        late.addHandler(logging.StreamHandler())
        for n in range(1000):
            try:
                [][n]
            except IndexError:
                early.exception("message handler error")
            late.warning("client %s sent nonsense", n)
        logging.getLogger("quiet").warning("once")
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    err = result.stderr
    print(f"{len(err)} bytes on stderr for 2,000 records")
    assert err.count("Traceback") == 3 and err.count("message handler error") == 4
    assert len(re.findall(r"client \d+ sent", err)) == 3
    assert 'engineio.server "message handler error" (IndexError) repeated 997 more times' in err
    assert 'made.later "client %s sent nonsense" repeated 997 more times' in err
    assert "once" in err
    assert len(err) < 5000
