"""Probe alerts on a real farm: the beat ``up`` starts, probing a pinned tiny
model every second with the real nnsight client, and a webhook receiver on
loopback that goes down and comes back (``tests.support.stacks.webhook.Hook``).

The probe turns red when its reference (``ndif:probes:references``, what the
first green probe answered) no longer matches what the model answers: here the
test scales the stored reference, which the beat then sees exactly as it sees
corrupted weights (tests/e2e/farm/test_operations.py corrupts the weights
themselves). The delivery logic, its backoff and the re-sends are unit-tested in
tests/inprocess/ndif_celery/monitoring/test_alerts.py.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import redis

from ndif_celery.farm.actions import model_key_for
from ndif_celery.monitoring import alerts, probes
from tests.support.stacks.stack import Stack
from tests.support.cases.tiny_model import build_tiny_gpt2
from tests.support.stacks.webhook import Hook

REPO = "alerts/boot"
KEY = model_key_for(REPO)
LEASE_S = max(10.0, 3 * 1 + 15)  # the probes' lease with these settings (probes.Prober's lease.ms)


@pytest.fixture(scope="module")
def farm(tmp_path_factory, hf_home):
    build_tiny_gpt2(hf_home, REPO, n_layer=1, seed=71)
    hook = Hook().start()
    stack = Stack(tmp_path_factory.mktemp("alerts") / "home", env={
        "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "NDIF_DEPLOYMENTS": f"[{{repo: {REPO}, pin: true}}]",
        "NDIF_PROBE_INTERVAL_S": "1", "NDIF_PROBE_TIMEOUT_S": "15", "NDIF_PROBE_API_KEY": "probe-key",
        "NDIF_ALERT_WEBHOOK_URL": hook.url,
    })
    try:
        stack.start()
        yield stack, hook, redis.Redis.from_url(stack.redis_url)
    finally:
        stack.discard()
        hook.stop()


def _until(check, what: str, stack: Stack, timeout_s: float = 90.0):
    return stack.until(check, what, timeout_s)


def _probe(client) -> dict:
    raw = client.hget(probes.PROBES, KEY)
    return json.loads(raw) if raw else {}


def _alerts(hook: Hook, status: str) -> list:
    return [a for a in hook.received if a["status"] == status and a["model"] == REPO]


def _skew_reference(client, factor: float) -> None:
    [field] = [f for f in client.hkeys(probes.REFERENCES) if f.decode().startswith(KEY + "|")]
    reference = json.loads(client.hget(probes.REFERENCES, field))
    reference["values"] = [v * factor for v in reference["values"]]
    client.hset(probes.REFERENCES, field, json.dumps(reference))


def _beat_log(stack: Stack) -> str:
    return (stack.logs_dir / "beat.log").read_text(errors="replace")


def test_an_alert_lost_to_a_down_receiver_arrives_once_it_is_back(farm):
    stack, hook, client = farm
    _until(lambda: _probe(client).get("ok"), "the pinned model's probe green", stack, 180)
    assert hook.received == []

    hook.stop()  # down: its port refuses connections
    _skew_reference(client, 3.0)
    red = _until(lambda: (lambda p: p if p and not p["ok"] else None)(_probe(client)), "the probe red", stack)
    assert "differ from the reference" in red["error"]
    # The alert waits for the probe to fail for a minute (alerts.ALERT_AFTER_S), then its delivery fails.
    _until(lambda: "did not take the firing alert of alerts/boot" in _beat_log(stack), "a failed delivery", stack,
           alerts.ALERT_AFTER_S + 30)
    rounds = _probe(client)["failures"]
    time.sleep(4)
    assert _probe(client)["failures"] > rounds, "the probes go on while the webhook is down"

    hook.start()
    [firing] = _until(lambda: _alerts(hook, "firing"), "the lost firing alert", stack, 90)
    assert "differ from the reference" in firing["error"] and firing["farm"] == stack.url
    time.sleep(5)  # rounds and retries go on: nothing is sent twice
    assert len(hook.received) == 1, hook.received

    _skew_reference(client, 1 / 3.0)
    _until(lambda: _alerts(hook, "resolved"), "the resolved alert", stack, 60)
    time.sleep(3)
    assert [a["status"] for a in hook.received] == ["firing", "resolved"]

    log = _beat_log(stack)
    assert f"127.0.0.1:{hook.port}/..." in log
    assert "secret-token" not in log and "also-secret" not in log, "the URL's path and query are never logged"


def test_a_restarted_beat_sends_the_red_models_again(farm):
    stack, hook, client = farm
    _skew_reference(client, 3.0)
    _until(lambda: len(_alerts(hook, "firing")) == 2, "the second firing alert, a minute red", stack,
           alerts.ALERT_AFTER_S + 60)
    old = stack.pids()["beat"]
    os.killpg(old, signal.SIGKILL)  # the beat and its probe runner
    _until(lambda: stack.pids().get("beat") not in (None, old), "the beat restarted", stack, 60)
    # The new beat leads once the dead one's lease expires, and sends what is red again.
    _until(lambda: len(_alerts(hook, "firing")) == 3, "the red model sent again", stack, LEASE_S + 60)
    time.sleep(3)
    assert [a["status"] for a in hook.received] == ["firing", "resolved", "firing", "firing"]
    _skew_reference(client, 1 / 3.0)
    _until(lambda: _alerts(hook, "resolved")[1:], "resolved once more", stack, 60)
