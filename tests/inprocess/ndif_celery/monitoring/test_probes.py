"""The health probes' judgement and alerts (``ndif_celery.monitoring.probes``) in the fast tier.

What a probe's answer must be (shape, finite, equal to its reference), and
what the beat does with it against a real embedded Redis: the reference
recorded by the first green probe, red and green recorded once per change,
the webhook POSTed to a real HTTP receiver on loopback (firing, then
resolved; retries and re-sends are tests/inprocess/ndif_celery/monitoring/test_alerts.py), the
series in ``/metrics``. The answers come from a scripted
runner here (the real one needs a farm to trace against); the real client
process, a real farm and real corrupted weights are tests/e2e/farm/test_operations.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from ndif_celery.farm import actions
from ndif_celery.monitoring import alerts, metrics, probes
from ndif_celery.state import registry
from tests.support.clocks import StepClock
from tests.support.clients.metrics import Scrape
from tests.support.stacks.servers import Receiver

KEY = actions.model_key_for("org/probed")
GOOD = {"model_key": KEY, "ok": True, "latency_s": 0.25, "worker": "w0", "shape": [1, 7, 50], "vocab": 50,
        "finite": True, "values": [0.5, -1.25, 3.0, 0.1, 0.2]}


@pytest.fixture
def receiver():
    server = Receiver()
    yield server
    server.close()


class Scripted:
    """Answers what the test says next, as the runner process would."""

    def __init__(self) -> None:
        self.next: dict = GOOD

    def probe(self, model_key: str, timeout_s: float) -> dict:
        return dict(self.next, model_key=model_key)

    def stop(self) -> None:
        pass


def _prober(settings, client, url: str = "", runner=None, clock=None) -> probes.Prober:
    """Each probe a minute after the last unless ``clock`` says otherwise: two red rounds in a row alert."""
    settings = dataclasses.replace(settings, alert_webhook_url=url, probe_interval_s=1.0, probe_timeout_s=5.0)
    return probes.Prober(settings, client, runner or Scripted(), name="test-prober",
                         clock=clock or StepClock(step_s=alerts.ALERT_AFTER_S))


def _serve(client, key: str = KEY) -> None:
    registry.register_worker(client, {"name": "w0", "pid": 1, "memory_bytes": 1 << 30})
    registry.set_deployment(client, "w0", key, registry.RUNNING)


# --- judging one answer --------------------------------------------------------------


def test_an_answer_is_judged_by_shape_finiteness_and_its_reference():
    assert probes.judge(GOOD, None) == (True, "")
    reference = {"values": GOOD["values"], "shape": GOOD["shape"], "recorded_at": 0}
    assert probes.judge(GOOD, reference) == (True, "")
    near = dict(GOOD, values=[v + 1e-6 for v in GOOD["values"]])
    assert probes.judge(near, reference)[0], "co-batching and devices move values by ~1e-6"
    off = dict(GOOD, values=[v + 0.5 for v in GOOD["values"]])
    ok, why = probes.judge(off, reference)
    assert not ok and "differ from the reference" in why and "the weights changed" in why
    assert probes.judge(dict(GOOD, finite=False), None) == (False, "the logits hold NaN or infinity")
    assert "shaped [1, 7, 49]" in probes.judge(dict(GOOD, shape=[1, 7, 49]), None)[1]
    assert probes.judge({"ok": False, "error": "RemoteError: boom"}, reference) == (False, "RemoteError: boom")


def test_targets_are_running_models_and_pinned_models_nobody_holds(redis_client):
    loading, pinned_gone = actions.model_key_for("org/loading"), actions.model_key_for("org/pinned")
    _serve(redis_client)
    registry.set_deployment(redis_client, "w0", loading, registry.DEPLOYING)
    actions.deploy(redis_client, pinned_gone, pinned=True, replicas=1, dtype="float16")
    actions.deploy(redis_client, actions.model_key_for("org/unpinned"), pinned=False, replicas=1, dtype=None)
    main = probes.runtime_of(KEY)
    assert probes.targets(redis_client) == sorted(
        [{"model_key": KEY, "dtype": None, "nnsight": main},
         {"model_key": pinned_gone, "dtype": "float16", "nnsight": main}],
        key=lambda t: t["model_key"])


# --- a beat's rounds -------------------------------------------------------------------


def test_red_then_green_is_recorded_and_posted_once_per_change(redis_client, embedded_settings, receiver):
    _serve(redis_client)
    runner = Scripted()
    prober = _prober(embedded_settings, redis_client, receiver.url, runner)
    [first] = prober.round()
    assert prober.courier.deliver() and first["ok"] and receiver.received == []
    assert json.loads(redis_client.hget(probes.REFERENCES, probes.reference_field(KEY, None)))["values"] == GOOD["values"]

    runner.next = dict(GOOD, values=[v * 3 for v in GOOD["values"]])  # the weights changed under it
    for _ in range(2):
        [red] = prober.round()
        assert prober.courier.deliver()
    assert not red["ok"] and red["failures"] == 2
    assert len(receiver.received) == 1, "one alert per change, not one per round"
    alert = receiver.received[0]
    assert alert["status"] == "firing" and alert["alert"] == "NdifProbeFailing" and alert["model"] == "org/probed"
    assert "differ from the reference" in alert["error"]

    scrape = Scrape(metrics.render(redis_client, top_keys=5).decode())
    labels = {"model": "org/probed", "nnsight": probes.runtime_of(KEY), "model_key": KEY}
    assert scrape.value("ndif_probe_ok", **labels) == 0.0 and scrape.has("ndif_probe_ok", **labels)
    assert scrape.value("ndif_probe_runs_total", result="failed", **labels) == 2.0

    runner.next = GOOD
    [green] = prober.round()
    assert prober.courier.deliver()
    assert green["ok"] and green["failures"] == 0
    assert [a["status"] for a in receiver.received] == ["firing", "resolved"]
    assert Scrape(metrics.render(redis_client).decode()).value("ndif_probe_ok", model="org/probed") == 1.0


def test_a_model_no_longer_served_is_forgotten_and_its_alert_resolved(redis_client, embedded_settings, receiver):
    _serve(redis_client)
    runner = Scripted()
    runner.next = {"ok": False, "error": "no answer within 5 s"}
    prober = _prober(embedded_settings, redis_client, receiver.url, runner)
    prober.round()
    prober.round()
    prober.courier.deliver()
    registry.remove_deployment(redis_client, "w0", KEY)
    assert prober.round() == []
    prober.courier.deliver()
    assert probes.results(redis_client) == []
    assert [a["status"] for a in receiver.received] == ["firing", "resolved"]
    assert "no longer deployed" in receiver.received[1]["text"]


def test_a_webhook_that_refuses_is_logged_without_its_token(redis_client, embedded_settings, caplog):
    refusing = Receiver(status=500)
    try:
        _serve(redis_client)
        runner = Scripted()
        runner.next = {"ok": False, "error": "boom"}
        prober = _prober(embedded_settings, redis_client, refusing.url, runner)
        prober.round()
        prober.round()
        assert not prober.courier.deliver(), "not taken: the courier retries it"
        assert refusing.received and refusing.received[0]["status"] == "firing"
    finally:
        refusing.close()
    logged = [r.getMessage() for r in caplog.records if "webhook" in r.getMessage()]
    assert logged and "did not take the firing alert" in logged[0] and "secret-token" not in logged[0]


def test_reset_forgets_the_reference(redis_client, embedded_settings):
    _serve(redis_client)
    _prober(embedded_settings, redis_client).round()
    assert probes.reset(redis_client, KEY) == 1 and redis_client.hlen(probes.REFERENCES) == 0


def test_the_web_refuses_a_probe_of_a_model_not_deployed_and_records_its_owner(redis_client, embedded_settings):
    from ndif_celery import intake
    from ndif_celery.accounts import auth
    from ndif_celery.errors import Refused

    settings = dataclasses.replace(embedded_settings, probe_api_key="probe-key")
    probe = auth.Identity(key_id=7, tags=("admin",))
    with pytest.raises(Refused) as refused:
        intake.check_probe(redis_client, settings, probe, {auth.HEADER: "probe-key"}, KEY,
                            registry.offered_keys(redis_client))
    assert refused.value.status == 409 and "does not deploy models" in refused.value.detail
    assert redis_client.get(probes.OWNER) == b"key:7"
    _serve(redis_client)
    intake.check_probe(redis_client, settings, probe, {auth.HEADER: "probe-key"}, KEY,
                            registry.offered_keys(redis_client))
    other = actions.model_key_for("org/elsewhere")
    intake.check_probe(redis_client, settings, auth.Identity(key_id=8), {auth.HEADER: "someone-else"}, other,
                        registry.offered_keys(redis_client))


def test_the_controller_ends_probe_jobs_left_waiting_for_an_evicted_model(redis_client, embedded_settings):
    """A probe accepted just before its model was evicted must not load it again:
    the controller ends the jobs when only the probe's wait for a model nobody holds
    or wants. Here the web's test client (auth off: the owner is ``anonymous``)
    stands for the probe's key, recorded as the web records it."""
    import io

    from ndif_celery import wire
    from ndif_celery.celery_app import make_app
    from ndif_celery.farm.controller import Controller
    from ndif_celery.state import jobs
    from web.app import create_app

    web = create_app(embedded_settings).test_client()
    envelope = json.dumps({"model_key": KEY, "session_id": "", "compress": False, "env": {}})
    answer = web.post("/request", data={"data": envelope, "blob": (io.BytesIO(b"trace"), "request")})
    assert answer.status_code == 200, answer.get_data(as_text=True)
    job_id = answer.get_json()["id"]
    redis_client.set(probes.OWNER, "anonymous")
    controller = Controller("w0", redis_client, make_app(embedded_settings), embedded_settings)
    controller.tick()
    final = json.loads(jobs.latest_status(redis_client, job_id))
    assert final["status"] == wire.ERROR and "does not deploy models" in final["description"]
    assert registry.live_deployments(redis_client) == [] and redis_client.hlen(registry.DEPLOYMENTS) == 0
