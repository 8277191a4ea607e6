"""``GET /dashboard``: one HTML page for people, drawn from ``templates/dashboard.html``.

It reads the farm from Redis (``ndif_celery.monitoring.metrics``, ``registry``,
``queues``, the health probes' results and the scheduled pins) and the recent
jobs and usage from the ledger (``ndif_celery.accounts.ledger_queries``, ``usage``); no
torch, no build step. The template escapes every value it is given (Flask
autoescapes ``.html``): only the server's own markup (the SVG charts from
``web.charts``) is passed as ``Markup``.

With ``NDIF_AUTH=1`` the dashboard wants HTTP Basic credentials whose password
is an API key tagged ``admin`` (``ndif-celery keys create --admin``): without
one it answers 401 with a ``WWW-Authenticate`` challenge, so a browser asks;
a key without the tag gets 403.
"""

from __future__ import annotations

import datetime
import logging
import time

import redis
from flask import Blueprint, Response, current_app, render_template, request

from ndif_celery import messages, wire
from ndif_celery.accounts import audit, ledger_queries, usage
from ndif_celery.farm import schedules, wanted
from ndif_celery.monitoring import history, metrics, probes
from ndif_celery.state import queues, registry, run_times

from . import admin, charts, operators

bp = Blueprint("monitoring", __name__)
log = logging.getLogger("ndif_celery.web")

REFRESH_S = 5
AUDIT_ROWS = 20
RECENT_JOBS = 50
USAGE_DAYS = 7


def _settings():
    return current_app.config["NDIF_SETTINGS"]


def _redis() -> redis.Redis:
    return current_app.config["NDIF_REDIS"]


def recent_jobs(client: redis.Redis, limit: int = RECENT_JOBS, probes: bool = False) -> tuple[list[dict], str]:
    """The newest ended jobs (waiting in Redis first, then the database), and
    a note when the database could not be read. The health probes' jobs only
    with ``probes`` (``?probes=1``): a probe every few seconds buries the users'."""
    rows = {row["job_id"]: row for row in ledger_queries.waiting(client, limit, probes=probes)}
    note = ""
    try:
        for row in ledger_queries.recent(operators.ledger_engine(), limit=limit, probes=probes):
            rows.setdefault(row["job_id"], row)
    except Exception as error:  # noqa: BLE001 - the page still shows the rest
        current_app.config.pop("NDIF_LEDGER_ENGINE", None)
        log.warning("dashboard: ledger database unreachable: %s", error)
        note = f"The ledger database cannot be read ({type(error).__name__}); showing jobs still waiting in Redis."
    ordered = sorted(rows.values(), key=lambda row: row.get("finished_at") or "", reverse=True)
    return ordered[:limit], note


def usage_table() -> tuple[list[dict], str]:
    """Usage per key over the last USAGE_DAYS days (``ndif_celery.accounts.usage``), and a note when the database could not be read."""
    since = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=USAGE_DAYS)
    try:
        report = usage.report(operators.ledger_engine(), since=since)
    except Exception as error:  # noqa: BLE001 - the page still shows the rest
        current_app.config.pop("NDIF_LEDGER_ENGINE", None)
        return [], f"The ledger database cannot be read ({type(error).__name__})."
    return [{
        "user": row.get("email") or row["owner"], "owner": row["owner"], "jobs": row["jobs"], "errors": row["errors"],
        "gpu_seconds": f"{row['gpu_seconds']:.3f}", "run_seconds": f"{row['run_seconds']:.3f}",
        "bytes_in": row["bytes_in"], "bytes_out": row["bytes_out"],
    } for row in report["keys"]], ""


def _mib(n) -> str:
    n = n or 0
    return f"{n / 1024 ** 3:.1f} GiB" if n >= 1024 ** 3 else f"{n / 1024 ** 2:.1f} MiB"


def _last_starts(client, row: dict, offer: registry.Offer) -> str:
    """When the last job in a queue starts, as its client is told (``state.run_times``)."""
    if not row["depth"] or not row["model_key"]:
        return "-"
    model_key = row["model_key"]
    per_job = run_times.per_job_s(client.lrange(run_times.key(model_key), 0, run_times.RECENT - 1))
    wait = run_times.wait_s(row["depth"], per_job, registry.lanes(offer.workers, offer.deployments, model_key,
                                                                   time.time()))
    return messages.spoken(wait) if wait is not None else "-"


def _ago(epoch) -> str:
    if not epoch:
        return "-"
    seconds = max(0.0, time.time() - epoch)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _clock(iso) -> str:
    if not iso:
        return "-"
    when = datetime.datetime.fromisoformat(iso).astimezone(datetime.timezone.utc)
    return when.strftime("%Y-%m-%d %H:%M:%S")


