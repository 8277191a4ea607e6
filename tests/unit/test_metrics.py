"""Prometheus metrics without a stack: the deploy recipes
(``deploy/prometheus.yml``, its rules, ``deploy/grafana-dashboard.json``)
parse, and a worker whose metrics port is taken moves to the next one. What
the endpoints really answer is tests/e2e/api/test_metrics.py.
"""

from __future__ import annotations

import json
import re
import socket

import httpx
import yaml

from tests.support.metrics import DEPLOY, Scrape, deploy_rules


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
