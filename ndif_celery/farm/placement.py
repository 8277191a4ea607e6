"""Where a model should go: best fit, evicting least-recently-used models if needed.

Pure functions over the farm's picture (no Redis, no torch), so every rule is
easy to read and to test:

- a worker whose whole budget is smaller than the model can never take it;
- a worker with enough free memory takes it without evicting anything, and
  among those the tightest fit wins (big holes stay free for big models);
- otherwise a worker may evict its unpinned, fully loaded models, least
  recently used first; the placement that evicts fewest models, and among
  those the least recently used ones, wins;
- pinned models are never evicted, nor models still loading;
- some placements (extra replicas, restoring an unpinned deployment) may only
  use free room, so two models never take turns evicting each other;
- a runtime's deployment (another nnsight) goes only to that runtime's workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

GiB = 1024**3


@dataclass
class Holding:
    model_key: str
    size_bytes: int
    pinned: bool = False
    loading: bool = False
    last_used: float = 0.0


@dataclass
class WorkerView:
    name: str
    memory_bytes: int
    holdings: list[Holding] = field(default_factory=list)
    nnsight: str = ""  # the runtime it runs ("" the farm's own nnsight): it loads only that runtime's models
    refused_formats: dict = field(default_factory=dict)  # quantization -> nnsight's reason it cannot hold it

    @property
    def used_bytes(self) -> int:
        return sum(h.size_bytes for h in self.holdings)

    @property
    def free_bytes(self) -> int:
        return self.memory_bytes - self.used_bytes

    def holds(self, model_key: str) -> bool:
        return any(h.model_key == model_key for h in self.holdings)


def views_of(workers: dict, by_worker: dict, wishes: dict,
             runtime_of=lambda info: info.get("nnsight", "")) -> list[WorkerView]:
    """The placement view of live ``workers`` (name -> registry entry) holding
    ``by_worker`` (name -> model key -> deployment entry); a holding is pinned
    when its wish is. The controller places with it, and an operator's command
    checks capacity with the same picture."""
    views = []
    for name, info in workers.items():
        holdings = [
            Holding(
                model_key=key,
                size_bytes=entry.get("size_bytes", 0),
                pinned=bool(wishes.get(key, {}).get("pinned")),
                loading=entry["state"] != "RUNNING",
                last_used=last_activity(entry),
            )
            for key, entry in by_worker.get(name, {}).items()
        ]
        views.append(WorkerView(name, info.get("memory_bytes", 0), holdings, runtime_of(info),
                                info.get("refused_formats") or {}))
    return views


def last_activity(entry: dict) -> float:
    return entry.get("last_used") or entry.get("loaded_at") or entry.get("created_at") or 0.0


@dataclass
class Placement:
    worker: str
    evict: list[str]


class NoRoom(Exception):
    """No worker can take the model; the message says why, for the user."""


class CannotHold(NoRoom):
    """No live worker can hold the model in its format (nnsight said why): more room would not help."""


def place(model_key: str, size_bytes: int, workers: Iterable[WorkerView], evict: bool = True,
          nnsight: str = "", held: str = "") -> Placement:
    """The best worker of runtime ``nnsight`` for the model; with ``evict=False`` only free room counts.
    ``held``: a quantized model's format, placed only on workers that can hold it."""
    workers = [w for w in workers if w.nnsight == nnsight]
    if not workers and nnsight:
        raise NoRoom(f"no live worker runs nnsight {nnsight} (start one: ndif-celery worker --nnsight {nnsight})")
    able = [w for w in workers if held not in w.refused_formats]
    if workers and not able:
        raise CannotHold(f"no live worker can hold it as {held}: {workers[0].refused_formats[held]}")
    workers = able
    workers = [w for w in workers if not w.holds(model_key)]
    if not workers:
        raise NoRoom("no live worker can take another replica of it")
    options = []
    for worker in workers:
        if worker.memory_bytes < size_bytes:
            continue
        evicted = _evictions(worker, size_bytes) if evict else ([] if worker.free_bytes >= size_bytes else None)
        if evicted is None:
            continue
        newest_evicted = max((h.last_used for h in evicted), default=0.0)
        leftover = worker.free_bytes + sum(h.size_bytes for h in evicted) - size_bytes
        options.append(((len(evicted), newest_evicted, leftover, worker.name), worker.name, evicted))
    if not options:
        raise NoRoom(_why_not(size_bytes, workers))
    _, name, evicted = min(options, key=lambda option: option[0])
    return Placement(worker=name, evict=[h.model_key for h in evicted])


def _evictions(worker: WorkerView, size_bytes: int) -> Optional[list[Holding]]:
    """The least-recently-used models to evict so ``size_bytes`` fits, or None."""
    free = worker.free_bytes
    chosen: list[Holding] = []
    candidates = sorted((h for h in worker.holdings if not h.pinned and not h.loading), key=lambda h: h.last_used)
    for holding in candidates:
        if free >= size_bytes:
            break
        chosen.append(holding)
        free += holding.size_bytes
    return chosen if free >= size_bytes else None


def _why_not(size_bytes: int, workers: list[WorkerView]) -> str:
    largest = max(w.memory_bytes for w in workers)
    if size_bytes > largest:
        return (
            f"it needs {_gib(size_bytes)} (weights plus padding) but the largest worker "
            f"has {_gib(largest)} in all"
        )
    return (
        f"it needs {_gib(size_bytes)} and every worker large enough is full of pinned "
        "or still-loading models"
    )


def _gib(n: int) -> str:
    return f"{n / GiB:.3g} GiB" if n >= GiB else f"{n / 1024**2:.3g} MiB"
