"""Running the farm from the dashboard, in real headless Chromium on a real
stack with ``NDIF_AUTH=1``: wanted versus running, the history charts, probe
state in the deployments table, the schedule as a calendar, and every admin
action (deploy, scale, evict, kill, schedule add and remove) done through the
page's own forms by an admin key, each in the audit log. Without an admin key,
or from another site's page, no action is done. Screenshots go to
``tests/_out/dashboard-admin/``.

The tests run in order on one stack and one browser; each says what it
starts from. The parts without a browser (charts, calendar, history, audit)
are tests/inprocess/web/test_dashboard.py.
"""

from __future__ import annotations

import base64
import http.server
import json
import os
import threading
import types

import httpx
import pytest
import redis
from nnsight.intervention.backends.remote import RemoteError

from ndif_celery.accounts import db
from ndif_celery.farm.actions import model_key_for
from ndif_celery.monitoring import probes
from ndif_celery.policy import client_versions
from tests.support.clients.browser import Chromium, chromium_path
from tests.support.paths import OUT_DIR
from tests.support.clients.remote import poll, slow_job, wait_status
from tests.support.stacks.stack import client_on_stack
from tests.support.cases.tiny_model import PROMPT, build_tiny_gpt2, client_model

A, B = "dash/a", "dash/b"
WORKER = "gpu0@dash-test"
SHOTS = OUT_DIR / "dashboard-admin"


@pytest.fixture(scope="module")
def farm(tmp_path_factory, hf_home):
    path = chromium_path()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing; .ci/run installs it (apt-get install chromium) before the tests")
        pytest.skip("chromium is not installed (apt-get install -y chromium); the dashboard tests need a browser")
    for seed, repo in enumerate((A, B)):
        build_tiny_gpt2(hf_home, repo, n_layer=1, seed=90 + seed)
    home = tmp_path_factory.mktemp("dashboard-admin") / "home"
    home.mkdir(parents=True)
    engine = db.engine_for(f"sqlite:///{home / 'ndif.db'}")
    keys = {"ops": db.create_key(engine, "ops@dash.test", ("admin", "trusted")),
            "probe": db.create_key(engine, "probe@dash.test", ("admin", "trusted")),
            "ada": db.create_key(engine, "ada@dash.test", ("trusted",))}
    engine.dispose()
    env = {"NDIF_AUTH": "1", "NDIF_ISOLATION": "fork", "NDIF_WORKER_NAME": WORKER, "NDIF_WORKER_MEMORY_GIB": "1",
           "NDIF_PADDING_FACTOR": "0", "NDIF_PADDING_BYTES": "0", "NDIF_PROBE_INTERVAL_S": "2",
           "NDIF_PROBE_TIMEOUT_S": "30", "NDIF_PROBE_API_KEY": keys["probe"],
           "NDIF_REPLICA_WAIT_S": "3600", "NDIF_REPLICA_IDLE_S": "3600"}
    with client_on_stack(home, hf_home, env) as stack, Chromium(path) as browser:
        yield types.SimpleNamespace(stack=stack, browser=browser, keys=keys,
                                    redis=redis.Redis.from_url(stack.redis_url))


def _basic(key: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(f"ops:{key}".encode()).decode()}


def _page(farm, key: str = "ops"):
    farm.browser.set_headers(_basic(farm.keys[key]))
    farm.browser.open(farm.stack.url + "/dashboard")
    return farm.browser


def _act(farm, form: str, **fields) -> str:
    """Fill ``form`` on the dashboard and send it; the page's line about what was done."""
    browser = _page(farm)
    browser.fill(f"#{form}", **fields)
    browser.submit(f"#{form}")
    assert browser.status() == 200, browser.text()
    return browser.text("#said")


def _row(rows: list[list[str]], first: str) -> list[str]:
    matching = [row for row in rows if row and row[0] == first]
    assert matching, f"no row for {first!r} in {rows}"
    return matching[0]


