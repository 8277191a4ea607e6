"""Unmeetable wishes refused at once (``ndif_celery.farm.capacity``), in the fast
tier: which live workers can hold a model (runtime, budget, pins), the words
of a refusal, several wishes side by side, a file refused whole before
anything is written, windows refused alone and beside the windows they
overlap; and two operator answers told right: ``kill`` of a job a worker took
but had not started, and ``queue`` leaving out an empty queue nobody serves.
The CLI doing it on a real farm is tests/e2e/farm/test_wanted.py.
"""

from __future__ import annotations

import datetime
import json
import re
import time
from types import SimpleNamespace

import pytest

from ndif_celery import statuses, wire
from ndif_celery.celery_app import make_app, queue_for
from ndif_celery.farm import actions
from ndif_celery.farm import capacity, deployments, schedules
from ndif_celery.farm.capacity import Demand
from ndif_celery.farm.placement import GiB, Holding, WorkerView
from ndif_celery.farm.schedules import ScheduleError
from ndif_celery.state import jobs, queues, registry

A, B, C = (actions.model_key_for(repo) for repo in ("org/a", "org/b", "org/c"))
RUNTIME_B = actions.model_key_for("org/b", nnsight="0.7.0")
PADDING = SimpleNamespace(padding_factor=0.0, padding_bytes=0)
NOW = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.timezone.utc).timestamp()
HOUR = 3600.0


def _scale_to(n: int) -> str:
    return f"scale to {n}"


# --- which workers can hold it, pure ------------------------------------------------


def test_a_worker_can_hold_a_model_of_its_runtime_that_fits_beside_its_pinned_models():
    views = [
        WorkerView("a", 4 * GiB),
        WorkerView("b", 4 * GiB, [Holding(C, 2 * GiB, pinned=False)]),  # unpinned: placement evicts it
        WorkerView("c", 4 * GiB, [Holding(C, 3 * GiB, pinned=True)]),  # pinned: only 1 GiB beside it
        WorkerView("d", 1 * GiB),
        WorkerView("e", 8 * GiB, nnsight="0.7.0"),
        WorkerView("f", 1 * GiB, [Holding(A, 1 * GiB, pinned=True)]),  # holds it already
    ]
    able, why = capacity.servers(Demand(A, 1, 2 * GiB), views)
    assert able == ["a", "b", "f"]
    assert why == {"c": "has 1 GiB beside its pinned models", "d": "has 1 GiB in all",
                   "e": "runs nnsight 0.7.0"}
    able, _ = capacity.servers(Demand(RUNTIME_B, 1, 2 * GiB, "0.7.0"), views)
    assert able == ["e"], "a runtime's deployment goes only to that runtime's workers"
    able, _ = capacity.servers(Demand(A, 1, None), views)
    assert able == ["a", "b", "c", "d", "f"], "size not at hand: every worker of its runtime counts"


