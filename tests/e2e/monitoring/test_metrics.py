"""Prometheus metrics against a real stack (embedded Redis, gunicorn web, a
Celery worker, Flower) driven by the real nnsight client: the web's farm-wide
``/metrics``, the worker's own ``/metrics``, and the deploy recipes
(``deploy/prometheus.yml``, its rules, ``deploy/grafana-dashboard.json``)
checked against what those endpoints really answer. The recipes' parsing and
the metrics port are tests/unit/deploy/test_prometheus.py."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
import torch
from nnsight.intervention.backends.remote import RemoteError

from tests.support.clients.metrics import DEPLOY, Scrape, deploy_rules
from tests.support.clients.remote import final_status, slow_job
from tests.support.cases.tiny_model import PROMPT, REPO_ID

PHASES_RUN = ("queue", "deserialize", "run", "total")


def scrape(url: str) -> Scrape:
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200, (url, response.status_code, response.text[:500])
    assert response.headers["content-type"].startswith("text/plain"), response.headers["content-type"]
    return Scrape(response.text)


def worker_metrics_urls(stack) -> dict:
    """worker name -> its /metrics URL, from the port each worker recorded in /status."""
    workers = stack.farm()["cluster"]["workers"]
    assert workers, "no live worker"
    urls = {}
    for name, info in workers.items():
        assert info.get("metrics_port"), f"worker {name} has no metrics port in /status: {info}"
        urls[name] = f"http://127.0.0.1:{info['metrics_port']}/metrics"
    return urls


def scrape_workers(stack) -> dict:
    return {name: scrape(url) for name, url in worker_metrics_urls(stack).items()}


def total(scrapes: dict, name: str, **labels) -> float:
    return sum(s.value(name, **labels) for s in scrapes.values())


def _trace(model):
    with model.trace(PROMPT, remote=True) as tracer:
        hidden = model.transformer.h[0].output.save()
    return hidden, tracer.backend.meta


def _wait_worker_count(stack, name: str, at_least: float, timeout_s: float = 10.0) -> dict:
    """The worker scrapes once ``name`` (summed) reaches ``at_least``: the worker
    observes a job just after sending its final status."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = scrape_workers(stack)
        if total(workers, name) >= at_least or time.monotonic() > deadline:
            return workers
        time.sleep(0.1)


@pytest.fixture(scope="module")
def warm(fs_stack, model):
    """The model deployed and one job done, so every series has had a value."""
    import nnsight

    saved = nnsight.CONFIG.API.HOST
    nnsight.CONFIG.API.HOST = fs_stack.url
    try:
        _trace(model)
    finally:
        nnsight.CONFIG.API.HOST = saved
    return fs_stack


def test_a_completed_job_moves_the_farm_and_worker_series(warm, on_fs_stack, model):
    stack = on_fs_stack
    web_before, workers_before = scrape(stack.url + "/metrics"), scrape_workers(stack)
    with model.trace(PROMPT):
        local = model.transformer.h[0].output.save()
    hidden, meta = _trace(model)
    assert torch.equal(hidden, local)
    workers_after = _wait_worker_count(
        stack, "ndif_worker_execution_seconds_count", total(workers_before, "ndif_worker_execution_seconds_count") + 1
    )
    web_after = scrape(stack.url + "/metrics")

    def moved(name, before=web_before, after=web_after, **labels):
        return after.value(name, **labels) - before.value(name, **labels)

    assert moved("ndif_http_requests_total", route="/request", method="POST", status="200") == 1
    assert moved("ndif_http_requests_total", route="/metrics", method="GET", status="200") >= 1
    assert moved("ndif_jobs_total", outcome="COMPLETED", kind="none") == 1
    assert moved("ndif_jobs_total", outcome="ERROR") == 0
    for phase in PHASES_RUN:
        assert moved("ndif_job_phase_seconds_count", phase=phase) == 1, phase
        assert moved("ndif_job_phase_seconds_bucket", phase=phase, le="+Inf") == 1, phase
    assert meta["inline"] is True
    assert moved("ndif_job_phase_seconds_count", phase="upload") == 0, "an inline result is not uploaded"
    run_s = moved("ndif_job_phase_seconds_sum", phase="run")
    assert abs(run_s - meta["run_ms"] / 1000) < 0.002, (run_s, meta)
    assert moved("ndif_job_phase_seconds_sum", phase="total") >= run_s > 0
    assert moved("ndif_result_bytes_total") == meta["result_bytes"] > 0
    assert moved("ndif_payload_bytes_total") == meta["payload_bytes"] > 0
    assert web_after.value("ndif_workers") >= 1
    assert web_after.value("ndif_deployments", state="RUNNING") >= 1
    assert web_after.has("ndif_queue_depth", model=REPO_ID) and web_after.value("ndif_queue_depth", model=REPO_ID) == 0

    ran_on = meta["worker"]
    before, after = workers_before[ran_on], workers_after[ran_on]
    assert after.value("ndif_worker_execution_seconds_count") - before.value("ndif_worker_execution_seconds_count") == 1
    assert after.value("ndif_worker_jobs_total", outcome="COMPLETED") - before.value(
        "ndif_worker_jobs_total", outcome="COMPLETED") == 1
    assert after.value("ndif_worker_execution_seconds_sum") - before.value("ndif_worker_execution_seconds_sum") > 0
    assert after.value("ndif_worker_rss_bytes") > 50 * 1024 * 1024  # torch and a model are resident
    assert after.value("ndif_worker_resident_models") >= 1
    assert after.value("ndif_worker_model_load_seconds", model=REPO_ID) > 0
    assert after.value("ndif_worker_model_load_duration_seconds_count") >= 1
    assert after.has("ndif_worker_gpu_memory_bytes")


