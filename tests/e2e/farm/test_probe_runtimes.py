"""The health probes of one repo served by a 0.8.1 worker and a 0.7.0 runtime's worker.

A real stack (``up``: the farm's own worker, one worker of the 0.7.0 runtime
through ``NDIF_RUNTIMES``, the beat probing every 2 s, a webhook receiver on
loopback) with both deployments of the tiny model pinned. The 0.7.0
deployment's probe runs under the runtime's interpreter with the real 0.7.0
client (``tests/support/clients/client_envs.py`` makes the runtime from the package
index once per checkout). Both probes stay green over many rounds, no alert
goes out, ``/metrics`` parses with unique label sets, and every CLI table and
the dashboard tell the two deployments apart. The same in the fast tier, with
scripted runners: tests/inprocess/ndif_celery/monitoring/test_probe_runtimes.py.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from ndif_celery.farm.actions import model_key_for
from ndif_celery.monitoring import probes
from ndif_celery.policy import client_versions
from tests.support.clients import client_envs
from tests.support.stacks.stack import Stack, offline_env
from tests.support.cases.tiny_model import REPO_ID
from tests.support.stacks.webhook import Hook

OLD = "0.7.0"
MAIN = client_versions.MAIN
KEYS = {MAIN: model_key_for(REPO_ID), OLD: model_key_for(REPO_ID, nnsight=OLD)}
ROUNDS = 8  # green probes of each deployment before the checks


@pytest.fixture(scope="module")
def farm(tmp_path_factory, hf_home):
    home = tmp_path_factory.mktemp("probe-runtimes") / "home"
    client_envs.link_into(home, client_envs.shared(OLD))
    hook = Hook().start()
    stack = Stack(home, env={
        **offline_env(hf_home), "NDIF_RUNTIMES": OLD,
        "NDIF_DEPLOYMENTS": f'[{{repo: {REPO_ID}, pin: true}}, {{repo: {REPO_ID}, pin: true, nnsight: "{OLD}"}}]',
        "NDIF_PROBE_INTERVAL_S": "2", "NDIF_PROBE_TIMEOUT_S": "60", "NDIF_PROBE_API_KEY": "probe-key",
        "NDIF_ALERT_WEBHOOK_URL": hook.url,
    })
    try:
        stack.start()
        yield stack, hook, redis.Redis.from_url(stack.redis_url)
    finally:
        stack.discard()
        hook.stop()


def _results(client) -> dict:
    return {row["nnsight"]: row for row in probes.results(client) if row["repo"] == REPO_ID}


def _green_rounds(client) -> dict:
    counts = {key: 0 for key in KEYS.values()}
    for field, count in client.hgetall(probes.RUNS).items():
        key, _, result = field.decode().rpartition("|")
        if key in counts and result == "ok":
            counts[key] = int(count)
    return counts


def test_both_runtimes_probes_stay_green_and_every_view_tells_them_apart(farm):
    stack, hook, client = farm
    stack.until(lambda: {v: r.get("ok") for v, r in _results(client).items()} == {MAIN: True, OLD: True},
                "both deployments' probes green", timeout_s=420)
    stack.until(lambda: min(_green_rounds(client).values()) >= ROUNDS, f"{ROUNDS} green probes of each",
                timeout_s=300)
    results = _results(client)
    assert all(row["failures"] == 0 for row in results.values()), results
    assert results[OLD]["model_key"] == KEYS[OLD]
    assert _green_rounds(client) and not any(
        int(count) for field, count in client.hgetall(probes.RUNS).items() if field.decode().endswith("|failed"))
    assert hook.received == [], "no alert"

    seen = {}
    for family in text_string_to_metric_families(httpx.get(stack.url + "/metrics", timeout=30).text):
        for sample in family.samples:
            labels = (sample.name, tuple(sorted(sample.labels.items())))
            assert labels not in seen, f"{labels} exported twice"
            seen[labels] = sample.value
    oks = {dict(labels)["nnsight"]: value for (name, labels), value in seen.items()
           if name == "ndif_probe_ok" and dict(labels)["model"] == REPO_ID}
    assert oks == {MAIN: 1.0, OLD: 1.0}

    for args in (("probes",), ("deployments",), ("status",), ("jobs", "--probes"), ("usage", "--probes")):
        out = stack.cli(*args, check=True).stdout
        rows = [line for line in out.splitlines() if REPO_ID in line]
        shown = {version for row in rows for version in (MAIN, OLD) if re.search(rf"\b{re.escape(version)}\b", row)}
        assert shown == {MAIN, OLD}, (args, out)
        if args[0] in ("probes", "deployments", "status"):
            assert len(rows) == 2, (args, out)

    page = httpx.get(stack.url + "/dashboard", timeout=30).text
    for table in ("deployments", "probes"):
        body = re.search(rf'<table id="{table}">(.*?)</table>', page, re.S).group(1)
        rows = [row for row in re.findall(r"<tr>(.*?)</tr>", body, re.S) if f"<td>{REPO_ID}</td>" in row]
        assert sorted(v for row in rows for v in (MAIN, OLD) if f"<td>{v}</td>" in row) == sorted([MAIN, OLD]), rows
    assert json.loads(stack.cli("probes", "--json", check=True).stdout)