def _until(check, what: str, farm, timeout_s: float = 90.0):
    return farm.stack.until(check, what, timeout_s, interval_s=0.5)


def _wanted(farm, repo: str):
    rows = _page(farm).rows("#wanted")
    return next((row for row in rows if row and row[0] == repo), None)


# --- without an admin key, nothing ---------------------------------------------------------


class _Attacker(http.server.BaseHTTPRequestHandler):
    """Another site: its page posts a form to the farm as soon as it loads."""

    target = ""

    def do_GET(self):
        page = (f'<form id="f" method="post" action="{self.target}/dashboard/actions/deploy">'
                f'<input name="model" value="{A}"><input name="csrf" value="guessed"></form>'
                '<script>document.getElementById("f").submit()</script>').encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)

    def log_message(self, *args):
        pass


ACTIONS = {"deploy": {"model": A}, "scale": {"model": A, "replicas": "2"}, "evict": {"model": A},
           "kill": {"job_id": "0" * 32}, "schedule-add": {"model": B, "start": "now", "end": "+1h"},
           "schedule-remove": {"id": "abc"}}


def test_without_an_admin_key_or_from_another_site_no_action_is_done(farm):
    for action, fields in ACTIONS.items():
        url = f"{farm.stack.url}/dashboard/actions/{action}"
        assert httpx.post(url, data=fields, timeout=10).status_code == 401, action
        refused = httpx.post(url, data=fields, headers=_basic(farm.keys["ada"]), timeout=10)
        assert refused.status_code == 403 and "not an admin key" in refused.text, action
    # A person with a key that is not an admin's sees no page at all, so no form.
    farm.browser.set_headers(_basic(farm.keys["ada"]))
    farm.browser.open(farm.stack.url + "/dashboard")
    assert farm.browser.status() == 403 and "not an admin key" in farm.browser.text()
    assert farm.browser.evaluate("document.querySelectorAll('form').length") == 0
    farm.browser.screenshot(SHOTS / "not-an-admin-key.png")
    url = farm.stack.url + "/dashboard/actions/deploy"
    forged = httpx.post(url, data={"model": A, "csrf": "0" * 64}, headers=_basic(farm.keys["ops"]), timeout=10)
    assert forged.status_code == 403 and "form token is missing or wrong" in forged.text

    # The operator's browser holds the admin credentials and visits another site, whose page posts the form.
    _Attacker.target = farm.stack.url
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Attacker)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        farm.browser.set_headers(_basic(farm.keys["ops"]))
        farm.browser.open(f"http://127.0.0.1:{server.server_address[1]}/")
        _until(lambda: "/dashboard/actions/deploy" in farm.browser.evaluate("location.href"), "the forged post", farm,
               15)
        farm.browser.wait_loaded()
        assert farm.browser.status() == 403 and "nothing was done" in farm.browser.text()
        farm.browser.screenshot(SHOTS / "forged-post-refused.png")
    finally:
        server.shutdown()
    hot = [e for e in farm.stack.farm()["deployments"].values() if e["deployment_level"] == "HOT"]
    assert hot == [] and _wanted(farm, A) is None, hot
    assert "no scheduled pins" in _page(farm).text("#schedule")
    # Only the admin's refused attempts are in the log: the other key and no key never reach it.
    rows = _page(farm).rows("#audit")[1:]
    assert [(row[1], row[2], row[4]) for row in rows] == [("ops@dash.test", "deploy", "refused")] * 2, rows


