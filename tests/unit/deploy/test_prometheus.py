"""Prometheus metrics without a stack: the deploy recipes
(``deploy/prometheus.yml``, its rules, ``deploy/grafana-dashboard.json``)
parse, and a worker whose metrics port is taken moves to the next one. What
the endpoints really answer is tests/e2e/monitoring/test_metrics.py.
"""

from __future__ import annotations

import json
import re
import socket

import httpx
import yaml

from tests.support.clients.metrics import DEPLOY, Scrape, deploy_rules


def test_a_taken_metrics_port_moves_to_the_next(tmp_path):
    from workers import metrics

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        got = metrics.start("127.0.0.1", port, lambda: 3)
    assert got is not None and port < got < port + metrics.PORT_TRIES
    answer = Scrape(httpx.get(f"http://127.0.0.1:{got}/metrics", timeout=5).text)
    assert answer.value("ndif_worker_resident_models") == 3
    assert metrics.start("127.0.0.1", 0, lambda: 0) is None, "port 0 turns the endpoint off"


# --- the deploy recipes -----------------------------------------------------------------


def test_prometheus_config_and_grafana_dashboard_parse():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"ndif-web", "ndif-workers", "flower"}
    for job in jobs.values():
        assert job.get("metrics_path", "/metrics") == "/metrics"
        assert all(re.fullmatch(r"[\w.-]+:\d+", t) for sc in job["static_configs"] for t in sc["targets"]), job
    rules = deploy_rules()
    assert rules
    for rule in rules:
        assert ("record" in rule) != ("alert" in rule), rule
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    assert dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["type"] and panel["title"] and panel["gridPos"]["w"] > 0, panel
        assert panel["targets"] and all(t["expr"] and t["refId"] for t in panel["targets"]), panel


# --- error kinds: the code and docs/monitoring.md name the same ----------------------------------


def test_every_error_kind_is_the_docs_and_the_ledgers():
    """The ``kind`` label of ``ndif_jobs_total`` takes exactly the kinds docs/monitoring.md
    lists, ``error`` (an ERROR sent without a kind) included, and the ledger's fallback is one."""
    from ndif_celery import wire
    from ndif_celery.accounts import ledger
    from ndif_celery.monitoring import metrics
    from ndif_celery.state import jobs

    text = (DEPLOY.parent / "docs" / "monitoring.md").read_text()
    paragraph = text.split("\nError kinds: ", 1)[1].split("\n\n", 1)[0]
    documented = set(re.findall(r"`([a-z_]+)`", paragraph))  # not `NDIF_...` nor `ndif-celery kill`
    assert documented == set(metrics.ERROR_KINDS), (documented, metrics.ERROR_KINDS)
    job = jobs.Job(id="j" * 32, model_key="m")
    assert ledger.summary(job, wire.ERROR, "no kind given", {})["error_kind"] in metrics.ERROR_KINDS
