"""Whether the live workers can meet a wish, checked before it is recorded.

The controller learns at its first look that a wish cannot be kept (more
replicas than workers that could hold the model). Without this check a
``deploy`` or ``scale`` would find out only at its ``--timeout``, a file's
``--sync`` only after its evictions, a schedule only when its window opens.
So ``deploy``, ``scale``, ``deploy -f`` and ``schedule add`` ask here first
and refuse at once, naming why and what to do.

A live worker *can hold* a replica of a model when it runs the model's
runtime (``placement.place``) and its whole budget, less the models pinned on
it by other wishes (never evicted), fits the model's padded size; a worker
already holding it counts. Unpinned models, loaded by requests or not, are
not counted: placement evicts them. Several wishes together (a file's
entries, overlapping windows) must also fit side by side: each replica on a
worker of its own, packed greedily, largest first. When a model's size is not
at hand (not in the farm's cache of sizes, not on this host's disk) only the
runtime and the count of workers are checked: the hub is never asked.

A wish refused here may be met later (a worker is starting): the commands
take ``--wait-for-workers`` to record it anyway and wait, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import redis

from ndif_celery import wire
from ndif_celery.policy import client_versions
from ndif_celery.policy import model_policy
from ndif_celery.state import registry

from . import sizing
from .actions import FarmError
from .placement import WorkerView, _gib, views_of


class Unmeetable(FarmError):
    """The live workers cannot meet the wish; the message says why and what to do."""


@dataclass(frozen=True)
class Demand:
    """Replicas of one model that must run at the same time."""

    model_key: str
    replicas: int
    size_bytes: Optional[int] = None  # padded; None: not at hand (only runtime and count are checked)
    nnsight: str = ""  # the runtime whose workers may hold it ("" the farm's own)
    label: str = ""  # how an error names it (default: its repo)

    @property
    def name(self) -> str:
        return self.label or wire.repo_id(self.model_key)


def demand(client: redis.Redis, settings, model_key: str, replicas: int, dtype: Optional[str] = None,
           label: str = "") -> Demand:
    """A demand sized as the controller would size it (padded), from what is at hand."""
    weights = sizing.known_weight_bytes(model_key, dtype, client)
    size = None if weights is None else sizing.padded(weights, settings.padding_factor, settings.padding_bytes)
    try:
        runtime = model_policy.parse(model_key).nnsight
    except model_policy.PolicyError:
        runtime = ""
    return Demand(model_key, replicas, size, runtime, label)


def live_views(client: redis.Redis, wishes: Optional[dict] = None) -> list[WorkerView]:
    """The live workers as the controller's placement sees them."""
    workers = registry.live_workers(client)
    by_worker: dict = {}
    for entry in registry.live_deployments(client, workers):
        by_worker.setdefault(entry["worker"], {})[entry["model_key"]] = entry
    wishes = registry.desired(client) if wishes is None else wishes
    return views_of(workers, by_worker, wishes, lambda info: client_versions.as_runtime(info.get("nnsight", "")))


# --- pure checks ------------------------------------------------------------------


def _room(worker: WorkerView, keep: set) -> int:
    """Budget left on ``worker`` once the models pinned there (other than ``keep``) stay."""
    return worker.memory_bytes - sum(h.size_bytes for h in worker.holdings if h.pinned and h.model_key not in keep)


def servers(need: Demand, views: list[WorkerView]) -> tuple[list[str], dict[str, str]]:
    """The live workers that can hold a replica of ``need``, and why each other one cannot."""
    able, why = [], {}
    for worker in views:
        if worker.nnsight != need.nnsight:
            why[worker.name] = f"runs nnsight {worker.nnsight or 'of the farm'}"
        elif worker.holds(need.model_key) or need.size_bytes is None:
            able.append(worker.name)
        elif worker.memory_bytes < need.size_bytes:
            why[worker.name] = f"has {_gib(worker.memory_bytes)} in all"
        elif _room(worker, {need.model_key}) < need.size_bytes:
            why[worker.name] = f"has {_gib(_room(worker, {need.model_key}))} beside its pinned models"
        else:
            able.append(worker.name)
    return sorted(able), why


def shortfall(need: Demand, views: list[WorkerView], fix: Callable[[int], str]) -> Optional[str]:
    """Why ``need`` cannot be met by ``views``, or None. ``fix(n)`` words the
    operator's way down to ``n`` replicas (``scale to 2``, ``set `replicas: 2```)."""
    able, why = servers(need, views)
    if len(able) >= need.replicas:
        return None
    wanted = f"{need.replicas} replica{'s' if need.replicas != 1 else ''} of {need.name} wanted"
    if not views:
        return f"{wanted} but no worker is live; start one (ndif-celery worker)"
    size = f" (it needs {_gib(need.size_bytes)})" if need.size_bytes is not None else ""
    others = "; ".join(f"{name} {reason}" for name, reason in sorted(why.items()))
    if not able:
        start = (f"start a worker of nnsight {need.nnsight} (ndif-celery worker --nnsight {need.nnsight})"
                 if need.nnsight else "start a worker that can hold it")
        return f"{wanted} but no live worker can serve it{size}: {others}; {start}"
    return (f"{wanted} but only {len(able)} live worker{'s' if len(able) != 1 else ''} can serve it "
            f"({', '.join(able)}){size}{': ' + others if others else ''}; start another worker or {fix(len(able))}")


def together(needs: list[Demand], views: list[WorkerView]) -> Optional[str]:
    """Why ``needs`` cannot all run at once on ``views`` (each alone can), or None.
    Greedy: the largest model first, each replica on the worker with the most
    room left that it is not on yet (one already holding it first)."""
    sized = [need for need in needs if need.size_bytes is not None]
    if len(sized) < 2:
        return None
    keep = {need.model_key for need in sized}
    room = {worker.name: _room(worker, keep) for worker in views}
    for need in sorted(sized, key=lambda n: (-n.size_bytes, n.name)):
        used: set = set()
        for _ in range(need.replicas):
            fitting = [worker for worker in views
                       if worker.nnsight == need.nnsight and worker.name not in used
                       and room[worker.name] >= need.size_bytes]
            if not fitting:
                total = sum(n.size_bytes * n.replicas for n in sized)
                names = ", ".join(f"{n.name} ({n.replicas} x {_gib(n.size_bytes)})" for n in sized)
                return (f"{names} cannot all run at once: together they need {_gib(total)} and the live "
                        f"workers hold {_gib(sum(_room(w, keep) for w in views))} beside other pinned models "
                        f"({', '.join(f'{w.name} {_gib(_room(w, keep))}' for w in views)}); "
                        f"no room is left for {need.name}; start another worker or ask for fewer replicas")
            best = max(fitting, key=lambda w: (w.holds(need.model_key), room[w.name], w.name))
            used.add(best.name)
            room[best.name] -= need.size_bytes
    return None


def problems(needs: list[Demand], views: list[WorkerView], fix: Callable[[int], str]) -> list[str]:
    """Every reason ``needs`` cannot be met now: each one alone, then all at once."""
    alone = [why for why in (shortfall(need, views, fix) for need in needs) if why]
    if alone:
        return alone
    both = together(needs, views)
    return [both] if both else []


def check(client: redis.Redis, needs: list[Demand], fix: Callable[[int], str]) -> None:
    """Raise :class:`Unmeetable` when the live workers cannot meet ``needs``."""
    found = problems(needs, live_views(client), fix)
    if found:
        raise Unmeetable("; ".join(found))


def scale_to(n: int) -> str:
    return f"scale to {n}"
