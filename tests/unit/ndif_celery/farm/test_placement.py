"""Placement rules, on the pure functions the controller uses."""

from __future__ import annotations

import pytest

from ndif_celery.farm.placement import CannotHold, Holding, NoRoom, WorkerView, place

MB = 1024**2


def worker(name, memory_mb, *holdings):
    return WorkerView(name, memory_mb * MB, list(holdings))


def held(key, size_mb, last_used=0.0, pinned=False, loading=False):
    return Holding(key, size_mb * MB, pinned=pinned, loading=loading, last_used=last_used)


def test_tightest_free_fit_wins_without_evicting():
    workers = [worker("big", 100), worker("small", 30), worker("tiny", 10)]
    assert place("m", 25 * MB, workers).worker == "small"
    assert place("m", 25 * MB, workers).evict == []


def test_least_recently_used_unpinned_is_evicted():
    workers = [worker("w", 30, held("old", 10, last_used=1), held("new", 10, last_used=5), held("pin", 10, pinned=True))]
    chosen = place("m", 10 * MB, workers)
    assert chosen.worker == "w" and chosen.evict == ["old"]


def test_prefers_fewer_evictions_then_older_ones():
    a = worker("a", 20, held("a1", 10, last_used=1), held("a2", 10, last_used=2))
    b = worker("b", 20, held("b1", 20, last_used=9))
    assert place("m", 20 * MB, [a, b]).evict == ["b1"]
    c = worker("c", 10, held("c1", 10, last_used=3))
    d = worker("d", 10, held("d1", 10, last_used=7))
    assert place("m", 10 * MB, [c, d]).evict == ["c1"]


def test_pinned_and_loading_models_are_never_evicted():
    workers = [worker("w", 20, held("pin", 10, pinned=True), held("busy", 10, loading=True))]
    with pytest.raises(NoRoom, match="full of pinned or still-loading"):
        place("m", 10 * MB, workers)


def test_too_big_for_every_worker_says_so():
    with pytest.raises(NoRoom, match="largest worker has 50 MiB"):
        place("m", 60 * MB, [worker("a", 50), worker("b", 40)])


def test_replicas_go_to_workers_without_the_model_and_can_forbid_eviction():
    workers = [worker("a", 20, held("m", 10)), worker("b", 20, held("x", 15))]
    with pytest.raises(NoRoom):
        place("m", 10 * MB, workers, evict=False)
    assert place("m", 10 * MB, workers).worker == "b"
    with pytest.raises(NoRoom, match="no live worker"):
        place("m", 10 * MB, [worker("a", 20, held("m", 10))])


def test_a_format_a_worker_refuses_goes_to_one_that_can_hold_it():
    reason = 'dtype="fp8" needs a GPU of compute capability 8.9 or better'
    cpu = WorkerView("cpu", 100 * MB, refused_formats={"fp8": reason})
    gpu = WorkerView("h100", 10 * MB)
    assert place("m", 5 * MB, [cpu, gpu], held="fp8").worker == "h100"
    assert place("m", 5 * MB, [cpu, gpu], held="nf4").worker == "h100"  # the tightest fit, as any model
    with pytest.raises(CannotHold) as caught:
        place("m", 5 * MB, [cpu], held="fp8")
    assert reason in str(caught.value) and "as fp8" in str(caught.value)
