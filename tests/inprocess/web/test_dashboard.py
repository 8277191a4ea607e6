"""The dashboard's parts that need no browser: the charts' SVG, the calendar's
days, the probe and latency history (a real embedded Redis, a real SQLite
ledger), the audit log, and the page's template (what users wrote shown as
text, the file shipped with the package). The page itself, in headless
Chromium, with its admin actions, is tests/e2e/monitoring/test_dashboard_admin.py."""

from __future__ import annotations

import configparser
import datetime
import fnmatch

from ndif_celery.accounts import audit, db
from ndif_celery.farm import actions
from ndif_celery.monitoring import history
from ndif_celery.policy import client_versions
from ndif_celery.policy import model_policy
from tests.support.paths import ROOT
from web import charts

DAY, HOUR = 86400, 3600
NOW = 1_800_000_000.0  # 2027-01-15 08:00 UTC, a Friday
#: What a user may put in a model name, an e-mail or an error: the page must show it as text.
HOSTILE = '<script>alert("x")</script>'


def test_a_latency_chart_draws_one_point_per_bucket_with_jobs():
    svg = str(charts.latency_chart([(NOW - 2 * HOUR, 12.0), (NOW - HOUR, None), (NOW, 30.0)],
                                   NOW - 3 * HOUR, NOW + HOUR, "m, 24 h"))
    assert svg.startswith("<svg") and svg.count('class="point"') == 2 and "<polyline" in svg
    assert "30 ms</title>" in svg and "33 ms" in svg  # the top of the axis: the largest value and a tenth
    empty = str(charts.latency_chart([], NOW - DAY, NOW, "m"))
    assert "no jobs in this period" in empty and "<polyline" not in empty


def test_an_uptime_chart_stacks_failed_probes_on_passed_ones():
    svg = str(charts.uptime_chart([(NOW - HOUR, 5, 1), (NOW, 0, 0)], NOW - 2 * HOUR, NOW + HOUR, HOUR, "m"))
    assert svg.count('class="bar ok"') == 1 and svg.count('class="bar failed"') == 1
    assert "5 ok</title>" in svg and "1 failed</title>" in svg


def test_the_calendar_lists_a_window_on_each_day_it_touches():
    window = {"id": "w1", "repo": "org/a", "state": "pending", "start": NOW + 14 * HOUR, "end": NOW + 40 * HOUR}
    weeks = charts.calendar([window], NOW, weeks=2)
    days = {day["date"]: day for week in weeks for day in week}
    assert weeks[0][0]["date"] == "2027-01-11" and len(days) == 14, "Monday first, from this week"
    assert days["2027-01-15"]["today"] and days["2027-01-14"]["past"]
    assert days["2027-01-15"]["windows"] == [{"id": "w1", "model": "org/a", "state": "pending", "hours": "22:00-24:00"}]
    assert days["2027-01-16"]["windows"][0]["hours"] == "00:00-24:00"
    assert days["2027-01-17"]["windows"] == [], "it ends at midnight: not on the next day"


def test_probe_history_counts_each_hour_and_forgets_past_a_month(redis_client):
    key = "K"
    history.record_probe(redis_client, key, True, 0.2, NOW - 40 * DAY)
    for at, ok, latency in ((NOW - 2 * HOUR, True, 0.1), (NOW - 2 * HOUR + 60, True, 0.3),
                            (NOW - HOUR, False, None), (NOW, True, 0.05)):
        history.record_probe(redis_client, key, ok, latency, at)
    start, end, step = history.period("24h", NOW)
    rows = history.probe_buckets(redis_client, key, start, end, step)
    assert len(rows) == 24 and rows[-1][0] == NOW
    by_start = {row[0]: row[1:] for row in rows}
    assert by_start[NOW - 2 * HOUR][:2] == (2, 0) and abs(by_start[NOW - 2 * HOUR][2] - 200.0) < 1e-6
    assert by_start[NOW - HOUR] == (0, 1, None) and by_start[NOW][:2] == (1, 0)
    assert not any(int(f.split(b"|")[0]) < NOW - 31 * DAY for f in redis_client.hkeys(history.HISTORY + key))
    month = history.probe_buckets(redis_client, key, *history.period("30d", NOW))
    assert len(month) == 30 and sum(row[1] for row in month) == 3 and sum(row[2] for row in month) == 1
    assert history.probed_models(redis_client) == [key]


def _job(engine, job_id, model, owner, finished, took_s, outcome="COMPLETED", probe=False, model_key=None):
    from sqlalchemy.orm import Session

    when = datetime.datetime.fromtimestamp(finished, datetime.timezone.utc)
    with Session(engine) as session:
        session.add(db.LedgerEntry(job_id=job_id, owner=owner, model=model, model_key=model_key or model, outcome=outcome,
                                   finished_at=when, received_at=when - datetime.timedelta(seconds=took_s),
                                   probe=probe))
        session.commit()


