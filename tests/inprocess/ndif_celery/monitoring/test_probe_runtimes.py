"""One repo served twice, by a worker of the farm's own nnsight and by a worker of a
0.7.0 runtime, under the health probes and every view of the farm.

Each deployment is probed by the client of its own runtime (a runner per
runtime, as ``probes.Runner`` starts one under that runtime's interpreter;
here a stand-in that, like the real runner, answers only a key its client
builds), stays green over many rounds and pages no one; ``/metrics`` parses
with prometheus_client's own parser and never repeats a label set; the CLI's
tables and the dashboard show two rows told apart by their nnsight. Against
a real embedded Redis and the real web app; the real 0.7.0 client and
runtime worker under the real beat are tests/e2e/farm/test_probe_runtimes.py.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ndif_celery.celery_app import queue_for
from ndif_celery.farm import actions
from ndif_celery.host import doctor, runtimes
from ndif_celery.monitoring import metrics, probes
from ndif_celery.policy import client_versions
from ndif_celery.state import registry
from tests.support.clocks import StepClock

REPO = "org/shared"
OLD = "0.7.0"
MAIN = client_versions.MAIN
KEY = actions.model_key_for(REPO)
OLD_KEY = actions.model_key_for(REPO, nnsight=OLD)
GOOD = {"ok": True, "latency_s": 0.2, "shape": [1, 7, 50], "vocab": 50, "finite": True}


class RunnerPerRuntime:
    """Stands for ``probes.Runner``: made per runtime by the prober; its client builds
    only its own runtime's key, as the real runner checks (else the farm's answer is
    another deployment's), so a probe run by the wrong client fails."""

    made: list = []

    def __init__(self, settings, runtime: str = "") -> None:
        self.runtime = runtime
        self.probed: list[str] = []
        RunnerPerRuntime.made.append(self)

    def probe(self, model_key: str, timeout_s: float) -> dict:
        self.probed.append(model_key)
        if probes.runtime_of(model_key) != self.runtime:
            return {"model_key": model_key, "ok": False, "error": "RuntimeError: the client builds another key"}
        worker = "w-old" if self.runtime == OLD else "w-main"
        return dict(GOOD, model_key=model_key, worker=worker, values=[0.5, -1.0, 2.0])

    def stop(self) -> None:
        pass


@pytest.fixture
def two_runtimes(redis_client):
    """w-main (the farm's nnsight) and w-old (nnsight 0.7.0) hold REPO, each its own deployment."""
    for name, nnsight, key in (("w-main", "", KEY), ("w-old", OLD, OLD_KEY)):
        registry.register_worker(redis_client, {"name": name, "pid": 1, "memory_bytes": 1 << 30, "gpus": [],
                                                "memory_used_bytes": 0, "current_job": None,
                                                **({"nnsight": nnsight} if nnsight else {})})
        registry.set_deployment(redis_client, name, key, registry.RUNNING)
    return redis_client


def _prober(settings, client, monkeypatch, url: str = "") -> probes.Prober:
    RunnerPerRuntime.made = []
    monkeypatch.setattr(probes, "Runner", RunnerPerRuntime)
    settings = dataclasses.replace(settings, alert_webhook_url=url, probe_interval_s=60.0, probe_timeout_s=60.0)
    return probes.Prober(settings, client, name="test-prober", clock=StepClock(step_s=20.0))


def _unique_label_sets(text: str) -> dict:
    """Every sample's (name, labels) of a /metrics answer, as prometheus_client parses
    it; fails on a label set that comes twice (Prometheus drops such a scrape)."""
    seen: dict = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = (sample.name, tuple(sorted(sample.labels.items())))
            assert labels not in seen, f"{labels} twice: {seen[labels]} and {sample.value}"
            seen[labels] = sample.value
    return seen