def test_an_admin_deploys_and_scales_and_sees_wanted_versus_running(farm):
    said = _act(farm, "deploy", model=A, replicas="1", pin=True)
    assert said == f"deploy {A}: done: deployment requested: 1 replica(s), pinned"
    row = _until(lambda: (lambda r: r if r and r[6] == "met" else None)(_wanted(farm, A)), "dash/a running", farm)
    assert row[1:6] == [client_versions.MAIN, "cli", "pinned", "1", "1"] and row[7] == WORKER, row
    said = _act(farm, "scale", model=A, replicas="2")
    assert said == f"scale {A}: done: 2 replica(s) requested"
    row = _until(lambda: (lambda r: r if r and r[8] else None)(_wanted(farm, A)), "the unmet replica's reason", farm)
    assert row[4:7] == ["2", "1", "unmet"] and row[8] == f"Could not deploy {A}: no live worker can take another replica of it."
    farm.browser.screenshot(SHOTS / "wanted-unmet.png")
    assert _act(farm, "scale", model=A, replicas="1") == f"scale {A}: done: 1 replica(s) requested"
    _until(lambda: (lambda r: r and r[6] == "met" and not r[8])(_wanted(farm, A)), "dash/a met again", farm)
    said = _act(farm, "deploy", model="not a repo id!", replicas="1")
    assert said.startswith("deploy not a repo id!: refused: "), said


def test_history_charts_and_a_failing_probe_in_the_deployments_table(farm):
    import nnsight

    nnsight.CONFIG.API.APIKEY = farm.keys["ada"]
    model = client_model(A)
    for _ in range(2):
        with model.trace(PROMPT, remote=True):
            model.transformer.h[0].output.save()

    def charted():
        browser = _page(farm)
        points = browser.evaluate("document.querySelectorAll('#history svg.latency .point').length")
        passed = browser.evaluate("document.querySelectorAll('#history svg.uptime .bar.ok').length")
        probe = _row(browser.rows("#deployments"), A)[5]
        return points >= 2 and passed >= 2 and probe == "ok"  # a point per period, an ok bar per period

    _until(charted, "latency and probe charts for dash/a", farm)
    browser = farm.browser
    periods = [row[2] for row in browser.rows("#history") if row and row[0] == A]
    assert len(periods) == 2 and all("jobs: 2;" in p and "probes passed: 100.0 %" in p for p in periods), periods
    browser.screenshot(SHOTS / "history.png")

    # The probe's reference skewed: the beat's next probe fails as it would on corrupted weights.
    field = probes.reference_field(model_key_for(A), None)
    reference = json.loads(farm.redis.hget(probes.REFERENCES, field))
    reference["values"] = [v * 3.0 for v in reference["values"]]
    farm.redis.hset(probes.REFERENCES, field, json.dumps(reference))

    def red():
        row = _row(_page(farm).rows("#deployments"), A)
        return row if row[5] == "FAILING" else None

    row = _until(red, "the failing probe in the deployments table", farm)
    assert row[4] == "RUNNING (probe failing)"
    assert "ERROR" in farm.browser.evaluate(
        "Array.from(document.querySelectorAll('#deployments tr')).find(r => r.cells[0].innerText === 'dash/a')"
        ".cells[4].className")
    assert farm.browser.evaluate("document.querySelectorAll('#history svg.uptime .bar.failed').length") >= 2
    _bars_are_drawn_to_scale(farm.browser)
    farm.browser.screenshot(SHOTS / "probe-failing.png")
    reference["values"] = [v / 3.0 for v in reference["values"]]
    farm.redis.hset(probes.REFERENCES, field, json.dumps(reference))


# Each probe bar as the browser laid it out: its kind, its count (from its title), its drawn box.
_BARS = """Array.from(document.querySelectorAll('#history svg.uptime')).map(svg => ({
  labels: Array.from(svg.querySelectorAll('text')).map(t => t.getBBox().x),
  bars: Array.from(svg.querySelectorAll('.bar')).map(b => {
    const box = b.getBBox();
    return {failed: b.classList.contains('failed'), count: parseInt(b.querySelector('title').textContent.split(': ')[1]),
            x: box.x, y: box.y, height: box.height};
  })}))"""


