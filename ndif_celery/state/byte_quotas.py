"""Bytes each key holds in a shared place, counted against its quota.

Two places are shared by every key and bounded per key:

- :data:`RESULTS`: stored results, in the result store until the expiry sweep
  deletes them (``NDIF_RESULT_QUOTA_BYTES``).
- :data:`PARKED`: what a key's jobs hold in Redis (``NDIF_MAX_PARKED_BYTES_PER_KEY``):
  each payload until its job is answered or ends unrun, and each job's records
  (statuses, owner, message) until they expire.

Each quota is two hashes: owner -> bytes held, and entry -> "<bytes> <owner>".
An entry is one thing held (a job's result, payload or records). Adding to
it and giving it back are Lua steps, so two racing writers never both
overshoot, and an entry given back twice is given back once.
"""

from __future__ import annotations

from typing import Optional

import redis

# KEYS: totals, sizes. ARGV: entry, owner, bytes, quota (0: none).
# Returns the bytes the owner held before, negated when refused.
_ADD = """
local held = tonumber(redis.call('hget', KEYS[1], ARGV[2]) or '0')
local size, quota = tonumber(ARGV[3]), tonumber(ARGV[4])
if quota > 0 and held + size > quota then return -held - 1 end
local raw = redis.call('hget', KEYS[2], ARGV[1])
local before = 0
if raw then before = tonumber(string.match(raw, '^(%d+)')) end
redis.call('hset', KEYS[2], ARGV[1], (before + size) .. ' ' .. ARGV[2])
redis.call('hincrby', KEYS[1], ARGV[2], size)
return held
"""

# KEYS: totals, sizes. ARGV: the entries. Returns the bytes given back.
_RELEASE = """
local freed = 0
for _, entry in ipairs(ARGV) do
  local raw = redis.call('hget', KEYS[2], entry)
  if raw then
    redis.call('hdel', KEYS[2], entry)
    local size, owner = string.match(raw, '^(%d+) (.*)$')
    size = tonumber(size)
    if redis.call('hincrby', KEYS[1], owner, -size) <= 0 then redis.call('hdel', KEYS[1], owner) end
    freed = freed + size
  end
end
return freed
"""


class ByteQuota:
    """One shared place's bytes, per key."""

    def __init__(self, totals: str, sizes: str) -> None:
        self.totals = totals  # hash: owner -> bytes held
        self.sizes = sizes  # hash: entry -> "<bytes> <owner>"

    def reserve(self, client: redis.Redis, owner: str, entry: str, size: int, quota: int) -> Optional[int]:
        """Count ``size`` more bytes of ``entry`` against ``owner``: None when
        they fit ``quota`` (0: none), else the bytes the owner already holds
        (and nothing is counted)."""
        held = client.eval(_ADD, 2, self.totals, self.sizes, entry, owner, size, quota)
        return None if held >= 0 else -held - 1

    def add(self, pipe, owner: str, entry: str, size: int) -> None:
        """Count ``size`` more bytes of ``entry``, whatever the quota: bytes
        already written (a final status), joined to the caller's pipeline."""
        pipe.eval(_ADD, 2, self.totals, self.sizes, entry, owner, size, 0)

    def release(self, client_or_pipe, entries: list) -> None:
        """Give back the bytes of ``entries`` (each once, however many callers race)."""
        entries = list(dict.fromkeys(entries))
        if entries:
            client_or_pipe.eval(_RELEASE, 2, self.totals, self.sizes, *entries)

    def used(self, client: redis.Redis, owner: str) -> int:
        """Bytes ``owner`` holds here now."""
        return int(client.hget(self.totals, owner) or 0)


RESULTS = ByteQuota("ndif:result_bytes", "ndif:result_sizes")
PARKED = ByteQuota("ndif:parked_bytes", "ndif:parked_sizes")


#: What a job's records take in Redis when it is parked (its QUEUED status,
#: owner, Celery message, registrations); its final status is counted when sent.
RECORD_BYTES = 2048


def payload_entry(job_id: str) -> str:
    """A job's payload among its key's parked bytes."""
    return f"{job_id}:payload"


def records_entry(job_id: str) -> str:
    """A job's records (statuses, owner, message) among its key's parked bytes."""
    return f"{job_id}:records"
