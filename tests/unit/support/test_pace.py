"""``tests.support.pace``: bounds grow with a slower or busier machine, never shrink, and stay capped."""

from __future__ import annotations

import os

from tests.support import pace


def test_a_bound_never_shrinks_below_what_the_test_wrote():
    assert pace.slowness() >= 1.0 and pace.load() >= 1.0
    assert 5.0 <= pace.bound(5.0) <= 5.0 * pace.MAX_FACTOR


def test_a_slower_machine_gets_a_longer_bound(monkeypatch):
    pace.slowness.cache_clear()
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    try:
        fast = pace.bound(2.0)
        # The same measured speed against a reference machine 4x as fast: this one is the slow one.
        monkeypatch.setattr(pace, "REFERENCE_CPU_S", pace.REFERENCE_CPU_S / 1000)
        pace.slowness.cache_clear()
        assert pace.slowness() > 1.0
        assert pace.bound(2.0) > fast
        assert pace.bound(2.0) == 2.0 * pace.MAX_FACTOR  # capped: a hang still fails
    finally:
        pace.slowness.cache_clear()


def test_a_busy_machine_gets_a_longer_bound(monkeypatch):
    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    idle = pace.bound(3.0)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0 * cores, 0.0, 0.0))
    assert pace.load() == 3.0
    assert pace.bound(3.0) == min(3.0 * pace.MAX_FACTOR, idle * 3.0)
    assert "load" in pace.describe()
