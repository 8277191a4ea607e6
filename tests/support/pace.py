"""Wall-time bounds that hold on whatever machine runs the suite.

Machines that run this suite differ up to 3x in speed, and the suite keeps
two cores busy. A bound tuned on one machine fails on a slower or busier one
with nothing wrong in the code. So a test writes its bound for the reference
machine, idle, and asks :func:`bound` for it here. The bound grows with how
slow this machine is (one calibration per process) and how loaded it is now.

The bound only ever grows: on a faster machine it stays as written. It is
capped at :data:`MAX_FACTOR`, so a hang still fails.

The calibration is one line, the same one docs/performance.md states next to
every absolute time::

    python -c "sum(range(10**8))"

It took :data:`REFERENCE_CPU_S` CPU-seconds on the reference machine: the
slowest 2-core machine the bounds were tuned on.
"""

from __future__ import annotations

import functools
import os
import time

REFERENCE_CPU_S = 3.5  # `sum(range(10**8))` on the reference machine
MAX_FACTOR = 4.0
_SAMPLE = 10**7  # a tenth of the calibration line, timed once per process


@functools.lru_cache(maxsize=1)
def slowness() -> float:
    """This machine's CPU time for the calibration line over the reference's (at least 1)."""
    best = float("inf")
    for _ in range(3):  # the best of three: a preempted sample says nothing about speed
        start = time.process_time()
        sum(range(_SAMPLE))
        best = min(best, time.process_time() - start)
    per_line = best * (10**8 / _SAMPLE)
    return max(1.0, per_line / REFERENCE_CPU_S)


def load() -> float:
    """How many runnable processes share each core now (at least 1)."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def factor() -> float:
    return min(MAX_FACTOR, slowness() * load())


def bound(seconds: float) -> float:
    """``seconds`` on the reference machine, idle, as a bound for this machine now."""
    return seconds * factor()


def describe() -> str:
    """A line for a failure message: why a bound is what it is."""
    return (f"bounds x{factor():.2f} (machine x{slowness():.2f} the reference's time, "
            f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
