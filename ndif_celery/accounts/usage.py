"""Usage: what each key and each model cost, from the job ledger.

``ndif-celery usage [--since] [--key/--email] [--json]`` and the admin
dashboard read :func:`report`: per key and per model, the jobs that ended,
how many with an error, GPU-seconds (each job's run time, deserialize and
execute, times the GPUs of the worker that ran it: the ledger's ``devices``,
0 on a CPU worker), run-seconds (the same without the GPUs, what a CPU farm
spends), and bytes in (request payloads) and out (results).

``/metrics`` carries the same per key as counters (:func:`count`, in the
ledger's drain, once per job written; :func:`series` reads them): the
:data:`top <NDIF_USAGE_TOP_KEYS>` keys by GPU-seconds, then run-seconds, by
their owner label (``key:<id>``, ``anonymous``: no emails in metrics), and the
rest summed as ``other``, so the series stay bounded however many keys the
farm has. A key that moves into the top N leaves ``other``, whose counters
then drop: read them per key, not as rates of ``other``.

The health probes' jobs (rows marked ``probe``, see ``ledger``) are left out
of the report unless asked for: they would outnumber the users'. The
counters of ``/metrics`` keep them, under the probe key's label.

- hash ``ndif:usage``  "<owner>|<field>" -> total, fields :data:`FIELDS`
"""

from __future__ import annotations

import datetime
from typing import Optional

import redis

USAGE = "ndif:usage"
FIELDS = ("jobs", "errors", "gpu_seconds", "run_seconds", "bytes_in", "bytes_out")
OTHER = "other"


def job_costs(entry: dict) -> dict:
    """One ledger summary's share of each field."""
    run_s = (entry.get("run_ms") or 0) / 1000.0
    return {
        "jobs": 1,
        "errors": 1 if entry.get("outcome") == "ERROR" else 0,
        "gpu_seconds": run_s * (entry.get("devices") or 0),
        "run_seconds": run_s,
        "bytes_in": entry.get("payload_bytes") or 0,
        "bytes_out": entry.get("result_bytes") or 0,
    }


def count(pipe, entries: list[dict]) -> None:
    """Add ``entries`` (ledger summaries just written) to the per-key counters, in ``pipe``."""
    for entry in entries:
        owner = str(entry.get("owner") or "anonymous")[:64]
        for name, value in job_costs(entry).items():
            if value:
                pipe.hincrbyfloat(USAGE, f"{owner}|{name}", value)


def series(client: redis.Redis, top_n: int) -> dict:
    """owner label -> {field: total}: the ``top_n`` keys by GPU-seconds then
    run-seconds, the rest summed as :data:`OTHER` (present only when there is a rest)."""
    per_owner: dict[str, dict] = {}
    for raw_field, value in client.hgetall(USAGE).items():
        owner, _, name = raw_field.decode(errors="replace").rpartition("|")
        if name in FIELDS and owner:
            per_owner.setdefault(owner, dict.fromkeys(FIELDS, 0.0))[name] = float(value)
    ranked = sorted(per_owner, key=lambda o: (-per_owner[o]["gpu_seconds"], -per_owner[o]["run_seconds"], o))
    shown = {owner: per_owner[owner] for owner in ranked[:max(0, top_n)]}
    rest = ranked[max(0, top_n):]
    if rest:
        shown[OTHER] = {name: sum(per_owner[o][name] for o in rest) for name in FIELDS}
    return shown


def report(engine, since: Optional[datetime.datetime] = None, owner: Optional[str] = None,
           email: Optional[str] = None, probes: bool = False) -> dict:
    """``{"since", "keys": [...], "models": [...], "total": {...}}`` from the ledger:
    rows per key (owner and email) and per model, largest GPU-seconds first;
    the health probes' jobs only with ``probes``."""
    from sqlalchemy import case, func, select
    from sqlalchemy.orm import Session

    from .db import LedgerEntry

    run_s = func.coalesce(LedgerEntry.run_ms, 0) / 1000.0
    measures = (
        func.count().label("jobs"),
        func.sum(case((LedgerEntry.outcome == "ERROR", 1), else_=0)).label("errors"),
        func.sum(run_s * func.coalesce(LedgerEntry.devices, 0)).label("gpu_seconds"),
        func.sum(run_s).label("run_seconds"),
        func.sum(func.coalesce(LedgerEntry.payload_bytes, 0)).label("bytes_in"),
        func.sum(func.coalesce(LedgerEntry.result_bytes, 0)).label("bytes_out"),
    )
    where = []
    if since is not None:
        where.append(LedgerEntry.finished_at >= since.astimezone(datetime.timezone.utc))
    if owner is not None:
        where.append(LedgerEntry.owner == owner)
    if email is not None:
        where.append(func.lower(LedgerEntry.email) == email.lower())
    if not probes:
        where.append(LedgerEntry.probe.is_not(True))

    def rows(*groups) -> list[dict]:
        query = select(*groups, *measures).where(*where).group_by(*groups)
        with Session(engine) as session:
            return [_clean(row._asdict()) for row in session.execute(query)]

    keys = rows(LedgerEntry.owner, LedgerEntry.email)
    models = per_deployment(rows(LedgerEntry.model, LedgerEntry.model_key))
    for listing in (keys, models):
        listing.sort(key=lambda r: (-r["gpu_seconds"], -r["run_seconds"], -r["jobs"], str(r.get("owner") or r.get("model"))))
    total = {name: sum(row[name] for row in keys) for name in FIELDS}
    total = _clean(total)
    return {"since": since.isoformat() if since else None, "keys": keys, "models": models, "total": total}


def per_deployment(rows: list[dict]) -> list[dict]:
    """Rows per model key summed per repo and nnsight runtime: a runtime's deployment
    of a model is a row of its own, not added to the farm's own."""
    from ndif_celery.policy import model_policy

    out: dict[tuple, dict] = {}
    for row in rows:
        nnsight = model_policy.runtime_of(row.pop("model_key") or "")
        into = out.setdefault((row["model"], nnsight), {"model": row["model"], "nnsight": nnsight,
                                                        **{name: 0 for name in FIELDS}})
        for name in FIELDS:
            into[name] += row[name] or 0
    return [_clean(row) for row in out.values()]


def _clean(row: dict) -> dict:
    """Integers where counts and bytes, seconds rounded to the millisecond."""
    out = dict(row)
    for name in ("jobs", "errors", "bytes_in", "bytes_out"):
        out[name] = int(out.get(name) or 0)
    for name in ("gpu_seconds", "run_seconds"):
        out[name] = round(float(out.get(name) or 0.0), 3)
    return out
