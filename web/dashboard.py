"""``GET /metrics`` (Prometheus) and ``GET /dashboard`` (one HTML page for people).

Both read the farm from Redis (``ndif_celery.monitoring.metrics``, ``registry``,
``queues``, the health probes' results and the scheduled pins) and the recent
jobs and usage from the ledger (``ndif_celery.accounts.ledger_queries``, ``usage``); no
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

from ndif_celery import messages, wire
from ndif_celery.accounts import audit, ledger_queries, usage
from ndif_celery.accounts.auth import AuthError
from ndif_celery.farm import schedules, wanted
from ndif_celery.monitoring import history, metrics, probes
from ndif_celery.state import queues, registry, run_times

from . import admin, charts, operators
from .identity import identify

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
            "size": _mib(entry.get("size_bytes")) if entry.get("size_bytes") else "-",
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
        "deployments": deployments, "queues": waiting, "workers": workers, "jobs": recent, "ledger_note": note,
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
    html = render_template_string(PAGE, **{**page_data(client), **view})
    response = Response(html, mimetype="text/html")
    response.headers["Cache-Control"] = "no-store"
    return response


PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
{% if refresh_s %}<meta http-equiv="refresh" content="{{ refresh_s }}">{% endif %}
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
 .charts td { padding: .2em .3em; } svg.chart { width: 100%; max-width: 640px; height: auto; }
 table.calendar td { width: 14%; height: 4.2em; font-size: 12px; } table.calendar td.today { background: #eef5ff; }
 table.calendar td.past { color: #999; } .window { display: block; background: #e3f1e6; margin: .1em 0; padding: 0 .2em; }
 form.action { display: inline-block; border: 1px solid #ddd; padding: .5em .7em; margin: 0 .5em .5em 0; vertical-align: top; }
 form.action h3 { font-size: 1em; margin: 0 0 .3em; } form.action input { width: 11em; } form.action input[size] { width: auto; }
 form.inline { display: inline; } .said { padding: .4em .6em; } .said.done { background: #e3f1e6; }
 .said.refused, .said.failed { background: #fbe3e1; }
</style>
</head>
<body>
<h1>ndif-celery</h1>
<nav>{% if flower_url %}<a href="{{ flower_url }}" id="flower-link">Flower</a>{% endif %}<a href="metrics">/metrics</a><a href="status">/status</a>
<a href="#wanted">wanted</a><a href="#history">history</a><a href="#calendar">calendar</a>{% if admin %}<a href="#actions">actions</a><a href="#audit">audit log</a>{% endif %}
<span class="muted">{{ now }}, {% if refresh_s %}refreshed every {{ refresh_s }} s{% else %}<a href="dashboard?refresh=5" id="auto-refresh">refresh every 5 s</a>{% endif %};
jobs ended (health probes included): {{ totals.get("COMPLETED", 0) }} completed, {{ totals.get("ERROR", 0) }} with an error</span></nav>

{% if admin and said %}<p class="said {{ said.outcome }}" id="said">{{ said.action }} {{ said.target }}: {{ said.outcome }}: {{ said.message }}</p>{% endif %}

<h2>Wanted versus running</h2>
<table id="wanted">
<tr><th>model</th><th>nnsight</th><th>source</th><th>pinned</th><th>want</th><th>running</th><th>state</th><th>workers</th><th>why not</th></tr>
{% for w in wanted %}
<tr><td>{{ w.model }}</td><td>{{ w.nnsight }}</td><td>{{ w.source }}{{ w.over }}</td><td>{{ "pinned" if w.pinned else "" }}</td>
<td class="num">{{ w.target }}</td><td class="num">{{ w.running|length }}</td><td class="{{ w.css }}">{{ w.state }}</td>
<td>{{ w.workers }}</td><td class="error">{{ w.reason or "" }}</td></tr>
{% else %}<tr><td colspan="9" class="muted">nothing wanted, nothing running</td></tr>{% endfor %}
</table>

<h2>Deployments</h2>
<table id="deployments">
<tr><th>model</th><th>nnsight</th><th>level</th><th>state</th><th>probe</th><th>worker</th><th>pinned</th><th>size</th><th>load</th><th>last used</th></tr>
{% for d in deployments %}
<tr><td>{{ d.model }}</td><td>{{ d.nnsight }}</td><td class="{{ d.level }}">{{ d.level }}</td>
<td class="{{ 'ERROR' if d.probe == 'FAILING' else d.state }}">{{ d.state }}{% if d.probe == 'FAILING' %} (probe failing){% endif %}</td>
<td class="{{ 'ERROR' if d.probe == 'FAILING' else ('COMPLETED' if d.probe == 'ok' else '') }}">{{ d.probe }}</td>
<td>{{ d.worker }}</td><td>{{ d.pinned }}</td><td class="num">{{ d.size }}</td><td class="num">{{ d.load }}</td>
<td>{{ d.last_used }}</td></tr>
{% else %}<tr><td colspan="10" class="muted">no models deployed or cached</td></tr>{% endfor %}
</table>

<h2>Queues</h2>
<table id="queues">
<tr><th>model</th><th>nnsight</th><th>depth</th><th>head wait</th><th>last in line starts</th><th>queue</th></tr>
{% for q in queues %}
<tr><td>{{ q.model }}</td><td>{{ q.nnsight }}</td><td class="num">{{ q.depth }}</td><td class="num">{{ q.head_wait }}</td>
<td class="num">{{ q.last_starts }}</td><td class="muted">{{ q.queue }}</td></tr>
{% else %}<tr><td colspan="6" class="muted">no model queues yet</td></tr>{% endfor %}
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
<tr><th>model</th><th>nnsight</th><th>probe</th><th>latency</th><th>worker</th><th>last probed</th><th>error</th></tr>
{% for p in probes %}
<tr><td>{{ p.model }}</td><td>{{ p.nnsight }}</td><td class="{{ 'COMPLETED' if p.ok else 'ERROR' }}">{{ p.state }}</td>
<td class="num">{{ p.latency }}</td><td>{{ p.worker }}</td><td>{{ p.at }}</td><td class="error">{{ p.error }}</td></tr>
{% else %}<tr><td colspan="7" class="muted">no probe results (NDIF_PROBE_INTERVAL_S is 0, or nothing is deployed)</td></tr>{% endfor %}
</table>

<h2>History</h2>
<table id="history" class="charts">
<tr><th>model</th><th>nnsight</th><th>period</th><th>job latency (p50 per bucket)</th><th>probes (passed, failed)</th></tr>
{% for h in history %}
{% if h.note %}<tr><td colspan="5" class="note">{{ h.note }}</td></tr>{% else %}
{% for period in ("24h", "30d") %}
<tr data-model="{{ h.model }}" data-nnsight="{{ h.nnsight }}" data-period="{{ period }}"><td>{{ h.model }}</td><td>{{ h.nnsight }}</td>
<td>{{ "24 h, hourly" if period == "24h" else "30 d, daily" }}<br><span class="muted">jobs: {{ h.get("jobs_" + period, 0) }};
probes passed: {{ h.get("uptime_" + period, "-") }}</span></td>
<td>{{ h.get("latency_" + period, "") }}</td><td>{{ h.get("probes_" + period, "") }}</td></tr>
{% endfor %}{% endif %}
{% else %}<tr><td colspan="5" class="muted">no jobs or probes yet</td></tr>{% endfor %}
</table>

<h2>Scheduled pins</h2>
<table id="schedule">
<tr><th>id</th><th>model</th><th>from (UTC)</th><th>to (UTC)</th><th>replicas</th><th>state</th></tr>
{% for w in schedule %}
<tr><td>{{ w.id }}</td><td>{{ w.model }}</td><td>{{ w.start }}</td><td>{{ w.end }}</td><td class="num">{{ w.replicas }}</td>
<td class="{{ 'RUNNING' if w.state == 'active' else '' }}">{{ w.state }}</td></tr>
{% else %}<tr><td colspan="6" class="muted">no scheduled pins</td></tr>{% endfor %}
</table>
<table id="calendar" class="calendar">
<tr><th>Mon</th><th>Tue</th><th>Wed</th><th>Thu</th><th>Fri</th><th>Sat</th><th>Sun</th></tr>
{% for week in calendar %}<tr>{% for day in week %}
<td class="{{ 'today' if day.today else '' }} {{ 'past' if day.past else '' }}" data-date="{{ day.date }}"><b>{{ day.day }}</b>
{% for w in day.windows %}<span class="window" title="{{ w.id }}">{{ w.hours }} {{ w.model }}</span>{% endfor %}</td>
{% endfor %}</tr>{% endfor %}
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
<p class="muted" id="jobs-probes">{% if with_probes %}With the health probes' jobs (<a href="dashboard">leave them out</a>).
{% else %}The health probes' jobs are left out (<a href="dashboard?probes=1">show them</a>).{% endif %}</p>
{% if ledger_note %}<p class="note">{{ ledger_note }}</p>{% endif %}
<table id="jobs">
<tr><th>finished (UTC)</th><th>job</th><th>user</th><th>model</th><th>nnsight</th><th>status</th><th>duration</th><th>worker</th><th>error</th></tr>
{% for j in jobs %}
<tr><td>{{ j.finished }}{% if j.pending %} <span class="muted">(not yet in the database)</span>{% endif %}</td>
<td>{{ j.job_id }}</td><td>{{ j.user }}</td><td>{{ j.model }}</td><td>{{ j.nnsight }}</td>
<td class="{{ j.status }}">{{ j.status }}{% if j.kind %} ({{ j.kind }}){% endif %}</td>
<td class="num">{{ j.duration }}</td><td>{{ j.worker }}</td><td class="error">{{ j.error }}</td></tr>
{% else %}<tr><td colspan="9" class="muted">no jobs yet</td></tr>{% endfor %}
</table>

<h2 id="actions">Admin actions</h2>
{% if admin %}
{% set csrf %}<input type="hidden" name="csrf" value="{{ token }}">{% endset %}
<form class="action" id="deploy" method="post" action="dashboard/actions/deploy"><h3>Deploy</h3>{{ csrf }}
<label>model <input name="model" required></label><br><label>replicas <input name="replicas" value="1"></label><br>
<label>dtype <input name="dtype" placeholder="the checkpoint's" size="18"></label><br><label><input type="checkbox" name="pin" value="1" style="width:auto"> pin</label>
<button type="submit">deploy</button></form>
<form class="action" id="scale" method="post" action="dashboard/actions/scale"><h3>Scale</h3>{{ csrf }}
<label>model <input name="model" required></label><br><label>replicas <input name="replicas" value="1"></label>
<button type="submit">scale</button></form>
<form class="action" id="evict" method="post" action="dashboard/actions/evict"><h3>Evict</h3>{{ csrf }}
<label>model <input name="model" required></label> <button type="submit">evict</button></form>
<form class="action" id="kill" method="post" action="dashboard/actions/kill"><h3>Kill a job</h3>{{ csrf }}
<label>job id <input name="job_id" required></label> <button type="submit">kill</button></form>
<form class="action" id="schedule-add" method="post" action="dashboard/actions/schedule-add"><h3>Schedule a pin</h3>{{ csrf }}
<label>model <input name="model" required></label><br><label>from <input name="start" value="now"></label><br>
<label>to <input name="end" placeholder="+2h or 2026-12-24T09:00" size="26"></label><br><label>replicas <input name="replicas" value="1"></label>
<button type="submit">schedule</button></form>
<form class="action" id="schedule-remove" method="post" action="dashboard/actions/schedule-remove"><h3>Remove a window</h3>{{ csrf }}
<label>id <input name="id" required></label> <button type="submit">remove</button></form>

<h2>Audit log</h2>
{% if audit_note %}<p class="note">{{ audit_note }}</p>{% endif %}
<table id="audit">
<tr><th>when (UTC)</th><th>who</th><th>action</th><th>on</th><th>outcome</th><th>message</th></tr>
{% for a in audit %}
<tr><td>{{ a.at[:19].replace("T", " ") }}</td><td>{{ a.email or a.actor }}</td><td>{{ a.action }}</td><td>{{ a.target }}</td>
<td class="{{ 'COMPLETED' if a.outcome == 'done' else 'ERROR' }}">{{ a.outcome }}</td><td class="error">{{ a.message }}</td></tr>
{% else %}<tr><td colspan="6" class="muted">no admin actions yet</td></tr>{% endfor %}
</table>
{% else %}
<p class="muted" id="read-only">Read-only: admin actions need NDIF_AUTH=1 and an API key tagged admin.</p>
{% endif %}
</body>
</html>
"""
