"""Repeated warnings: once per change, then a reminder (``ndif_celery.notices``).

The controller met "no live worker can take another replica" on every tick
(0.5 s) and logged it every time, for as long as it lasted; the web's hub did
the same with Redis away. Here: a subject's warning is logged when it appears
or changes, suppressed while it repeats, logged again (with the count) after
``remind_s``, and its end said once.
"""

from __future__ import annotations

import logging

from ndif_celery.notices import Notices


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_repeated_warning_is_logged_once_per_change_and_then_as_a_reminder(caplog):
    clock = Clock()
    notices = Notices(logging.getLogger("test.notices"), remind_s=300, clock=clock)
    caplog.set_level(logging.INFO, logger="test.notices")
    logged = []
    for tick in range(600):  # five minutes of a 0.5 s loop meeting the same trouble
        clock.now = tick * 0.5
        logged.append(notices.warn("m", "Could not deploy m: no live worker can take another replica of it."))
    assert logged.count(True) == 1 and logged[0]
    clock.now = 300.0
    assert notices.warn("m", "Could not deploy m: no live worker can take another replica of it.")
    assert "still so: 599 more times" in caplog.records[-1].getMessage()
    # A change of state is logged at once; another subject has its own state.
    assert notices.warn("m", "Could not deploy m: the model needs 80 GiB, the largest worker has 24 GiB.")
    assert notices.warn("other", "Could not deploy other: no live worker can take another replica of it.")
    notices.cleared("m", "m can be placed again")
    assert caplog.records[-1].levelno == logging.INFO and caplog.records[-1].getMessage() == "m can be placed again"
    # After the end, the same trouble again is news.
    assert notices.warn("m", "Could not deploy m: no live worker can take another replica of it.")
    notices.cleared("never-warned")  # nothing to say
    assert caplog.records[-1].getMessage().startswith("Could not deploy m")
