"""The controller's replicas against a real embedded Redis and the real Celery app,
ticked by hand: a replica grows on wait (a model's oldest job waited, every holder
busy) and shrinks on idle (an extra replica unused for ``NDIF_REPLICA_IDLE_S``),
never below one; a model no live worker can hold waits for a launched worker when
one may be launched (``NDIF_LAUNCHER``), and fails its jobs when none may. The
farm doing it with real workers is tests/e2e/farm/test_farm_replicas.py and
tests/e2e/farm/test_slurm.py.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

import pytest

from ndif_celery import wire
from ndif_celery.celery_app import LOAD_MODEL, EVICT_MODEL, make_app, queue_for, worker_queue
from ndif_celery.farm import actions
from ndif_celery.farm.controller import Controller
from ndif_celery.state import jobs, launches, queues, registry

GiB = 1 << 30
KEY = actions.model_key_for("controller/tiny")


@pytest.fixture
def app(embedded_settings):
    return make_app(embedded_settings)


def _controller(client, app, settings, **changes) -> Controller:
    return Controller("w0", client, app, dataclasses.replace(settings, **changes))


def _worker(client, name: str, gib: float = 4.0) -> None:
    registry.register_worker(client, {"name": name, "pid": 1, "memory_bytes": int(gib * GiB), "last_seen": time.time()})


def _holds(client, name: str, last_used: float) -> None:
    registry.set_deployment(client, name, KEY, registry.RUNNING, size_bytes=GiB, last_used=last_used)


def _waiting(client, app, waited_s: float) -> jobs.Job:
    job = jobs.Job(id=uuid.uuid4().hex, model_key=KEY, received_at=time.time() - waited_s)
    client.set(jobs.status_key(job.id), wire.response_json(job.id, wire.QUEUED, ""))
    client.sadd(registry.QUEUES, queue_for(KEY))
    client.lpush(*queues.job_message(app, job))
    return job


def _sent(client, worker: str) -> list[str]:
    """The tasks the controller sent to ``worker``'s own queue, oldest first."""
    return [json.loads(raw)["headers"]["task"] for raw in reversed(client.lrange(worker_queue(worker), 0, -1))]


@pytest.fixture
def sized(redis_client):
    redis_client.hset(registry.SIZES, f"{KEY}|", GiB // 2)  # the hub is not asked
    return redis_client


def test_a_replica_grows_on_wait_only_when_every_holder_is_busy_and_the_wait_is_long(sized, app, embedded_settings):
    client = sized
    _worker(client, "w0")
    _worker(client, "w1")
    _holds(client, "w0", time.time())
    controller = _controller(client, app, embedded_settings, replica_wait_s=5.0, autoscale_backoff_s=0.0)
    _waiting(client, app, waited_s=1.0)
    controller.tick()
    assert _sent(client, "w1") == [], "a short wait adds no replica"
    _waiting(client, app, waited_s=10.0)
    controller.tick()
    assert _sent(client, "w1") == [LOAD_MODEL], "the oldest job waited past NDIF_REPLICA_WAIT_S"
    assert registry.get_deployment(client, "w1", KEY)["state"] == registry.DEPLOYING
    controller.tick()
    assert _sent(client, "w1") == [LOAD_MODEL], "a replica still loading is not added again"


def test_a_replica_grows_no_further_than_the_farms_bound(sized, app, embedded_settings):
    client = sized
    for name in ("w0", "w1", "w2"):
        _worker(client, name)
    _holds(client, "w0", time.time())
    _holds(client, "w1", time.time())
    controller = _controller(client, app, embedded_settings, replica_wait_s=1.0, autoscale_backoff_s=0.0,
                             max_replicas=2)
    _waiting(client, app, waited_s=10.0)
    controller.tick()
    assert _sent(client, "w2") == []


def test_an_extra_replica_shrinks_on_idle_and_the_last_one_stays(sized, app, embedded_settings):
    client = sized
    _worker(client, "w0")
    _worker(client, "w1")
    now = time.time()
    _holds(client, "w0", now - 5)  # used lately
    _holds(client, "w1", now - 120)  # idle for two minutes
    controller = _controller(client, app, embedded_settings, replica_idle_s=60.0)
    controller.tick()
    assert _sent(client, "w1") == [EVICT_MODEL] and _sent(client, "w0") == []
    registry.remove_deployment(client, "w1", KEY)  # what the worker does when it evicts
    _holds(client, "w0", now - 600)  # now the only replica, idle too
    controller.tick()
    assert _sent(client, "w0") == [], "never below one replica"


def test_a_model_no_worker_can_hold_waits_for_a_launched_worker_if_one_may_come(sized, app, embedded_settings):
    client = sized
    client.hset(registry.SIZES, f"{KEY}|", 8 * GiB)
    _worker(client, "w0", gib=1.0)
    job = _waiting(client, app, waited_s=0.0)
    # A launcher that may launch: the job waits, and the deployments' "why not" says why.
    _controller(client, app, embedded_settings, launcher="slurm", launch_max_workers=1).tick()
    assert [entry.job.id for entry in queues.waiting(client, queue_for(KEY))] == [job.id]
    # Launching paused by the operator: no worker will come, so the job ends saying why.
    client.set(launches.PAUSED, "1")
    _controller(client, app, embedded_settings, launcher="slurm", launch_max_workers=1).tick()
    assert queues.waiting(client, queue_for(KEY)) == []
    latest = json.loads(client.get(jobs.status_key(job.id)))
    assert latest["status"] == wire.ERROR and "Could not deploy controller/tiny" in latest["description"]


def test_without_a_launcher_a_model_no_worker_can_hold_fails_its_jobs_at_once(sized, app, embedded_settings):
    client = sized
    client.hset(registry.SIZES, f"{KEY}|", 8 * GiB)
    _worker(client, "w0", gib=1.0)
    job = _waiting(client, app, waited_s=0.0)
    _controller(client, app, embedded_settings).tick()
    assert json.loads(client.get(jobs.status_key(job.id)))["status"] == wire.ERROR
