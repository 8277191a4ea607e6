"""Bytes of stored results per key: what each key keeps in the result store.

A result kept in the store (not sent inline) stays there until the expiry
sweep deletes it, ``NDIF_JOB_TTL_S`` after its job ended. So the store is
shared by every key for a day at a time, and each key's part is bounded by
``NDIF_RESULT_QUOTA_BYTES``:

- hash ``ndif:result_bytes``  owner -> bytes of its stored results not yet expired
- hash ``ndif:result_sizes``  job id -> "<bytes> <owner>" of each counted result

A worker reserves a result's bytes before it uploads it (:func:`reserve`), in
one atomic increment: two results of one key racing for the last bytes may
both be refused, never both kept. The sweep gives them back when it deletes
the result (:func:`release`), as does a worker whose upload failed.
"""

from __future__ import annotations

from typing import Optional

import redis

TOTALS = "ndif:result_bytes"
SIZES = "ndif:result_sizes"


def reserve(client: redis.Redis, owner: str, job_id: str, size: int, quota: int) -> Optional[int]:
    """Count ``size`` bytes of ``job_id``'s result against ``owner``: None when
    they fit its ``quota`` (0: none, nothing counted), else the bytes the key
    already keeps (and nothing is counted)."""
    if not quota:
        return None
    used = client.hincrby(TOTALS, owner, size)
    if used > quota:
        client.hincrby(TOTALS, owner, -size)
        return used - size
    client.hset(SIZES, job_id, f"{size} {owner}")
    return None


def release(client: redis.Redis, job_ids: list) -> None:
    """Give back the bytes of ``job_ids``' counted results (their results
    deleted, or never kept); each once, however many sweeps run at once."""
    job_ids = list(dict.fromkeys(job_ids))
    if not job_ids:
        return
    counted = [(job_id, raw) for job_id, raw in zip(job_ids, client.hmget(SIZES, job_ids)) if raw is not None]
    if not counted:
        return
    pipe = client.pipeline(transaction=False)
    for job_id, _ in counted:
        pipe.hdel(SIZES, job_id)
    taken = pipe.execute()
    give_back = client.pipeline(transaction=False)
    for (job_id, raw), removed in zip(counted, taken):
        if removed:  # this call took it off: it gives the bytes back
            size, _, owner = raw.decode().partition(" ")
            give_back.hincrby(TOTALS, owner, -int(size))
    give_back.execute()


def used(client: redis.Redis, owner: str) -> int:
    """Bytes ``owner``'s stored results hold now."""
    return int(client.hget(TOTALS, owner) or 0)
