"""Which workers are alive and which models they hold, kept in Redis.

Workers write; the web reads (for ``GET /status``) and the CLI reads. A worker
refreshes its entry every few seconds; an entry older than ``STALE_S`` belongs
to a dead worker and is ignored, together with the models it claimed, so a
killed worker disappears from ``/status`` without anyone cleaning up.

- hash ``ndif:workers``      worker name -> JSON {name, host, pid, started_at, last_seen, queues}
- hash ``ndif:deployments``  "<worker>|<model_key>" -> JSON {model_key, worker, state, loaded_at, ...}
- set  ``ndif:queues``       every model queue a request has named
- key  ``ndif:env``          the workers' Python and package versions, for ``GET /env``
"""

from __future__ import annotations

import json
import time
from typing import Optional

import redis

from . import wire

WORKERS = "ndif:workers"
DEPLOYMENTS = "ndif:deployments"
QUEUES = "ndif:queues"
ENV = "ndif:env"
HEARTBEAT_S = 3.0
STALE_S = 15.0


def register_worker(client: redis.Redis, info: dict) -> None:
    info = dict(info, last_seen=time.time())
    client.hset(WORKERS, info["name"], json.dumps(info))


def unregister_worker(client: redis.Redis, name: str) -> None:
    pipe = client.pipeline()
    pipe.hdel(WORKERS, name)
    for field in client.hkeys(DEPLOYMENTS):
        if field.decode().split("|", 1)[0] == name:
            pipe.hdel(DEPLOYMENTS, field)
    pipe.execute()


def set_deployment(client: redis.Redis, worker: str, model_key: str, state: str, **extra) -> None:
    entry = {"model_key": model_key, "worker": worker, "state": state, "updated_at": time.time()}
    entry.update(extra)
    client.hset(DEPLOYMENTS, f"{worker}|{model_key}", json.dumps(entry))


def remove_deployment(client: redis.Redis, worker: str, model_key: str) -> None:
    client.hdel(DEPLOYMENTS, f"{worker}|{model_key}")


def live_workers(client: redis.Redis, now: Optional[float] = None) -> dict:
    now = time.time() if now is None else now
    workers = {}
    for name, raw in client.hgetall(WORKERS).items():
        info = json.loads(raw)
        if now - info.get("last_seen", 0) <= STALE_S:
            workers[name.decode()] = info
    return workers


def live_deployments(client: redis.Redis, workers: Optional[dict] = None) -> list[dict]:
    workers = live_workers(client) if workers is None else workers
    entries = []
    for raw in client.hvals(DEPLOYMENTS):
        entry = json.loads(raw)
        if entry["worker"] in workers:
            entries.append(entry)
    return entries


def status_document(client: redis.Redis) -> dict:
    """``GET /status`` in the shape ``nnsight.status()`` parses: one entry per replica."""
    workers = live_workers(client)
    deployments = {}
    for entry in live_deployments(client, workers):
        name = f"{entry['worker']}:{entry['model_key']}"
        deployments[name] = {
            "model_key": entry["model_key"],
            **wire.repo_fields(entry["model_key"]),
            "deployment_level": "HOT",
            "application_state": entry["state"],
            "worker": entry["worker"],
            "loaded_at": entry.get("loaded_at"),
            "load_seconds": entry.get("load_seconds"),
        }
    return {
        "deployments": deployments,
        "cluster": {
            "workers": {
                name: {k: info.get(k) for k in ("host", "pid", "started_at", "last_seen", "queues")}
                for name, info in workers.items()
            }
        },
    }
