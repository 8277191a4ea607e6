"""What the farm was asked to keep, beside what it runs: ``ndif-celery deployments``, ``export``.

A wish in ``ndif:desired`` comes from one of four places, its ``source``:
a deployments file (``file``: ``deploy -f``), the boot list (``boot``:
``NDIF_DEPLOYMENTS``), a hand deploy or scale (``cli``), or a scheduled
window pinning it now (``schedule``, with the wish it replaced as
``before``). A model loaded by a user's first request has no wish: it is
listed as ``request``, kept while it is used. Windows not open yet are
listed too (``scheduled``), so the view shows every wish the farm knows.

Each row says how many replicas the wish wants, how many run and load, and,
when the controller cannot keep it, why (``registry.UNMET``, written by the
leading controller; ``failed`` when no worker that could take it loaded it).
"""

from __future__ import annotations

import time
from typing import Optional

import redis

from ndif_celery import wire
from ndif_celery.policy import model_policy
from ndif_celery.state import launches, registry

from . import schedules
from .actions import model_key_for

MET, LOADING, UNMET, FAILED, SCHEDULED = "met", "loading", "unmet", "failed", "scheduled"
REQUEST = "request"  # loaded by a user's first request: no wish


def rows(client: redis.Redis, now: Optional[float] = None) -> list[dict]:
    """One row per wish, per model held without one, and per window not open yet."""
    now = time.time() if now is None else now
    wishes = registry.desired(client)
    why = registry.unmet(client)
    held: dict[str, list] = {}
    for entry in registry.live_deployments(client):
        held.setdefault(entry["model_key"], []).append(entry)
    coming = {launch["model_key"]: launch for launch in launches.alive(launches.read(client)) if not launch.get("worker")}
    out = []
    for model_key in sorted(set(wishes) | set(held), key=lambda key: (wire.repo_id(key), key)):
        wish = wishes.get(model_key)
        holders = held.get(model_key, [])
        running = sorted(h["worker"] for h in holders if h["state"] == registry.RUNNING)
        loading = sorted(h["worker"] for h in holders if h["state"] != registry.RUNNING)
        target = (wish or {}).get("replicas", 1) if wish else None
        unmet = why.get(model_key) if wish else None
        if wish is None:
            state = MET
        elif len(running) >= target:
            state = MET
        elif unmet and unmet.get("failed"):
            state = FAILED
        elif len(running) + len(loading) >= target:
            state = LOADING
        else:
            state = UNMET
        out.append({
            "model": wire.repo_id(model_key),
            "model_key": model_key,
            "source": _source(wish),
            "over": (wish.get("before") or {}).get("source") if wish and wish.get("schedule") else None,
            "pinned": bool((wish or {}).get("pinned")),
            "target": target,
            "running": running,
            "loading": loading,
            "state": state,
            "reason": _why_not(unmet if state in (UNMET, FAILED, LOADING) else None,
                               coming.get(model_key) if state in (UNMET, LOADING) else None),
            "since": (unmet or {}).get("at") if unmet and state != MET else None,
        })
    for window in schedules.entries(client, now):
        if window["state"] == schedules.PENDING:
            out.append({
                "model": window["repo"], "model_key": window["model_key"], "source": "schedule", "over": None,
                "pinned": True, "target": window.get("replicas", 1), "running": [], "loading": [],
                "state": SCHEDULED, "reason": f"from {schedules.iso(window['start'])} to {schedules.iso(window['end'])}",
                "since": None,
            })
    return out


def _why_not(unmet: Optional[dict], launch: Optional[dict]) -> Optional[str]:
    """The controller's reason, and the worker being launched for the model (``farm.elastic``)."""
    said = [unmet["reason"]] if unmet else []
    if launch is not None:
        waits = f" ({launch['reason']})" if launch.get("reason") else ""
        said.append(f"a worker is being launched: {launch['launcher']} job {launch['id']} is "
                    f"{launch['state'].lower()}{waits}")
    return "; ".join(said) or None


def _source(wish: Optional[dict]) -> str:
    if wish is None:
        return REQUEST
    if wish.get("schedule"):
        return "schedule"
    return wish.get("source") or "cli"


# --- export -----------------------------------------------------------------------


def export(client: redis.Redis) -> tuple[str, list[str]]:
    """The operators' wishes as a deployments file that ``deploy -f`` accepts as
    it is, and what it leaves out (and why). A schedule's pin is exported as the
    wish it replaced (the window itself stays a schedule); models loaded by a
    request are nobody's wish."""
    import yaml

    entries, skipped = [], []
    for model_key, wish in sorted(registry.desired(client).items(), key=lambda item: (wire.repo_id(item[0]), item[0])):
        if wish.get("schedule"):
            wish = wish.get("before")
            if not isinstance(wish, dict):
                skipped.append(f"{wire.repo_id(model_key)}: pinned by a schedule only")
                continue
        try:
            key = model_policy.parse(model_key)
        except model_policy.PolicyError as error:
            skipped.append(f"{wire.repo_id(model_key)}: {error.detail}")
            continue
        if key.cls != model_policy.TRANSFORMERS_MODEL or model_key_for(
                key.repo_id, task=key.task, revision=key.revision, dtype=key.held or None) != model_key:
            skipped.append(f"{key.repo_id}: its model class or options cannot be written in a deployments file")
            continue
        entry: dict = {"repo": key.repo_id}
        if key.revision:
            entry["revision"] = key.revision
        if key.task != "text-generation":
            entry["task"] = key.task
        if wish.get("dtype"):
            entry["dtype"] = wish["dtype"]
        if wish.get("replicas", 1) != 1:
            entry["replicas"] = wish["replicas"]
        if wish.get("pinned"):
            entry["pin"] = True
        if wish.get("users"):
            entry["users"] = list(wish["users"])
        entries.append(entry)
    header = "# ndif-celery export: the farm's wanted deployments (deploy -f FILE applies it)\n"
    if skipped:
        header += "".join(f"# left out: {line}\n" for line in skipped)
    body = yaml.safe_dump({"deployments": entries}, sort_keys=False, default_flow_style=False)
    return header + body, skipped