def test_job_latency_is_the_median_per_bucket_without_the_probes(tmp_path):
    engine = db.engine_for(f"sqlite:///{tmp_path / 'ledger.db'}")
    _job(engine, "a", "org/a", "key:1", NOW - 2 * HOUR + 10, 0.1)
    _job(engine, "b", "org/a", "key:1", NOW - 2 * HOUR + 20, 0.3)
    _job(engine, "c", "org/a", "key:1", NOW - 2 * HOUR + 30, 0.2, "ERROR")
    _job(engine, "p", "org/a", "key:9", NOW - 2 * HOUR + 40, 9.0, probe=True)
    _job(engine, "old", "org/a", "key:1", NOW - 3 * DAY, 1.0)
    runtime_key = model_policy.parse_client_key(actions.model_key_for("org/a"), "0.7.0").key
    _job(engine, "r", "org/a", "key:1", NOW - 2 * HOUR + 50, 5.0, model_key=runtime_key)
    rows = history.job_latency(engine, *history.period("24h", NOW))
    own = rows["org/a", client_versions.MAIN]
    by_start = {row[0]: row[1:] for row in own}
    jobs, errors, p50 = by_start[NOW - 2 * HOUR]
    assert (jobs, errors) == (3, 1) and abs(p50 - 200.0) < 1e-3
    assert sum(row[1] for row in own) == 3, "the probe's job, the runtime's and the one of three days ago are not in"
    assert sum(row[1] for row in rows["org/a", "0.7.0"]) == 1, "a runtime's deployment has its own chart"
    month = history.job_latency(engine, *history.period("30d", NOW))
    assert sum(row[1] for row in month["org/a", client_versions.MAIN]) == 4


def test_the_audit_log_keeps_each_action_newest_first(tmp_path):
    engine = db.engine_for(f"sqlite:///{tmp_path / 'audit.db'}")
    first = audit.record(engine, "key:1", "ops@x.org", "deploy", "org/a", {"replicas": "2"}, audit.DONE,
                         "deployment requested", "127.0.0.1")
    audit.record(engine, "key:1", "ops@x.org", "kill", "abc", {}, audit.REFUSED, "no job abc", "127.0.0.1")
    rows = audit.recent(engine)
    assert [(r["action"], r["outcome"]) for r in rows] == [("kill", "refused"), ("deploy", "done")]
    assert audit.get(engine, first)["detail"] == {"replicas": "2"} and rows[1]["at"].endswith("+00:00")


def test_the_page_shows_what_users_wrote_as_text(embedded_settings, redis_client, monkeypatch):
    from web import dashboard
    from web.app import create_app

    real = dashboard.page_data

    def hostile(client):
        data = real(client)
        data["deployments"] = [{"model": HOSTILE, "nnsight": "0.8.1", "level": "HOT", "state": "RUNNING",
                                "probe": "ok", "worker": HOSTILE, "pinned": "", "size": "-", "load": "-",
                                "last_used": "-"}]
        data["usage"] = [{"user": HOSTILE, "owner": HOSTILE, "jobs": 1, "errors": 0, "gpu_seconds": "0.000",
                          "run_seconds": "0.000", "bytes_in": 0, "bytes_out": 0}]
        data["jobs"] = [{"finished": "-", "job_id": HOSTILE, "user": HOSTILE, "model": HOSTILE, "nnsight": "-",
                         "status": "ERROR", "kind": HOSTILE, "duration": "-", "worker": "-", "error": HOSTILE,
                         "pending": False}]
        data["ledger_note"] = HOSTILE
        return data

    monkeypatch.setattr(dashboard, "page_data", hostile)
    answer = create_app(embedded_settings).test_client().get("/dashboard")
    page = answer.get_data(as_text=True)
    assert answer.status_code == 200 and answer.mimetype == "text/html"
    assert "<script>" not in page
    assert page.count("&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;") == 10
    assert 'id="read-only"' in page, "with auth off the page is read-only"


def test_the_template_ships_with_the_package():
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    patterns = parser["options.package_data"]["web"].split()
    templates = sorted(path.relative_to(ROOT / "web").as_posix() for path in (ROOT / "web" / "templates").iterdir())
    assert "templates/dashboard.html" in templates
    assert [name for name in templates if not any(fnmatch.fnmatch(name, p) for p in patterns)] == []


def test_each_deployment_shows_its_dtype_and_its_measured_weights(embedded_settings, redis_client):
    from ndif_celery.state import registry
    from web.app import create_app

    key = ('nnsight.modeling.transformers.TransformersModel:{"repo_id": "org/big", "revision": null, '
           '"task": "text-generation", "dtype": "nf4"}')
    registry.register_worker(redis_client, {"name": "w0", "pid": 1, "memory_bytes": 1 << 34})
    registry.set_deployment(redis_client, "w0", key, registry.RUNNING, size_bytes=3 << 30, weight_bytes=2 << 30,
                            measured_bytes=(2 << 30) + (1 << 28), dtype="nf4")
    try:
        page = create_app(embedded_settings).test_client().get("/dashboard").get_data(as_text=True)
        row = page.split('id="deployments"')[1].split("</table>")[0]
        assert "<td>org/big</td>" in row and "<td>nf4</td>" in row
        assert "3.0 GiB" in row and "2.2 GiB (est. 2.0 GiB)" in row
        entry = next(e for e in registry.status_document(redis_client)["deployments"].values()
                     if e.get("model_key") == key)
        assert entry["dtype"] == "nf4" and entry["measured_bytes"] == (2 << 30) + (1 << 28)
    finally:
        registry.remove_deployment(redis_client, "w0", key)
        redis_client.hdel(registry.WORKERS, "w0")