def test_more_replicas_than_able_workers_is_refused_naming_them_and_the_fix():
    views = [WorkerView("w0", 4 * GiB), WorkerView("w1", 4 * GiB), WorkerView("small", GiB // 2)]
    assert capacity.shortfall(Demand(A, 2, GiB), views, _scale_to) is None
    said = capacity.shortfall(Demand(A, 3, GiB), views, _scale_to)
    assert said == ("3 replicas of org/a wanted but only 2 live workers can serve it (w0, w1) (it needs 1 GiB): "
                    "small has 512 MiB in all; start another worker or scale to 2")
    said = capacity.shortfall(Demand(A, 1, 8 * GiB), views, _scale_to)
    assert said.startswith("1 replica of org/a wanted but no live worker can serve it (it needs 8 GiB): "
                           "small has 512 MiB in all; w0 has 4 GiB in all; w1 has 4 GiB in all")
    assert said.endswith("start a worker that can hold it")
    said = capacity.shortfall(Demand(RUNTIME_B, 1, None, "0.7.0", "org/b"), views, _scale_to)
    assert "no live worker can serve it: small runs nnsight of the farm" in said
    assert said.endswith("start a worker of nnsight 0.7.0 (ndif-celery worker --nnsight 0.7.0)")
    assert capacity.shortfall(Demand(A, 1, GiB), [], _scale_to) == (
        "1 replica of org/a wanted but no worker is live; start one (ndif-celery worker)")


def test_wishes_that_each_fit_but_not_side_by_side_are_refused_together():
    views = [WorkerView("w0", 4 * GiB), WorkerView("w1", 4 * GiB)]
    fits = [Demand(A, 2, 2 * GiB), Demand(B, 2, 2 * GiB)]
    assert capacity.problems(fits, views, _scale_to) == []
    too_much = [Demand(A, 2, 3 * GiB), Demand(B, 1, 2 * GiB)]
    (said,) = capacity.problems(too_much, views, _scale_to)
    assert said.startswith("org/a (2 x 3 GiB), org/b (1 x 2 GiB) cannot all run at once: together they need "
                           "8 GiB and the live workers hold 8 GiB beside other pinned models (w0 4 GiB, w1 4 GiB); "
                           "no room is left for org/b"), said
    pinned_elsewhere = [WorkerView("w0", 4 * GiB, [Holding(C, 3 * GiB, pinned=True)]), WorkerView("w1", 4 * GiB)]
    assert capacity.problems([Demand(A, 1, 3 * GiB), Demand(B, 1, 3 * GiB)], pinned_elsewhere, _scale_to), \
        "a model pinned by another wish keeps its room"


# --- against a real Redis: the live workers as the controller sees them ----------------


@pytest.fixture
def app(embedded_settings):
    return make_app(embedded_settings)


def _worker(client, name: str, gib: float, *held: str, nnsight: str = "") -> None:
    registry.register_worker(client, {"name": name, "pid": 1, "memory_bytes": int(gib * GiB), "nnsight": nnsight})
    for key in held:
        registry.set_deployment(client, name, key, registry.RUNNING, size_bytes=GiB, last_used=time.time())


def _sized(client, *keys: str, gib: float = 1.0) -> None:
    """The farm's cache of sizes, as the controller writes it after sizing a model."""
    for key in keys:
        client.hset(registry.SIZES, f"{key}|", int(gib * GiB))


def _state(client) -> str:
    return json.dumps([registry.desired(client), sorted(client.lrange("ndif.worker.w0", 0, -1))], sort_keys=True)


def test_a_demand_is_sized_from_the_farms_cache_and_padded_as_the_controller_pads(redis_client):
    _sized(redis_client, A)
    padded = SimpleNamespace(padding_factor=0.5, padding_bytes=10)
    assert capacity.demand(redis_client, padded, A, 2).size_bytes == int(1.5 * GiB) + 10
    assert capacity.demand(redis_client, padded, actions.model_key_for("org/nowhere"), 1).size_bytes is None, \
        "not cached, not on this host: unknown, and the hub is not asked"


def test_check_refuses_on_the_live_workers_only(redis_client):
    _worker(redis_client, "w0", 4)
    _worker(redis_client, "w1", 4)
    redis_client.hset(registry.WORKERS, "gone", json.dumps({"name": "gone", "pid": 1, "memory_bytes": 4 * GiB,
                                                            "last_seen": time.time() - 60}))
    _sized(redis_client, A)
    capacity.check(redis_client, [capacity.demand(redis_client, PADDING, A, 2)], _scale_to)
    with pytest.raises(capacity.Unmeetable, match=r"3 replicas of org/a wanted but only 2 live workers can serve "
                                                  r"it \(w0, w1\).*; start another worker or scale to 2$"):
        capacity.check(redis_client, [capacity.demand(redis_client, PADDING, A, 3)], _scale_to)


def test_a_file_with_one_unmeetable_entry_is_refused_whole_before_anything_changes(redis_client, app):
    _worker(redis_client, "w0", 4, A)
    _worker(redis_client, "w1", 4)
    _sized(redis_client, A, B, C)
    deployments.apply(redis_client, deployments.parse("- repo: org/a\n"))
    before = _state(redis_client)
    entries = deployments.parse("- repo: org/b\n- repo: org/c\n  replicas: 3\n")
    plan = deployments.plan(redis_client, entries, sync=True)
    assert plan.evicted == [("org/a", A, ["w0"])]
    (said,) = deployments.capacity_problems(redis_client, PADDING, entries, plan)
    assert said.startswith("3 replicas of org/c wanted but only 2 live workers can serve it (w0, w1)")
    assert said.endswith("start another worker or set `replicas: 2`")
    assert _state(redis_client) == before, "checking changes nothing"
    good = deployments.parse("- repo: org/b\n- repo: org/c\n  replicas: 2\n")
    assert deployments.capacity_problems(redis_client, PADDING, good, deployments.plan(redis_client, good, True)) == []


def test_a_sync_writes_its_wishes_in_one_transaction_and_sends_evictions_after(redis_client, app):
    """A refusal (no celery app to send the evictions) comes before any write."""
    _worker(redis_client, "w0", 4, A)
    deployments.apply(redis_client, deployments.parse("- repo: org/a\n"))
    before = _state(redis_client)
    with pytest.raises(ValueError, match="needs the celery app"):
        deployments.apply(redis_client, deployments.parse("- repo: org/b\n"), sync=True)
    assert _state(redis_client) == before
    done = deployments.apply(redis_client, deployments.parse("- repo: org/b\n"), sync=True, celery_app=app)
    assert done.added == ["org/b"] and done.evicted == [("org/a", A, ["w0"])]
    assert set(registry.desired(redis_client)) == {B}


def test_the_pinned_room_of_a_model_the_sync_evicts_counts_as_free(redis_client):
    _worker(redis_client, "w0", 2, A)
    _sized(redis_client, A, B, gib=1.5)
    deployments.apply(redis_client, deployments.parse("- repo: org/a\n  pin: true\n"))
    entries = deployments.parse("- repo: org/b\n")
    assert deployments.capacity_problems(redis_client, PADDING, entries, deployments.plan(redis_client, entries))
    synced = deployments.plan(redis_client, entries, sync=True)
    assert deployments.capacity_problems(redis_client, PADDING, entries, synced) == []


# --- windows ------------------------------------------------------------------------------


def test_a_window_with_more_replicas_than_able_workers_is_refused(redis_client):
    _worker(redis_client, "w0", 4)
    _worker(redis_client, "w1", 4)
    _sized(redis_client, A)
    with pytest.raises(ScheduleError, match=r"the live workers cannot meet this window: 3 replicas of org/a wanted "
                                            r"but only 2 live workers can serve it \(w0, w1\).*ask for --replicas 2\. "
                                            r"Nothing was scheduled \(give --wait-for-workers"):
        schedules.add(redis_client, A, "org/a", NOW, NOW + HOUR, 3, now=NOW, settings=PADDING)
    assert schedules.entries(redis_client, NOW) == []
    schedules.add(redis_client, A, "org/a", NOW, NOW + HOUR, 3, now=NOW)  # --wait-for-workers: recorded
    assert len(schedules.entries(redis_client, NOW)) == 1


def test_overlapping_windows_beyond_capacity_are_refused_and_apart_they_are_not(redis_client):
    _worker(redis_client, "w0", 4)
    _worker(redis_client, "w1", 4)
    _sized(redis_client, A, B, C, gib=3)
    first = schedules.add(redis_client, A, "org/a", NOW + HOUR, NOW + 3 * HOUR, 2, now=NOW, settings=PADDING)
    with pytest.raises(ScheduleError) as refused:
        schedules.add(redis_client, B, "org/b", NOW + 2 * HOUR, NOW + 4 * HOUR, 1, now=NOW, settings=PADDING)
    said = str(refused.value)
    assert f"from {schedules.iso(NOW + 2 * HOUR)}, with the windows it overlaps: " in said
    assert f"org/b (1 x 3 GiB), org/a (window {first['id']}) (2 x 3 GiB) cannot all run at once" in said
    schedules.add(redis_client, B, "org/b", NOW + 3 * HOUR, NOW + 4 * HOUR, 1, now=NOW, settings=PADDING)
    # A later window of the same model takes the most replicas of the two, not their sum.
    schedules.add(redis_client, A, "org/a", NOW + 2 * HOUR, NOW + 3 * HOUR, 2, now=NOW, settings=PADDING)
    # A window opening inside the new one is looked at from its own start.
    opens = re.escape(f"from {schedules.iso(NOW + HOUR)}, with the windows it overlaps")
    with pytest.raises(ScheduleError, match=opens):
        schedules.add(redis_client, C, "org/c", NOW + 0.5 * HOUR, NOW + 1.5 * HOUR, 1, now=NOW, settings=PADDING)
    schedules.add(redis_client, C, "org/c", NOW + 0.5 * HOUR, NOW + HOUR, 2, now=NOW, settings=PADDING)


# --- kill and queue, told right ---------------------------------------------------------------


class _Replying:
    """A Celery app whose workers answer ``ndif_kill`` as ``answers`` say (the broadcast's replies)."""

    def __init__(self, answers: list) -> None:
        self.control = SimpleNamespace(broadcast=lambda *args, **kwargs: answers)


def test_kill_of_a_job_a_worker_took_but_had_not_started_says_so(redis_client):
    job = jobs.Job(id="taken-not-started", model_key=A, received_at=time.time())
    statuses.StatusChannel(redis_client, job, 60).send(wire.QUEUED, "queued")
    said = actions.kill(redis_client, _Replying([{"cpu@vm": {"ok": "cancelling"}}]), job.id, 60)
    assert said == "cancelled before it started: cpu@vm had taken it from the queue and skips it"
    running = jobs.Job(id="running", model_key=A, received_at=time.time())
    statuses.StatusChannel(redis_client, running, 60).send(wire.RUNNING, "running")
    assert actions.kill(redis_client, _Replying([{"cpu@vm": {"ok": "cancelling"}}]), running.id, 60) == \
        "cancelling on cpu@vm"


def test_queue_leaves_out_an_empty_queue_no_live_worker_serves(redis_client):
    for key in (A, B):
        redis_client.sadd(registry.QUEUES, queue_for(key))
        redis_client.hset(registry.QUEUE_MODELS, queue_for(key), key)
    _worker(redis_client, "w0", 4, B)
    rows = queues.summary(redis_client)
    assert [(row["model_key"], row["depth"]) for row in rows] == [(B, 0)], \
        "org/a's only job failed: nothing waits for it and nobody serves it"
