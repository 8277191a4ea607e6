"""The dashboard (``GET /dashboard``) as a person sees it: headless Chromium
opens it on a real stack where the real client has run jobs, and reads the
deployments, queues, workers and recent jobs from the rendered page (which
refreshes itself); a screenshot is kept under ``tests/_out/dashboard/``.
With ``NDIF_AUTH=1`` only an API key tagged ``admin`` opens it."""

from __future__ import annotations

import base64
import os
import time

import httpx
import pytest
from nnsight.intervention.backends.remote import RemoteError

from ndif_celery.policy import client_versions
from tests.support.clients.browser import BrowserError, Chromium, chromium_path
from tests.support.paths import OUT_DIR
from tests.support.clients.remote import final_status
from tests.support.cases.tiny_model import PROMPT, REPO_ID


@pytest.fixture(scope="module")
def chromium():
    path = chromium_path()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing; .ci/run installs it (apt-get install chromium) before the tests")
        pytest.skip("chromium is not installed (apt-get install -y chromium); the dashboard test needs a browser")
    with Chromium(path) as browser:
        yield browser


def _ok_job(url: str, model) -> str:
    with model.trace(PROMPT, remote=True) as tracer:
        model.transformer.h[0].output.save()
    job_id = tracer.backend.meta["job_id"]
    assert final_status(url, job_id)["status"] == "COMPLETED"
    return job_id


def _error_job(url: str, model) -> str:
    with pytest.raises(RemoteError):
        with model.trace(PROMPT, remote=True) as tracer:
            hidden = model.transformer.h[0].output  # noqa: F841
            missing = {}["no-such-key"]  # the user's bug  # noqa: F841
    job_id = tracer.backend.job_id or tracer.backend.meta["job_id"]
    assert final_status(url, job_id)["status"] == "ERROR"
    return job_id


def _row_with(rows: list[list[str]], needle: str) -> list[str]:
    matching = [row for row in rows if any(needle in cell for cell in row)]
    assert matching, f"no row with {needle!r} in {rows}"
    return matching[0]


def test_the_dashboard_shows_the_farm_and_recent_jobs(chromium, on_fs_stack, model):
    stack = on_fs_stack
    ok_id = _ok_job(stack.url, model)
    error_id = _error_job(stack.url, model)
    deadline = time.monotonic() + 10
    while True:  # the worker's entry says it is idle at its next heartbeat (every 2 s)
        (worker, info), = stack.operator_farm()["cluster"]["workers"].items()
        if info["current_job"] is None or time.monotonic() > deadline:
            break
        time.sleep(0.2)

    chromium.open(stack.url + "/dashboard")
    screenshot = chromium.screenshot(OUT_DIR / "dashboard" / "dashboard.png")
    assert screenshot.stat().st_size > 10_000
    assert chromium.evaluate("document.title") == "ndif-celery dashboard"

    deployment = _row_with(chromium.rows("#deployments"), REPO_ID)
    # The nnsight that serves it, then no probes on this farm: "-".
    assert deployment[1:7] == [client_versions.MAIN, "as saved", "HOT", "RUNNING", "-", worker], deployment

    queue = _row_with(chromium.rows("#queues"), REPO_ID)
    assert queue[1] == client_versions.MAIN and queue[2] == "0" and queue[3].endswith(" s"), queue

    listed = _row_with(chromium.rows("#workers"), worker)
    assert listed[2] == "cpu" and listed[4] == "idle", listed
    assert listed[5] == str(info["metrics_port"]), (listed, info)
    assert " of " in listed[3] and ("MiB" in listed[3] or "GiB" in listed[3]), listed

    jobs = chromium.rows("#jobs")
    ok, failed = _row_with(jobs, ok_id), _row_with(jobs, error_id)
    assert ok[2:6] == ["anonymous", REPO_ID, client_versions.MAIN, "COMPLETED"], ok
    assert ok[6].endswith(("ms", " s")) and ok[7] == worker, ok
    assert failed[5] == "ERROR (user)" and failed[8] == "KeyError: 'no-such-key'", failed
    assert [row[1] for row in jobs[1:3]] == [error_id, ok_id], "newest first"

    assert chromium.evaluate("document.getElementById('flower-link').href").rstrip("/") == stack.flower_url
    assert chromium.evaluate("document.querySelector('meta[http-equiv=refresh]').content") == "5"
    # Auth off: nobody is an operator, so the page offers no action.
    assert "admin actions need NDIF_AUTH=1" in chromium.text("#read-only")
    assert chromium.evaluate("document.querySelectorAll('form').length") == 0
    assert httpx.post(stack.url + "/dashboard/actions/evict", data={"model": REPO_ID}, timeout=10).status_code == 403
    _row_with(chromium.rows("#wanted"), REPO_ID)

    # It refreshes by itself: a job that ends after the page loaded shows up.
    later_id = _ok_job(stack.url, model)

    def shown() -> str:
        try:
            return chromium.text("#jobs")
        except BrowserError:
            return ""  # caught between two loads of the page

    deadline = time.monotonic() + 15
    while later_id not in shown():
        assert time.monotonic() < deadline, "the dashboard did not refresh itself within 15 s"
        time.sleep(0.25)
    chromium.wait_loaded()
    chromium.screenshot(OUT_DIR / "dashboard" / "dashboard-refreshed.png")