def _bars_are_drawn_to_scale(browser) -> None:
    """What the browser drew: every bar a positive height in proportion to its
    count (one scale per chart), a failed bar stacked on its period's passed
    one, and no axis label cut at the chart's left edge."""
    charts = browser.evaluate(_BARS)
    assert charts and any(bar["failed"] for chart in charts for bar in chart["bars"]), charts
    for chart in charts:
        assert min(chart["labels"]) >= 0, f"a label starts left of the chart: {chart['labels']}"
        scales = [bar["height"] / bar["count"] for bar in chart["bars"]]
        assert all(bar["height"] > 0 for bar in chart["bars"]), chart["bars"]
        assert max(scales) - min(scales) < 0.2, f"bars not in proportion to their counts: {chart['bars']}"
        passed = {round(bar["x"], 1): bar for bar in chart["bars"] if not bar["failed"]}
        for bar in chart["bars"]:
            below = passed.get(round(bar["x"], 1))
            if bar["failed"] and below is not None:
                assert abs(bar["y"] + bar["height"] - below["y"]) < 0.2, (bar, below)


def test_a_schedule_added_shows_in_the_calendar_and_is_removed(farm):
    said = _act(farm, "schedule-add", model=B, start="+1h", end="+3h", replicas="1")
    assert said.startswith(f"schedule-add {B}: done: window "), said
    window_id = said.split("window ")[1].split(":")[0]
    browser = farm.browser
    assert _row(browser.rows("#schedule"), window_id)[1] == B
    calendar = browser.text("#calendar")
    assert B in calendar
    assert _row(browser.rows("#wanted"), B)[5:7] == ["0", "scheduled"]
    browser.screenshot(SHOTS / "calendar.png")
    assert _act(farm, "schedule-remove", id=window_id) == f"schedule-remove {window_id}: done: removed the window of {B}"
    assert B not in farm.browser.text("#calendar") and B not in farm.browser.text("#schedule")


def test_an_admin_kills_a_running_job_named_in_the_workers_table(farm):
    import nnsight

    nnsight.CONFIG.API.APIKEY = farm.keys["ada"]
    running = slow_job(client_model(A), steps=600)  # up to 30 s of 50 ms sleeps: killable
    wait_status(farm.stack.url, running.job_id, "RUNNING", headers={"ndif-api-key": farm.keys["ada"]})
    job_id = _until(lambda: (lambda w: w[4] if w[4] != "idle" else None)(_row(_page(farm).rows("#workers"), WORKER)),
                    "the running job in the workers table", farm, 30)
    assert job_id == running.job_id
    said = _act(farm, "kill", job_id=job_id)
    assert said == f"kill {job_id}: done: cancelling on {WORKER}"
    with pytest.raises(RemoteError, match="cancelled by the operator"):
        poll(running)
    said = _act(farm, "kill", job_id="0" * 32)
    assert said == f"kill {'0' * 32}: refused: no job {'0' * 32} is waiting or running"


def test_an_admin_evicts_and_the_audit_log_holds_every_action(farm):
    said = _act(farm, "evict", model=A)
    assert said == f"evict {A}: done: evicting from {WORKER}"
    _until(lambda: _wanted(farm, A) is None, "dash/a gone", farm, 60)
    rows = _page(farm).rows("#audit")[1:]
    done = [(row[2], row[3], row[4]) for row in rows]
    assert done[:3] == [("evict", A, "done"), ("kill", "0" * 32, "refused"), ("kill", done[2][1], "done")], done
    assert ("schedule-remove", "schedule-add") == tuple(r[0] for r in done[3:5]) and ("deploy", A, "done") in done
    farm.browser.screenshot(SHOTS / "audit.png")
    listed = json.loads(farm.stack.cli("audit", "--json", check=True).stdout)
    assert [(r["action"], r["target"], r["outcome"]) for r in listed][:len(done)] == done, "the CLI reads the same log"
    assert all(r["email"] == "ops@dash.test" for r in listed)
