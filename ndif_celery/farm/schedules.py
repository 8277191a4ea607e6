"""Scheduled pins: a model pinned for a window (a course, a workshop, a paper deadline).

``ndif-celery schedule add MODEL --from ... --to ...`` stores a window in the
Redis hash ``ndif:schedules`` (id -> JSON {id, model_key, repo, start, end,
replicas, created_at}, epoch seconds). The farm controller calls
:func:`reconcile` every tick: while a window is open, the model's wish in
``ndif:desired`` is pinned (``schedule``: the open windows' ids; ``before``:
the wish it replaced, or None), so the controller loads it and never evicts
it, and ``/status`` shows it pinned; when the last window on it closes, the
wish it replaced comes back, or, when there was none, the wish goes and the
controller evicts the model. A window that ended stays listed (``ended``) for
:data:`KEEP_ENDED_S`.

An operator command that rewrites the wish meanwhile (``deploy``, ``deploy
-f``) becomes the new ``before``: the next tick pins it again until the window
closes. Times are UTC; a window is at most :data:`MAX_WINDOW_S` long and
there are at most :data:`MAX_SCHEDULES`.
"""

from __future__ import annotations

import datetime
import json
import re
import time
import uuid
from typing import Optional

import redis

from ndif_celery import wire
from ndif_celery.state import registry

SCHEDULES = "ndif:schedules"
MAX_SCHEDULES = 1000
MAX_WINDOW_S = 366 * 86400
KEEP_ENDED_S = 86400
PENDING, ACTIVE, ENDED = "pending", "active", "ended"