def _duration(seconds) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def page_data(client: redis.Redis) -> dict:
    farm = registry.status_document(client, operator=True)
    probed = {row.get("model_key"): row for row in probes.results(client)}
    deployments = []
    for entry in farm["deployments"].values():
        level = entry.get("deployment_level")
        probe = probed.get(entry.get("model_key"))
        deployments.append({
            # A model whose probe fails is not shown as plainly RUNNING: the probe says it answers wrong.
            "probe": "-" if probe is None else ("ok" if probe.get("ok") else "FAILING"),
            "model": entry.get("repo_id"),
            "nnsight": entry.get("nnsight") or "-",
            "level": level,
            "state": entry.get("application_state") or ("-" if level == "COLD" else ""),
            "worker": entry.get("worker") or "-",
            "pinned": "pinned" if entry.get("pinned") else "",
            "dtype": entry.get("dtype") or ("-" if level == "COLD" else "as saved"),
            "size": _mib(entry.get("size_bytes")) if entry.get("size_bytes") else "-",
            "measured": (_mib(entry.get("measured_bytes")) + (f" (est. {_mib(entry['weight_bytes'])})"
                                                               if entry.get("weight_bytes") else "")
                         if entry.get("measured_bytes") else "-"),
            "load": f"{entry['load_seconds']:.2f} s" if entry.get("load_seconds") else "-",
            "last_used": _ago(entry.get("last_used")),
        })
    deployments.sort(key=lambda d: (d["level"] != "HOT", d["model"] or "", d["nnsight"], d["worker"]))
    waiting, offer = [], registry.offer(client)
    for row in queues.summary(client):
        waiting.append({
            "model": queues.model_name(row),
            "nnsight": probes.runtime_of(row["model_key"]) if row["model_key"] else "-",
            "queue": row["queue"],
            "depth": row["depth"],
            "head_wait": f"{row['head_wait_s']:.1f} s",
            "last_starts": _last_starts(client, row, offer),
        })
    workers = []
    for name, info in sorted(farm["cluster"]["workers"].items()):
        workers.append({
            "name": name,
            "host": info.get("host") or "-",
            "gpus": ",".join(info.get("gpus") or []) or "cpu",
            "memory": f"{_mib(info.get('memory_used_bytes'))} of {_mib(info.get('memory_bytes'))}",
            "current_job": info.get("current_job") or "idle",
            "metrics_port": info.get("metrics_port") or "off",
            "last_seen": _ago(info.get("last_seen")),
        })
    launched = [{  # workers asked of the cluster's scheduler (ndif_celery.farm.elastic)
        "id": f"{row['launcher']} {row['id']}", "state": row["state"], "reason": row.get("reason") or "",
        "model": wire.repo_id(row["model_key"]), "worker": row.get("worker") or "-",
        "submitted": _ago(row.get("submitted_at")),
    } for row in farm["cluster"].get("launches", [])]
    schedule = [{
        "id": row["id"], "model": row["repo"], "start": schedules.iso(row["start"]), "end": schedules.iso(row["end"]),
        "replicas": row["replicas"], "state": row["state"],
    } for row in schedules.entries(client)]
    health = [{
        "model": row["repo"], "nnsight": row["nnsight"], "ok": row.get("ok"),
        "state": ("ok" if row.get("ok") else "FAILING") + (f", {row['note']}" if row["state"] == probes.QUEUED else ""),
        "latency": _duration(row.get("latency_s")), "worker": row.get("worker") or "-", "at": _ago(row.get("at")),
        "error": row.get("error") or "",
    } for row in probes.results(client)]
    spent, usage_note = usage_table()
    with_probes = request.args.get("probes") == "1"
    jobs, note = recent_jobs(client, probes=with_probes)
    recent = [{
        "finished": _clock(row.get("finished_at")),
        "job_id": row["job_id"],
        "user": row.get("email") or row.get("owner") or "-",
        "model": row.get("model") or "-",
        "nnsight": probes.runtime_of(row["model_key"]) if row.get("model_key") else "-",
        "status": row.get("outcome"),
        "kind": row.get("error_kind") or "",
        "duration": _duration(row.get("duration_s")),
        "worker": row.get("worker") or "-",
        "error": row.get("error") or "",
        "pending": row.get("pending", False),
    } for row in jobs]
    totals = {}
    for field, count in client.hgetall(metrics.JOBS).items():
        outcome = field.decode().split("|", 1)[0]
        totals[outcome] = totals.get(outcome, 0) + int(count)
    return {
        "wanted": wanted_rows(client), "history": model_history(client), "calendar": charts.calendar(
            schedules.entries(client), time.time()),
        "deployments": deployments, "queues": waiting, "workers": workers, "launches": launched, "jobs": recent, "ledger_note": note,
        "with_probes": with_probes,
        "schedule": schedule, "probes": health, "usage": spent, "usage_note": usage_note, "usage_days": USAGE_DAYS,
        "totals": totals, "flower_url": _settings().flower_url,
        "now": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }


