"""Alert delivery (``ndif_celery.monitoring.alerts``: the prober's ``Courier`` and its
``deliver``) against a real embedded Redis and real HTTP receivers on loopback.

A receiver that is down (its port closed), answers 500 or does not answer in
time leaves the alert pending; it arrives once the receiver takes alerts
again, once. A changed URL and a restarted beat get the state of every red
model again. The probes' answers come from a scripted runner, as in
tests/inprocess/ndif_celery/monitoring/test_probes.py; a real beat on a real stack is
tests/e2e/farm/test_alerts.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time

from ndif_celery.farm import actions
from ndif_celery.monitoring import alerts, probes
from ndif_celery.state import registry
from tests.support.clocks import StepClock
from tests.support.stacks.webhook import Hook

KEY = actions.model_key_for("org/alerted")
OTHER = actions.model_key_for("org/other")
GOOD = {"ok": True, "latency_s": 0.25, "worker": "w0", "shape": [1, 7, 50], "vocab": 50,
        "finite": True, "values": [0.5, -1.25, 3.0, 0.1, 0.2]}
RED = {"ok": False, "error": "no answer within 5 s"}


class Scripted:
    """Answers what the test says for each model, as the runner process would."""

    def __init__(self) -> None:
        self.answers: dict = {}

    def probe(self, model_key: str, timeout_s: float) -> dict:
        return dict(self.answers.get(model_key, GOOD), model_key=model_key)

    def stop(self) -> None:
        pass


def _prober(settings, client, url, runner, post=alerts.post_json, name="test-prober", clock=None) -> probes.Prober:
    """Each probe a minute after the last (a clock of its own unless given): two red rounds in a row alert."""
    settings = dataclasses.replace(settings, alert_webhook_url=url, probe_interval_s=0.2, probe_timeout_s=5.0)
    return probes.Prober(settings, client, runner, post=post, name=name,
                         clock=clock or StepClock(step_s=alerts.ALERT_AFTER_S))


def _serve(client, *keys: str) -> None:
    registry.register_worker(client, {"name": "w0", "pid": 1, "memory_bytes": 1 << 30})
    for key in keys:
        registry.set_deployment(client, "w0", key, registry.RUNNING)


def _statuses(received: list) -> list:
    return [(a["model"], a["status"]) for a in received]


def test_the_backoff_doubles_from_one_second_up_to_a_minute():
    assert [alerts.retry_delay(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]


def test_an_alert_lost_to_a_down_receiver_arrives_once_it_is_back(redis_client, embedded_settings, hook):
    _serve(redis_client, KEY)
    runner = Scripted()
    prober = _prober(embedded_settings, redis_client, hook.url, runner)
    prober.round()
    assert prober.courier.deliver() and hook.received == []

    hook.stop()
    runner.answers[KEY] = RED
    prober.round()
    assert prober.courier.deliver(), "red for no time yet: nothing to send"
    prober.round()
    assert not prober.courier.deliver(), "red for a minute, connection refused: not taken"
    prober.round()
    assert not prober.courier.deliver()

    hook.start()
    assert prober.courier.deliver()
    assert _statuses(hook.received) == [("org/alerted", "firing")]
    prober.round()
    assert prober.courier.deliver() and len(hook.received) == 1, "taken once: not sent again"

    runner.answers[KEY] = GOOD
    hook.status = 500
    prober.round()
    assert not prober.courier.deliver()
    hook.status = 200
    assert prober.courier.deliver() and prober.courier.deliver()
    assert _statuses(hook.received) == [("org/alerted", "firing"), ("org/alerted", "resolved")]


def test_a_model_that_went_red_and_green_while_the_receiver_was_down_is_not_news(
        redis_client, embedded_settings, hook):
    _serve(redis_client, KEY)
    runner = Scripted()
    prober = _prober(embedded_settings, redis_client, hook.url, runner)
    hook.stop()
    runner.answers[KEY] = RED
    prober.round()
    prober.round()
    assert not prober.courier.deliver()
    runner.answers[KEY] = GOOD
    prober.round()
    hook.start()
    assert prober.courier.deliver() and hook.received == []


def test_a_receiver_that_does_not_answer_in_time_is_retried(redis_client, embedded_settings, hook):
    _serve(redis_client, KEY)
    runner = Scripted()
    runner.answers[KEY] = RED
    hurried = functools.partial(alerts.post_json, timeout_s=0.5)
    prober = _prober(embedded_settings, redis_client, hook.url, runner, post=hurried)
    hook.hang_s, hook.status = 2.0, 504  # stuck, then gives up on it (one it took late would come twice)
    prober.round()
    prober.round()
    assert not prober.courier.deliver()
    hook.hang_s, hook.status = 0.0, 200
    assert prober.courier.deliver()
    assert _statuses(hook.received) == [("org/alerted", "firing")]


def test_a_restarted_beat_and_a_changed_url_get_every_red_model_again(redis_client, embedded_settings, hook):
    _serve(redis_client, KEY, OTHER)
    runner = Scripted()
    runner.answers[KEY] = RED
    clock = StepClock(step_s=alerts.ALERT_AFTER_S)  # one time for the three beats
    first = _prober(embedded_settings, redis_client, hook.url, runner, name="beat-1", clock=clock)
    assert first.lead()
    first.round()
    first.round()
    assert first.courier.deliver() and first.courier.deliver()
    assert _statuses(hook.received) == [("org/alerted", "firing")]

    # The beat restarts (its lease gone with it), same URL: what is red now is sent again, once.
    redis_client.delete(probes.LEADER)
    restarted = _prober(embedded_settings, redis_client, hook.url, runner, name="beat-2", clock=clock)
    assert restarted.lead()
    assert restarted.courier.deliver() and restarted.courier.deliver()
    assert _statuses(hook.received) == [("org/alerted", "firing")] * 2
    assert restarted.lead() and restarted.courier.deliver(), "renewing its lease is no restart"
    assert len(hook.received) == 2

    # A new URL was never told: it gets every red model; the old one hears nothing more.
    other_hook = Hook().start()
    try:
        moved = _prober(embedded_settings, redis_client, other_hook.url, runner, name="beat-2", clock=clock)
        moved.round()
        assert moved.courier.deliver() and moved.courier.deliver()
        assert _statuses(other_hook.received) == [("org/alerted", "firing")]
        assert len(hook.received) == 2
        runner.answers[KEY] = GOOD
        moved.round()
        assert moved.courier.deliver()
        assert _statuses(other_hook.received) == [("org/alerted", "firing"), ("org/alerted", "resolved")]
    finally:
        other_hook.stop()
    assert all(a["model"] != "org/other" for a in hook.received + other_hook.received), "a green model is not news"


def test_the_probes_go_on_while_the_webhook_hangs(redis_client, embedded_settings, hook):
    """The real threads: the prober's loop and its courier, with a receiver that
    answers only after 3 s, and 504 (a 2 s POST timeout): rounds keep coming
    meanwhile, and the alert arrives, once, when the receiver answers again."""
    _serve(redis_client, KEY)
    runner = Scripted()
    runner.answers[KEY] = RED
    hook.hang_s, hook.status = 3.0, 504
    hurried = functools.partial(alerts.post_json, timeout_s=2.0)
    prober = _prober(embedded_settings, redis_client, hook.url, runner, post=hurried)
    prober.start()
    try:
        time.sleep(2.5)
        failures = json.loads(redis_client.hget(probes.PROBES, KEY))["failures"]
        assert failures >= 5, f"only {failures} rounds in 2.5 s at 0.2 s apart: the probes waited on the webhook"
        assert hook.received == []
        hook.hang_s, hook.status = 0.0, 200
        deadline = time.monotonic() + 15
        while not hook.received and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # rounds and the courier's passes go on: nothing more is sent
        assert _statuses(hook.received) == [("org/alerted", "firing")]
    finally:
        prober.stopping.set()
        prober.join(10)


def test_what_goes_wrong_is_logged_without_the_urls_path_or_query(redis_client, embedded_settings, caplog):
    hook = Hook()  # never started: connection refused
    _serve(redis_client, KEY)
    runner = Scripted()
    runner.answers[KEY] = RED
    prober = _prober(embedded_settings, redis_client, hook.url, runner)
    prober.round()
    prober.round()
    assert not prober.courier.deliver()
    # urllib repeats the whole URL in some errors (a control character in the path, say).
    assert "secret-token" not in alerts._why(ValueError(f"URL can't contain control characters. {hook.url!r}"),
                                             hook.url)
    bad = _prober(embedded_settings, redis_client, "htp://127.0.0.1/hook/secret-token", runner)
    assert bad.courier.deliver()
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "did not take the firing alert of org/alerted" in logged and f"127.0.0.1:{hook.port}/..." in logged
    assert "NDIF_ALERT_WEBHOOK_URL must begin with http:// or https://" in logged
    assert "secret-token" not in logged and "also-secret" not in logged
