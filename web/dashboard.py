"""``GET /metrics`` (Prometheus) and ``GET /dashboard`` (one HTML page for people).

Both read the farm from Redis (``ndif_celery.monitoring.metrics``, ``registry``,
``queues``, the health probes' results and the scheduled pins) and the recent
jobs and usage from the ledger (``ndif_celery.accounts.ledger``, ``usage``); no
torch, no build step. Every answered request is counted in Redis by
:func:`count_request` (after_request), so every web process and host adds to
the same ``ndif_http_requests_total``.

With ``NDIF_AUTH=1`` the dashboard wants HTTP Basic credentials whose password
is an API key tagged ``admin`` (``ndif-celery keys create --admin``): without
one it answers 401 with a ``WWW-Authenticate`` challenge, so a browser asks;
a key without the tag gets 403. ``/metrics`` stays open, like Flower's, for
Prometheus, but with auth on its per-key series (``ndif_usage_*{key}``) go
only to a scraper that shows ``NDIF_METRICS_TOKEN`` or an admin key as a
bearer token (``Authorization: Bearer ...``, which Prometheus sends from its
``authorization`` setting) or in ``ndif-api-key``: anyone else sees the
farm's totals.
"""

from __future__ import annotations

import datetime
import logging
import time

import redis
from flask import Blueprint, Response, current_app, render_template_string, request

from ndif_celery.accounts import db, ledger, usage
from ndif_celery.accounts.auth import AuthError
from ndif_celery.farm import schedules
from ndif_celery.monitoring import metrics, probes
from ndif_celery.state import queues, registry

from .identity import identify

bp = Blueprint("monitoring", __name__)
log = logging.getLogger("ndif_celery.web")

REFRESH_S = 5
RECENT_JOBS = 50
USAGE_DAYS = 7
REALM = 'Basic realm="ndif-celery dashboard", charset="UTF-8"'


def _settings():
    return current_app.config["NDIF_SETTINGS"]


def _redis() -> redis.Redis:
    return current_app.config["NDIF_REDIS"]


# --- request counting ---------------------------------------------------------------


def _counting_client(app) -> redis.Redis:
    """A Redis client that gives up at once: counting a request must never hold
    its answer back (the main client waits out a Redis restart)."""
    client = app.config.get("NDIF_METRICS_REDIS")
    if client is None:
        client = app.config["NDIF_METRICS_REDIS"] = redis.Redis.from_url(
            app.config["NDIF_SETTINGS"].redis_url, socket_timeout=0.5, socket_connect_timeout=0.5,
        )
    return client


@bp.after_app_request
def count_request(response):
    """Counted once the answer has gone out (``call_on_close``), off its path."""
    rule = request.url_rule.rule if request.url_rule is not None else "<unmatched>"
    client, method, status = _counting_client(current_app), request.method, response.status_code

    def count() -> None:
        try:
            metrics.count_request(client, rule, method, status)
        except (redis.RedisError, OSError):
            pass  # Redis away: this request goes uncounted

    response.call_on_close(count)
    return response


# --- /metrics -----------------------------------------------------------------------


@bp.get("/metrics")
def prometheus():
    from prometheus_client import CONTENT_TYPE_LATEST

    settings = _settings()
    per_key = not settings.auth or _scraper_may_see_keys(settings)
    return Response(metrics.render(_redis(), settings.usage_top_keys, per_key), content_type=CONTENT_TYPE_LATEST)


def _scraper_may_see_keys(settings) -> bool:
    """Whether the caller showed ``NDIF_METRICS_TOKEN`` or an admin key (bearer or ``ndif-api-key``)."""
    import hmac

    from ndif_celery.accounts.auth import HEADER

    shown = request.headers.get("Authorization", "")
    token = shown[len("Bearer "):].strip() if shown.startswith("Bearer ") else request.headers.get(HEADER, "")
    if not token:
        return False
    if settings.metrics_token and hmac.compare_digest(token.encode(), settings.metrics_token.encode()):
        return True
    try:
        return "admin" in identify(token).tags
    except AuthError:
        return False


# --- /dashboard ---------------------------------------------------------------------


def _challenge(detail: str, status: int = 401) -> Response:
    response = Response(_refusal_page(detail, status), status=status, mimetype="text/html")
    if status == 401:
        response.headers["WWW-Authenticate"] = REALM
    return response


def _refusal_page(detail: str, status: int) -> str:
    return render_template_string(
        "<!doctype html><title>{{ status }}</title><h1>{{ status }}</h1><p>{{ detail }}</p>",
        status=status, detail=detail,
    )


def _admin_refusal():
    """None if the caller may see the dashboard, else the answer to send.

    The one place a refusal is not the app's JSON ``errors.Refused`` answer: a
    person's browser reads this one, so it gets an HTML page and, for 401, the
    ``WWW-Authenticate`` challenge that makes the browser ask for the key."""
    if not _settings().auth:
        return None
    credentials = request.authorization
    key = credentials.password if credentials is not None and credentials.type == "basic" else None
    if not key:
        return _challenge("The dashboard needs an admin API key: sign in with any user name and the key as password.")
    try:
        identity = identify(key)
    except AuthError as error:
        if error.status == 503:
            return _challenge(error.detail, 503)
        return _challenge(f"{error.detail} Sign in with any user name and an admin API key as password.")
    if "admin" not in identity.tags:
        return _challenge("This API key is not an admin key (ndif-celery keys create --admin).", 403)
    return None