def test_an_error_job_counts_its_kind(warm, on_fs_stack, model):
    stack = on_fs_stack
    web_before, workers_before = scrape(stack.url + "/metrics"), scrape_workers(stack)
    with pytest.raises(RemoteError, match="no-such-key"):
        with model.trace(PROMPT, remote=True):
            hidden = model.transformer.h[0].output  # noqa: F841
            missing = {}["no-such-key"]  # the user's bug  # noqa: F841
    workers_after = _wait_worker_count(
        stack, "ndif_worker_jobs_total", total(workers_before, "ndif_worker_jobs_total") + 1
    )
    web_after = scrape(stack.url + "/metrics")
    assert web_after.value("ndif_jobs_total", outcome="ERROR", kind="user") - web_before.value(
        "ndif_jobs_total", outcome="ERROR", kind="user") == 1
    assert web_after.value("ndif_jobs_total", outcome="COMPLETED") == web_before.value("ndif_jobs_total", outcome="COMPLETED")
    assert web_after.value("ndif_jobs_total", outcome="ERROR", kind="server") == web_before.value(
        "ndif_jobs_total", outcome="ERROR", kind="server")
    assert total(workers_after, "ndif_worker_jobs_total", outcome="ERROR") - total(
        workers_before, "ndif_worker_jobs_total", outcome="ERROR") == 1


def test_queue_depth_shows_a_waiting_job(warm, on_fs_stack, model):
    stack = on_fs_stack
    holder = slow_job(model, steps=60)  # ~3 s on the worker
    waiting = slow_job(model)
    try:
        deadline = time.monotonic() + 20
        while True:
            web = scrape(stack.url + "/metrics")
            if web.value("ndif_queue_depth", model=REPO_ID) == 1:
                break
            assert time.monotonic() < deadline, "the waiting job never showed in ndif_queue_depth"
            time.sleep(0.1)
        assert web.value("ndif_queue_head_wait_seconds", model=REPO_ID) >= 0
    finally:
        for backend in (holder, waiting):
            final_status(stack.url, backend.job_id)
    assert scrape(stack.url + "/metrics").value("ndif_queue_depth", model=REPO_ID) == 0


# --- the deploy recipes -----------------------------------------------------------------

_SERIES = re.compile(r"\b((?:ndif|flower)_[a-z0-9_]+)\b")


def test_every_series_the_recipes_name_is_in_a_real_answer(warm):
    stack = warm
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    expressions += [rule["expr"] for rule in deploy_rules()]
    named = {name for expr in expressions for name in _SERIES.findall(expr)}
    assert len(named) >= 15, f"too few series found in the recipes: {sorted(named)}"
    answered = set(scrape(stack.url + "/metrics").names)
    for worker in scrape_workers(stack).values():
        answered |= worker.names
    answered |= scrape(stack.flower_url + "/metrics").names
    missing = sorted(named - answered)
    assert not missing, f"series named in deploy/ but not in any /metrics answer: {missing}"