def test_the_dashboard_escapes_what_users_send(chromium, on_fs_stack, model):
    """An error line is the user's text: it must show as text, never as markup."""
    stack = on_fs_stack
    with pytest.raises(RemoteError):
        with model.trace(PROMPT, remote=True) as tracer:
            hidden = model.transformer.h[0].output  # noqa: F841
            raise ValueError("<b id='injected'>bold</b>")
    job_id = tracer.backend.job_id or tracer.backend.meta["job_id"]
    final_status(stack.url, job_id)
    chromium.open(stack.url + "/dashboard")
    assert _row_with(chromium.rows("#jobs"), job_id)[8] == "ValueError: <b id='injected'>bold</b>"
    assert chromium.evaluate("document.getElementById('injected')") is None


def test_with_auth_only_an_admin_key_opens_it(chromium, fs_stack, tmp_path):
    """NDIF_AUTH=1: no credentials 401 with a challenge, a key without the
    admin tag 403, an admin key 200 (a web process of its own on the same farm)."""
    from ndif_celery import config
    from ndif_celery.accounts import db
    from web.app import create_app

    settings = config.load({
        "NDIF_HOME": str(tmp_path), "NDIF_REDIS_URL": fs_stack.redis_url, "NDIF_AUTH": "1",
        "NDIF_AUTH_CACHE_S": "0", "NDIF_DATABASE_URL": f"sqlite:///{tmp_path / 'keys.db'}",
        # The farm's result directory: a web host must share it (store_fs.check_shared).
        "NDIF_RESULTS_DIR": str(config.load(fs_stack.env).results_dir),
    })
    engine = db.engine_for(settings.database_url)
    plain = db.create_key(engine, "user@example.org", ("trusted",))
    admin = db.create_key(engine, "admin@example.org", ("admin",))
    web = create_app(settings).test_client()

    def basic(key: str) -> dict:
        return {"Authorization": "Basic " + base64.b64encode(f"admin:{key}".encode()).decode()}

    answer = web.get("/dashboard")
    assert answer.status_code == 401
    assert answer.headers["WWW-Authenticate"].startswith("Basic realm=")
    answer = web.get("/dashboard", headers=basic("00000000-0000-0000-0000-000000000000"))
    assert answer.status_code == 401 and "WWW-Authenticate" in answer.headers
    answer = web.get("/dashboard", headers=basic(plain))
    assert answer.status_code == 403 and "not an admin key" in answer.get_data(as_text=True)
    answer = web.get("/dashboard", headers=basic(admin))
    assert answer.status_code == 200
    assert REPO_ID in answer.get_data(as_text=True)
    assert web.get("/dashboard", headers={"ndif-api-key": admin}).status_code == 401, "Basic credentials only"


@pytest.mark.pools("auth")
def test_with_auth_a_browser_signs_in_with_an_admin_key(chromium, stack_pool):
    """The same through gunicorn and a browser, on the shared auth farm: refused,
    then shown once the browser sends the admin key as the Basic password."""
    stack = stack_pool.get("auth")
    try:
        key = stack.cli("keys", "create", "--email", "ops@example.org", "--admin", check=True).stdout.split()[-1]
        plain = stack.cli("keys", "create", "--email", "dev@example.org", check=True).stdout.split()[-1]
        assert httpx.get(stack.url + "/dashboard").status_code == 401
        assert httpx.get(stack.url + "/dashboard", auth=("x", plain)).status_code == 403
        chromium.set_headers({"Authorization": "Basic " + base64.b64encode(f"ops:{key}".encode()).decode()})
        chromium.open(stack.url + "/dashboard")
        assert "Deployments" in chromium.text("body")
        worker = next(iter(stack.farm()["cluster"]["workers"]))
        _row_with(chromium.rows("#workers"), worker)
        chromium.screenshot(OUT_DIR / "dashboard" / "dashboard-auth.png")
    finally:
        chromium.set_headers({})