def test_each_runtime_is_probed_by_its_own_client_and_both_stay_green(two_runtimes, embedded_settings, hook,
                                                                      monkeypatch):
    client = two_runtimes
    assert probes.targets(client) == sorted([{"model_key": KEY, "dtype": None, "nnsight": MAIN},
                                             {"model_key": OLD_KEY, "dtype": None, "nnsight": OLD}],
                                            key=lambda t: t["model_key"])
    prober = _prober(embedded_settings, client, monkeypatch, hook.url)
    for _ in range(30):  # forced rounds, 20 s apart on the prober's clock: ten minutes
        entries = prober.round()
        assert prober.courier.deliver()
        assert sorted((e["nnsight"], e["ok"]) for e in entries) == sorted([(MAIN, True), (OLD, True)]), entries
    assert hook.received == [], "no alert"
    assert {runner.runtime: set(runner.probed) for runner in RunnerPerRuntime.made} == {MAIN: {KEY}, OLD: {OLD_KEY}}
    references = {field.decode() for field in client.hkeys(probes.REFERENCES)}
    assert references == {probes.reference_field(KEY, None), probes.reference_field(OLD_KEY, None)}

    seen = _unique_label_sets(metrics.render(client).decode())
    oks = {dict(labels)["nnsight"]: value for (name, labels), value in seen.items() if name == "ndif_probe_ok"}
    assert oks == {MAIN: 1.0, OLD: 1.0}
    runs = {(dict(labels)["nnsight"], dict(labels)["result"]): value for (name, labels), value in seen.items()
            if name == "ndif_probe_runs_total"}
    assert runs == {(MAIN, "ok"): 30.0, (OLD, "ok"): 30.0}


def test_metrics_never_repeat_a_label_set(two_runtimes, embedded_settings, monkeypatch):
    """Both deployments' queues, probes, an old repo-only probe count and a result of each:
    every series that names a deployment names its runtime and key too."""
    client = two_runtimes
    for key in (KEY, OLD_KEY):  # each deployment's queue, as the intake registers it
        client.sadd(registry.QUEUES, queue_for(key))
        client.hset(registry.QUEUE_MODELS, queue_for(key), key)
    client.hset(probes.RUNS, f"{REPO}|ok", 5)  # counted per repo before runtimes were told apart
    prober = _prober(embedded_settings, client, monkeypatch)
    prober.round()
    seen = _unique_label_sets(metrics.render(client).decode())
    for name in ("ndif_queue_depth", "ndif_queue_head_wait_seconds", "ndif_probe_ok", "ndif_probe_queued",
                 "ndif_probe_latency_seconds", "ndif_probe_last_run_timestamp_seconds"):
        series = [dict(labels) for (sample, labels) in seen if sample == name]
        assert sorted((s["model"], s["nnsight"]) for s in series) == sorted([(REPO, MAIN), (REPO, OLD)]), series
        assert {s["model_key"] for s in series} == {KEY, OLD_KEY}