def _ledger_engine():
    engine = current_app.config.get("NDIF_LEDGER_ENGINE")
    if engine is None:
        engine = current_app.config["NDIF_LEDGER_ENGINE"] = db.engine_for(_settings().database_url)
    return engine


def recent_jobs(client: redis.Redis, limit: int = RECENT_JOBS) -> tuple[list[dict], str]:
    """The newest ended jobs (waiting in Redis first, then the database), and
    a note when the database could not be read."""
    rows = {row["job_id"]: row for row in ledger.waiting(client, limit)}
    note = ""
    try:
        for row in ledger.recent(_ledger_engine(), limit=limit):
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
        report = usage.report(_ledger_engine(), since=since)
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
    deployments = []
    for entry in farm["deployments"].values():
        level = entry.get("deployment_level")
        deployments.append({
            "model": entry.get("repo_id"),
            "level": level,
            "state": entry.get("application_state") or ("-" if level == "COLD" else ""),
            "worker": entry.get("worker") or "-",
            "pinned": "pinned" if entry.get("pinned") else "",
            "size": _mib(entry.get("size_bytes")) if entry.get("size_bytes") else "-",
            "load": f"{entry['load_seconds']:.2f} s" if entry.get("load_seconds") else "-",
            "last_used": _ago(entry.get("last_used")),
        })
    deployments.sort(key=lambda d: (d["level"] != "HOT", d["model"] or "", d["worker"]))
    waiting = []
    for row in queues.summary(client):
        waiting.append({
            "model": queues.model_name(row),
            "queue": row["queue"],
            "depth": row["depth"],
            "head_wait": f"{row['head_wait_s']:.1f} s",
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
    schedule = [{
        "id": row["id"], "model": row["repo"], "start": schedules.iso(row["start"]), "end": schedules.iso(row["end"]),
        "replicas": row["replicas"], "state": row["state"],
    } for row in schedules.entries(client)]
    health = [{
        "model": row["repo"], "ok": row.get("ok"), "state": "ok" if row.get("ok") else "FAILING",
        "latency": _duration(row.get("latency_s")), "worker": row.get("worker") or "-", "at": _ago(row.get("at")),
        "error": row.get("error") or "",
    } for row in probes.results(client)]
    spent, usage_note = usage_table()
    jobs, note = recent_jobs(client)
    recent = [{
        "finished": _clock(row.get("finished_at")),
        "job_id": row["job_id"],
        "user": row.get("email") or row.get("owner") or "-",
        "model": row.get("model") or "-",
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
        "deployments": deployments, "queues": waiting, "workers": workers, "jobs": recent, "ledger_note": note,
        "schedule": schedule, "probes": health, "usage": spent, "usage_note": usage_note, "usage_days": USAGE_DAYS,
        "totals": totals, "flower_url": _settings().flower_url,
        "now": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "refresh_s": REFRESH_S,
    }


@bp.get("/dashboard")
def dashboard():
    refusal = _admin_refusal()
    if refusal is not None:
        return refusal
    html = render_template_string(PAGE, **page_data(_redis()))
    response = Response(html, mimetype="text/html")
    response.headers["Cache-Control"] = "no-store"
    return response


PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="refresh" content="{{ refresh_s }}">
<title>ndif-celery dashboard</title>
<style>
 body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
 h1 { font-size: 1.4em; margin: 0 0 .2em; } h2 { font-size: 1.1em; margin: 1.4em 0 .4em; }
 table { border-collapse: collapse; width: 100%; }
 th, td { text-align: left; padding: .25em .6em; border-bottom: 1px solid #ddd; vertical-align: top; }
 th { background: #f4f4f4; } td.num { text-align: right; } .muted { color: #777; }
 .COMPLETED, .RUNNING, .HOT { color: #17702f; font-weight: 600; }
 .ERROR { color: #b3261e; font-weight: 600; } .DEPLOYING { color: #9a6700; font-weight: 600; }
 .COLD { color: #555; } .note { background: #fff4d6; padding: .4em .6em; }
 .error { font-family: ui-monospace, monospace; font-size: 12px; max-width: 40em; overflow-wrap: anywhere; }
 nav a { margin-right: 1em; }
</style>
</head>
<body>
<h1>ndif-celery</h1>
<nav>{% if flower_url %}<a href="{{ flower_url }}" id="flower-link">Flower</a>{% endif %}<a href="metrics">/metrics</a><a href="status">/status</a>
<span class="muted">{{ now }}, refreshed every {{ refresh_s }} s;
jobs ended: {{ totals.get("COMPLETED", 0) }} completed, {{ totals.get("ERROR", 0) }} with an error</span></nav>

<h2>Deployments</h2>
<table id="deployments">
<tr><th>model</th><th>level</th><th>state</th><th>worker</th><th>pinned</th><th>size</th><th>load</th><th>last used</th></tr>
{% for d in deployments %}
<tr><td>{{ d.model }}</td><td class="{{ d.level }}">{{ d.level }}</td><td class="{{ d.state }}">{{ d.state }}</td>
<td>{{ d.worker }}</td><td>{{ d.pinned }}</td><td class="num">{{ d.size }}</td><td class="num">{{ d.load }}</td>
<td>{{ d.last_used }}</td></tr>
{% else %}<tr><td colspan="8" class="muted">no models deployed or cached</td></tr>{% endfor %}
</table>

<h2>Queues</h2>
<table id="queues">
<tr><th>model</th><th>depth</th><th>head wait</th><th>queue</th></tr>
{% for q in queues %}
<tr><td>{{ q.model }}</td><td class="num">{{ q.depth }}</td><td class="num">{{ q.head_wait }}</td>
<td class="muted">{{ q.queue }}</td></tr>
{% else %}<tr><td colspan="4" class="muted">no model queues yet</td></tr>{% endfor %}
</table>

<h2>Workers</h2>
<table id="workers">
<tr><th>worker</th><th>host</th><th>GPUs</th><th>memory used</th><th>current job</th><th>metrics port</th><th>last seen</th></tr>
{% for w in workers %}
<tr><td>{{ w.name }}</td><td>{{ w.host }}</td><td>{{ w.gpus }}</td><td>{{ w.memory }}</td><td>{{ w.current_job }}</td>
<td class="num">{{ w.metrics_port }}</td><td>{{ w.last_seen }}</td></tr>
{% else %}<tr><td colspan="7" class="muted">no live workers</td></tr>{% endfor %}
</table>

<h2>Health probes</h2>
<table id="probes">
<tr><th>model</th><th>probe</th><th>latency</th><th>worker</th><th>last probed</th><th>error</th></tr>
{% for p in probes %}
<tr><td>{{ p.model }}</td><td class="{{ 'COMPLETED' if p.ok else 'ERROR' }}">{{ p.state }}</td>
<td class="num">{{ p.latency }}</td><td>{{ p.worker }}</td><td>{{ p.at }}</td><td class="error">{{ p.error }}</td></tr>
{% else %}<tr><td colspan="6" class="muted">no probe results (NDIF_PROBE_INTERVAL_S is 0, or nothing is deployed)</td></tr>{% endfor %}
</table>

<h2>Scheduled pins</h2>
<table id="schedule">
<tr><th>id</th><th>model</th><th>from (UTC)</th><th>to (UTC)</th><th>replicas</th><th>state</th></tr>
{% for w in schedule %}
<tr><td>{{ w.id }}</td><td>{{ w.model }}</td><td>{{ w.start }}</td><td>{{ w.end }}</td><td class="num">{{ w.replicas }}</td>
<td class="{{ 'RUNNING' if w.state == 'active' else '' }}">{{ w.state }}</td></tr>
{% else %}<tr><td colspan="6" class="muted">no scheduled pins</td></tr>{% endfor %}
</table>

<h2>Usage, last {{ usage_days }} days</h2>
{% if usage_note %}<p class="note">{{ usage_note }}</p>{% endif %}
<table id="usage">
<tr><th>user</th><th>key</th><th>jobs</th><th>errors</th><th>GPU-seconds</th><th>run-seconds</th><th>bytes in</th><th>bytes out</th></tr>
{% for u in usage %}
<tr><td>{{ u.user }}</td><td>{{ u.owner }}</td><td class="num">{{ u.jobs }}</td><td class="num">{{ u.errors }}</td>
<td class="num">{{ u.gpu_seconds }}</td><td class="num">{{ u.run_seconds }}</td><td class="num">{{ u.bytes_in }}</td>
<td class="num">{{ u.bytes_out }}</td></tr>
{% else %}<tr><td colspan="8" class="muted">no jobs in the ledger yet</td></tr>{% endfor %}
</table>

<h2>Recent jobs</h2>
{% if ledger_note %}<p class="note">{{ ledger_note }}</p>{% endif %}
<table id="jobs">
<tr><th>finished (UTC)</th><th>job</th><th>user</th><th>model</th><th>status</th><th>duration</th><th>worker</th><th>error</th></tr>
{% for j in jobs %}
<tr><td>{{ j.finished }}{% if j.pending %} <span class="muted">(not yet in the database)</span>{% endif %}</td>
<td>{{ j.job_id }}</td><td>{{ j.user }}</td><td>{{ j.model }}</td>
<td class="{{ j.status }}">{{ j.status }}{% if j.kind %} ({{ j.kind }}){% endif %}</td>
<td class="num">{{ j.duration }}</td><td>{{ j.worker }}</td><td class="error">{{ j.error }}</td></tr>
{% else %}<tr><td colspan="8" class="muted">no jobs yet</td></tr>{% endfor %}
</table>
</body>
</html>
"""