_SPAN = re.compile(r"^\+\s*(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class ScheduleError(ValueError):
    """A window that cannot be scheduled; the message says why."""


def parse_when(text: str, now: Optional[float] = None, option: str = "--from") -> float:
    """``now``, ``+30s``/``+15m``/``+2h``/``+1d``/``+1w`` from now, or an ISO date/time (UTC unless it says)."""
    now = time.time() if now is None else now
    value = (text or "").strip()
    if value == "now":
        return now
    match = _SPAN.match(value)
    if match:
        return now + float(match.group(1)) * _UNIT_S[match.group(2)]
    try:
        when = datetime.datetime.fromisoformat(value)
    except ValueError:
        raise ScheduleError(f"{option} must be now, +<n><s|m|h|d|w> (e.g. +2h) or an ISO date/time "
                            f"(2026-12-02T09:00), got {text[:60]!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when.timestamp()


def check_window(start: float, end: float, now: Optional[float] = None) -> None:
    now = time.time() if now is None else now
    if end <= start:
        raise ScheduleError(f"the window ends ({iso(end)}) before it starts ({iso(start)})")
    if end <= now:
        raise ScheduleError(f"the window ended already ({iso(end)}; now {iso(now)})")
    if end - start > MAX_WINDOW_S:
        raise ScheduleError(f"the window is {(end - start) / 86400:.0f} days long; at most "
                            f"{MAX_WINDOW_S // 86400} (pin the model with `ndif-celery deploy --pin` instead)")


def iso(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).isoformat(timespec="seconds")


def state(entry: dict, now: Optional[float] = None) -> str:
    now = time.time() if now is None else now
    if now < entry["start"]:
        return PENDING
    return ACTIVE if now < entry["end"] else ENDED


def add(client: redis.Redis, model_key: str, repo: str, start: float, end: float, replicas: int = 1,
        now: Optional[float] = None, settings=None) -> dict:
    """Store a window (checked); wake the controller. Returns the entry.
    ``settings``: also refuse a window the live workers cannot meet
    (:func:`capacity_problems`); None records it anyway (``--wait-for-workers``)."""
    check_window(start, end, now)
    if not 1 <= replicas <= 64:
        raise ScheduleError(f"--replicas must be from 1 to 64, got {replicas}")
    if settings is not None:
        found = capacity_problems(client, settings, model_key, repo, start, end, replicas, now)
        if found:
            raise ScheduleError(f"the live workers cannot meet this window: {'; '.join(found)}. Nothing was "
                                "scheduled (give --wait-for-workers if workers will be started before it opens).")
    if client.hlen(SCHEDULES) >= MAX_SCHEDULES:
        raise ScheduleError(f"{MAX_SCHEDULES} schedules are stored already; remove some (`ndif-celery schedule remove`)")
    entry = {"id": uuid.uuid4().hex[:8], "model_key": model_key, "repo": repo, "start": start, "end": end,
             "replicas": replicas, "created_at": time.time() if now is None else now}
    client.hset(SCHEDULES, entry["id"], json.dumps(entry))
    registry.wake_controller(client, "schedule")
    return entry


def capacity_problems(client: redis.Redis, settings, model_key: str, repo: str, start: float, end: float,
                      replicas: int, now: Optional[float] = None) -> list[str]:
    """Why the live workers cannot keep the window's pins beside every window it
    overlaps, at any moment of it; [] if they can. Pins never yield, so windows
    of other models that are open at once must fit side by side (windows on the
    same model take the most replicas of them, as :func:`reconcile` pins it).
    The moments to look at are its start and each start of another window
    inside it: only there does the set of open windows grow."""
    from . import capacity

    now = time.time() if now is None else now
    new = {"id": "", "model_key": model_key, "repo": repo, "start": start, "end": end, "replicas": replicas}
    others = [entry for entry in entries(client, now)
              if entry["state"] != ENDED and entry["start"] < end and entry["end"] > max(start, now)]
    wishes = registry.desired(client)
    # A schedule's pin now is its window's, counted as a window; the wish under it is what stays.
    lasting = {key: (wish.get("before") if wish.get("schedule") else wish) or {} for key, wish in wishes.items()}
    views = capacity.live_views(client, lasting)
    moments = sorted({max(start, now)} | {entry["start"] for entry in others if start < entry["start"] < end})
    fix = lambda n: f"ask for --replicas {n}"  # noqa: E731 - the refusal's advice
    sized = {model_key: capacity.demand(client, settings, model_key, 1, lasting.get(model_key, {}).get("dtype"))}
    alone = capacity.shortfall(capacity.Demand(model_key, replicas, sized[model_key].size_bytes,
                                               sized[model_key].nnsight), views, fix)
    if alone:
        return [alone]  # the window itself, whatever it overlaps
    for moment in moments:
        open_now = [new] + [entry for entry in others if entry["start"] <= moment < entry["end"]]
        wanted: dict = {}
        for entry in open_now:
            wanted.setdefault(entry["model_key"], []).append(entry)
        needs = []
        for key, windows in wanted.items():
            count = max([w["replicas"] for w in windows] + [lasting.get(key, {}).get("replicas", 1)])
            if key not in sized:
                sized[key] = capacity.demand(client, settings, key, 1, lasting.get(key, {}).get("dtype"))
            ids = ", ".join(w["id"] for w in windows if w["id"])
            mine = "this window and " if key == model_key else ""
            label = wire.repo_id(key) + (f" ({mine}window {ids})" if ids else "")
            needs.append(capacity.Demand(key, count, sized[key].size_bytes, sized[key].nnsight, label))
        found = capacity.problems(needs, views, fix)
        if found:
            when = "" if len(needs) == 1 else f"from {iso(moment)}, with the windows it overlaps: "
            return [when + why for why in found]
    return []


def remove(client: redis.Redis, schedule_id: str) -> Optional[dict]:
    """Forget a window (an open one closes at the controller's next tick); the entry, or None."""
    raw = client.hget(SCHEDULES, schedule_id[:64])
    if raw is None:
        return None
    client.hdel(SCHEDULES, schedule_id[:64])
    registry.wake_controller(client, "schedule")
    return json.loads(raw)


def entries(client: redis.Redis, now: Optional[float] = None) -> list[dict]:
    """Every stored window, soonest first, each with its ``state``."""
    now = time.time() if now is None else now
    rows = []
    for raw in client.hvals(SCHEDULES):
        try:
            entry = json.loads(raw)
            rows.append({**entry, "state": state(entry, now)})
        except (ValueError, KeyError, TypeError):
            continue
    return sorted(rows, key=lambda e: (e["start"], e["id"]))


def reconcile(client: redis.Redis, now: Optional[float] = None) -> list[str]:
    """Pin the models whose windows are open; restore (or drop) the wishes of
    those whose last window closed. Returns the model keys to evict now: the
    ones no wish keeps once their window closed. Also forgets windows ended
    more than :data:`KEEP_ENDED_S` ago."""
    now = time.time() if now is None else now
    open_windows: dict[str, list] = {}
    stale = []
    for entry in entries(client, now):
        if entry["state"] == ACTIVE:
            open_windows.setdefault(entry["model_key"], []).append(entry)
        elif entry["state"] == ENDED and now - entry["end"] > KEEP_ENDED_S:
            stale.append(entry["id"])
    wishes = registry.desired(client)
    released = []
    pipe = client.pipeline()
    for model_key, windows in open_windows.items():
        ids = sorted(w["id"] for w in windows)
        wish = wishes.get(model_key)
        before = wish.get("before") if wish and wish.get("schedule") else wish
        replicas = max([w["replicas"] for w in windows] + [(before or {}).get("replicas", 1)])
        pinned = {"pinned": True, "replicas": replicas, "dtype": (before or {}).get("dtype"),
                  "source": "schedule", "schedule": ids, "before": before}
        if (before or {}).get("users"):
            pinned["users"] = before["users"]
        if pinned != wish:
            pipe.hset(registry.DESIRED, model_key, json.dumps(pinned))
    for model_key, wish in wishes.items():
        if wish.get("schedule") and model_key not in open_windows:
            if wish.get("before"):
                pipe.hset(registry.DESIRED, model_key, json.dumps(wish["before"]))
            else:
                pipe.hdel(registry.DESIRED, model_key)
                released.append(model_key)
    if stale:
        pipe.hdel(SCHEDULES, *stale)
    pipe.execute()
    return released