def wanted_rows(client: redis.Redis) -> list[dict]:
    """``farm.wanted``'s rows, as the table shows them."""
    return [{
        **row, "over": f" (over {row['over']})" if row["over"] else "", "nnsight": probes.runtime_of(row["model_key"]),
        "target": "-" if row["target"] is None else row["target"],
        "workers": ", ".join(row["running"] + [f"{w} (loading)" for w in row["loading"]]) or "-",
        "css": {"met": "RUNNING", "loading": "DEPLOYING", "scheduled": ""}.get(row["state"], "ERROR"),
    } for row in wanted.rows(client)]


def model_history(client: redis.Redis) -> list[dict]:
    """Per model: job latency (the ledger, probes left out) and probe results (the beat's
    hourly counts), each over 24 h and 30 d, as SVG charts."""
    now = time.time()
    models: dict[str, dict] = {}
    note = ""
    for name in history.PERIODS:
        start, end, step = history.period(name, now)
        try:
            latency = history.job_latency(operators.ledger_engine(), start, end, step)
        except Exception as error:  # noqa: BLE001 - the page still shows the rest
            current_app.config.pop("NDIF_LEDGER_ENGINE", None)
            latency, note = {}, f"The ledger database cannot be read ({type(error).__name__})."
        for (repo, nnsight), rows in latency.items():
            row = models.setdefault((repo, nnsight), {"model": repo, "nnsight": nnsight})
            row[f"latency_{name}"] = charts.latency_chart([(at, p50) for at, _, _, p50 in rows], start, end,
                                                          f"{repo} (nnsight {nnsight}): job latency (p50), {name}")
            row[f"jobs_{name}"] = sum(jobs for _, jobs, _, _ in rows)
        for model_key in history.probed_models(client):
            repo, nnsight = wire.repo_id(model_key), probes.runtime_of(model_key)
            rows = history.probe_buckets(client, model_key, start, end, step)
            row = models.setdefault((repo, nnsight), {"model": repo, "nnsight": nnsight})
            row[f"probes_{name}"] = charts.uptime_chart(
                [(at, ok, failed) for at, ok, failed, _ in rows], start, end, step,
                f"{repo} (nnsight {nnsight}): probes, {name}")
            passed, failed = sum(r[1] for r in rows), sum(r[2] for r in rows)
            row[f"uptime_{name}"] = f"{100 * passed / (passed + failed):.1f} %" if passed + failed else "-"
    out = [models[deployment] for deployment in sorted(models)]
    if note:
        out.insert(0, {"note": note})
    return out


def admin_view(client: redis.Redis, identity) -> dict:
    """The admin forms' context: the caller's token, the action just done, the audit log."""
    view = {"admin": identity is not None, "token": "", "said": None, "audit": [], "audit_note": ""}
    if identity is None:
        return view
    view["token"] = admin.token_for(client, identity)
    try:
        said = request.args.get("said", "")
        view["said"] = audit.get(operators.ledger_engine(), int(said)) if said.isdigit() else None
        view["audit"] = audit.recent(operators.ledger_engine(), limit=AUDIT_ROWS)
    except Exception as error:  # noqa: BLE001 - the page still shows the rest
        current_app.config.pop("NDIF_LEDGER_ENGINE", None)
        view["audit_note"] = f"The audit log cannot be read ({type(error).__name__})."
    return view


@bp.get("/dashboard")
def dashboard():
    identity, refusal = operators.sign_in()
    if refusal is not None:
        return refusal
    client = _redis()
    view = admin_view(client, identity)
    # A page with forms does not reload itself under the operator's typing unless asked (?refresh=5).
    asked = request.args.get("refresh", "")
    view["refresh_s"] = int(asked) if asked.isdigit() and 2 <= int(asked) <= 600 else (0 if view["admin"] else REFRESH_S)
    html = render_template("dashboard.html", **{**page_data(client), **view})
    response = Response(html, mimetype="text/html")
    response.headers["Cache-Control"] = "no-store"
    return response