def test_every_table_tells_the_two_deployments_apart(two_runtimes, embedded_settings, monkeypatch, tmp_path):
    from click.testing import CliRunner
    from sqlalchemy.orm import Session

    from ndif_celery.accounts import db
    from ndif_celery.cli import main
    from web.app import create_app

    client = two_runtimes
    actions.deploy(client, KEY, pinned=True, replicas=1, dtype=None)
    actions.deploy(client, OLD_KEY, pinned=True, replicas=1, dtype=None)
    for key in (KEY, OLD_KEY):  # each deployment's queue, as the intake registers it
        client.sadd(registry.QUEUES, queue_for(key))
        client.hset(registry.QUEUE_MODELS, queue_for(key), key)
    _prober(embedded_settings, client, monkeypatch).round()
    database = f"sqlite:///{tmp_path / 'ledger.db'}"
    now = datetime.datetime.now(datetime.timezone.utc)
    with Session(db.engine_for(database)) as session:
        for job_id, key, worker in (("job-main", KEY, "w-main"), ("job-old", OLD_KEY, "w-old")):
            session.add(db.LedgerEntry(job_id=job_id, owner="anonymous", model=REPO, model_key=key,
                                       outcome="COMPLETED", worker=worker, received_at=now, finished_at=now,
                                       run_ms=1000, devices=0))
        session.commit()
    env = {**{name: None for name in os.environ if name.startswith("NDIF_")},
           "NDIF_HOME": str(tmp_path / "home"), "NDIF_REDIS_URL": embedded_settings.redis_url,
           "NDIF_DATABASE_URL": database}

    def rows_of(*args: str) -> list[str]:
        result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return [line for line in result.output.splitlines() if REPO in line]

    for args in (("probes",), ("deployments",), ("jobs",), ("usage",), ("status",)):
        rows = rows_of(*args)
        runtimes_shown = sorted(version for row in rows for version in (MAIN, OLD)
                                if re.search(rf"\b{re.escape(version)}\b", row))
        assert len(rows) == 2 and runtimes_shown == sorted([MAIN, OLD]), (args, rows)

    web = create_app(dataclasses.replace(embedded_settings, database_url=database)).test_client()
    page = web.get("/dashboard").get_data(as_text=True)
    for table in ("wanted", "deployments", "queues", "probes", "jobs"):
        body = re.search(rf'<table id="{table}">(.*?)</table>', page, re.S).group(1)
        rows = [row for row in re.findall(r"<tr>(.*?)</tr>", body, re.S) if f"<td>{REPO}</td>" in row]
        assert sorted(version for row in rows for version in (MAIN, OLD) if f"<td>{version}</td>" in row) == \
            sorted([MAIN, OLD]), (table, rows)
    history = re.findall(r'data-model="org/shared" data-nnsight="([^"]+)" data-period="24h"', page)
    assert sorted(history) == sorted([MAIN, OLD])

    result = CliRunner().invoke(main, ["probes", "--reset", REPO, "--nnsight", OLD], env=env, catch_exceptions=False)
    assert "1 reference(s) forgotten" in result.output
    assert {field.decode() for field in client.hkeys(probes.REFERENCES)} == {probes.reference_field(KEY, None)}


def test_a_runtime_is_probed_under_its_own_interpreter(embedded_settings, tmp_path):
    home = tmp_path / "home"
    assert probes.runtime_interpreter(home, OLD) == runtimes.folder(home, OLD) / "bin" / "python"
    settings = dataclasses.replace(embedded_settings, home=home)
    assert probes.Runner(settings, MAIN).interpreter() == probes.Runner(settings).interpreter()
    missing = probes.Runner(settings, OLD).probe(OLD_KEY, 5.0)
    assert not missing["ok"] and f"ndif-celery runtime add {OLD}" in missing["error"], missing
    python = runtimes.folder(home, OLD) / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(os.path.realpath(os.sys.executable))
    assert probes.Runner(settings, OLD).interpreter() == str(python)


def test_doctor_lists_an_added_runtime_no_worker_serves(redis_client, embedded_settings, tmp_path):
    home = tmp_path / "home"
    added = runtimes.folder(home, OLD)
    added.mkdir(parents=True)
    (added / runtimes.RECORD).write_text(json.dumps({"version": OLD, "python": "3", "packages": {"nnsight": OLD}}))
    settings = dataclasses.replace(embedded_settings, home=home, probe_interval_s=60.0)
    registry.register_worker(redis_client, {"name": "w-main", "pid": 1})
    [check] = doctor.check_runtime_workers(settings, stack_running=True)
    assert check.status == doctor.WARN and "no live worker serves it" in check.detail
    assert f"ndif-celery worker --nnsight {OLD}" in check.fix
    registry.register_worker(redis_client, {"name": "w-old", "pid": 2, "nnsight": OLD})
    registry.register_worker(redis_client, {"name": "w-063", "pid": 3, "nnsight": "0.6.3"})
    checks = doctor.check_runtime_workers(settings, stack_running=True)
    assert [(c.name, c.status) for c in checks] == [(f"nnsight {OLD}", doctor.OK), ("nnsight 0.6.3", doctor.WARN)]
    assert checks[1].fix == "ndif-celery runtime add 0.6.3" and "cannot probe" in checks[1].detail
