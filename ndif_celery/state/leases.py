"""Leases: which one of several copies of a thread acts, by a Redis key that expires.

The farm runs some threads in every process of a kind (the controller in
every worker, the watchdog and the probes in every beat) and wants one of
each to act. Each copy calls :meth:`Lease.hold` before it acts: the first to
find the key free takes it, its holder renews it, the others wait. A holder
that dies stops renewing, and the key expires after ``ms`` milliseconds, so
another copy takes over.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import redis

# Take the key if free, renew it if ours: one step, so it cannot expire between the two.
_HOLD = """
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return 1
end
if redis.call('get', KEYS[1]) == ARGV[1] then
    redis.call('pexpire', KEYS[1], ARGV[2])
    return 1
end
return 0
"""

# Delete the key only while ours: a lease that expired and went to another stays theirs.
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""


class Lease:
    """One holder at a time of ``key``, for ``ms`` milliseconds after its last renewal."""

    def __init__(self, redis_client: redis.Redis, key: str, holder: str, ms: int) -> None:
        self.redis = redis_client
        self.key = key
        self.holder = holder
        self.ms = int(ms)

    def hold(self) -> bool:
        """Take the lease if free or renew it if ours; False while another holds it."""
        return bool(self.redis.eval(_HOLD, 1, self.key, self.holder, self.ms))

    def release(self) -> None:
        """Give the lease up if ours, so another copy takes it without waiting for expiry."""
        self.redis.eval(_RELEASE, 1, self.key, self.holder)

    def lead(self, tick: Callable[[], object], stopping: threading.Event, every_s: float,
             log: logging.Logger, what: str) -> None:
        """Call ``tick`` every ``every_s`` while this copy holds the lease, until ``stopping``.

        A failed tick is logged on ``log`` as ``what failed`` and the loop goes on: the thread outlives any one bad pass."""
        while not stopping.is_set():
            try:
                if self.hold():
                    tick()
            except Exception:  # noqa: BLE001 - one bad pass (or Redis blip) never ends the thread
                log.exception("%s failed", what)
            stopping.wait(every_s)
