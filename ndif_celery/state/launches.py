"""The record of each worker launched through a cluster's scheduler (``ndif_celery.farm.elastic``).

One hash, one JSON record per launch: its scheduler's id, state and reason,
the model that asked for it, its worker once registered. The beat writes it;
the CLI, ``/metrics`` and the operator's ``/status`` read it.
"""

from __future__ import annotations

import json

import redis

LAUNCHES = "ndif:launches"  # hash: launch id -> its record (JSON)
PAUSED = "ndif:launches:paused"  # set by `ndif-celery launches pause`
PENDING, RUNNING, ENDED = "PENDING", "RUNNING", "ENDED"
#: A launch the scheduler refused: its record keeps the reason, it has no id of the scheduler's.
REFUSED = "REFUSED"
STATES = (PENDING, RUNNING, ENDED, REFUSED)


def read(client: redis.Redis) -> dict[str, dict]:
    """Every launch on record, by id."""
    return {key.decode(): json.loads(value) for key, value in client.hgetall(LAUNCHES).items()}


def write(client: redis.Redis, launch: dict) -> None:
    client.hset(LAUNCHES, launch["id"], json.dumps(launch))


def alive(launches: dict) -> list[dict]:
    """The launches pending or running."""
    return [launch for launch in launches.values() if launch["state"] in (PENDING, RUNNING)]


def paused(client: redis.Redis) -> bool:
    return bool(client.exists(PAUSED))
