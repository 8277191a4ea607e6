"""A busy model is not a broken one: the health probe in a line of users' jobs, and the
"failed for a minute" rule of its alert (``ndif_celery.monitoring.probes``, ``state.turns``).

The real intake (the web's test client, auth off, the probe known by its key
``NDIF_PROBE_API_KEY``) parks the jobs in a real embedded Redis, in the order
a worker would take them. A worker taking and running them is stood for by
the registry (its ``current_job``) and by removing a job from its line; the
probe's client is a scripted runner that sends the probe's request through
the same intake and then answers as the real runner does when its time is up.
Time is a clock the test drives, so "a minute" costs nothing. A real beat,
worker and client against a real stack are tests/e2e/farm/test_alerts.py.
"""

from __future__ import annotations

import dataclasses
import io
import json

from ndif_celery.accounts import auth
from ndif_celery.celery_app import queue_for
from ndif_celery.farm import actions
from ndif_celery.monitoring import metrics, probes
from ndif_celery.state import queues, registry
from tests.support.clocks import StepClock
from tests.support.clients.metrics import Scrape

KEY = actions.model_key_for("org/busy")
PROBE_KEY = "probe-key"
GOOD = {"ok": True, "latency_s": 0.3, "worker": "w0", "shape": [1, 7, 50], "vocab": 50, "finite": True,
        "values": [0.5, -1.25, 3.0, 0.1, 0.2]}
LATE = {"ok": False, "timed_out": True, "error": "no answer within 60 s (NDIF_PROBE_TIMEOUT_S)"}


def _settings(embedded_settings, **changes):
    return dataclasses.replace(embedded_settings, **{"probe_api_key": PROBE_KEY, "probe_interval_s": 60.0,
                                                     "probe_timeout_s": 60.0, **changes})


def _web(settings):
    from web.app import create_app

    return create_app(settings).test_client()


def _send(web, probe: bool = False) -> str:
    """A request for KEY through the intake: a user's, or the probe's (its key in the header)."""
    envelope = json.dumps({"model_key": KEY, "session_id": "", "compress": False, "env": {}})
    answer = web.post("/request", data={"data": envelope, "blob": (io.BytesIO(b"trace"), "request")},
                      headers={auth.HEADER: PROBE_KEY} if probe else {})
    assert answer.status_code == 200, answer.get_data(as_text=True)
    return answer.get_json()["id"]


def _serve(client, running: str = "") -> None:
    """w0 holds KEY, running ``running`` (a job it took from the line)."""
    registry.register_worker(client, {"name": "w0", "pid": 1, "memory_bytes": 1 << 30, "current_job": running or None})
    registry.set_deployment(client, "w0", KEY, registry.RUNNING)


def _line(client) -> list[str]:
    return [entry.job.id for entry in queues.waiting(client, queue_for(KEY))]


def _take(client, job_id: str) -> None:
    """A worker took ``job_id`` from the line and runs it."""
    assert queues.remove(client, queue_for(KEY), job_id) is not None
    _serve(client, running=job_id)


class ThroughTheIntake:
    """The probe's client: its request goes through the real intake, then it answers
    ``answer`` (LATE: its time ran out while the job waited), as probe_runner does."""

    def __init__(self, web) -> None:
        self.web = web
        self.answer = LATE
        self.sent: list[str] = []

    def probe(self, model_key: str, timeout_s: float) -> dict:
        self.sent.append(_send(self.web, probe=True))
        return dict(self.answer, model_key=model_key)

    def stop(self) -> None:
        pass


def test_a_probe_takes_the_front_of_the_line_not_the_back(redis_client, embedded_settings):
    settings = _settings(embedded_settings)
    web = _web(settings)
    _serve(redis_client)
    first = _send(web)
    _take(redis_client, first)  # one long job runs
    waiting = [_send(web) for _ in range(2)]  # two more wait
    probe = _send(web, probe=True)
    later = _send(web)
    assert _line(redis_client) == [probe, *waiting, later], "the probe waits for the job running, not the line"
    assert redis_client.hget(probes.SENT, KEY).decode() == probe
    assert probes.queued_behind(redis_client, KEY) == 1, "the job its worker runs"


def test_a_probe_behind_three_long_jobs_is_queued_and_no_alert_goes_out(redis_client, embedded_settings, hook):
    """First in, first out (NDIF_FAIR_TURNS off): the probe waits behind three 35 s jobs,
    its client's 60 s run out. That is "queued behind 3 jobs", not a failure, over as many
    rounds as the line takes, and no second probe joins the line meanwhile."""
    settings = _settings(embedded_settings, fair_turns=False, alert_webhook_url=hook.url)
    web = _web(settings)
    _serve(redis_client)
    jobs = [_send(web) for _ in range(3)]
    _take(redis_client, jobs[0])
    runner = ThroughTheIntake(web)
    prober = probes.Prober(settings, redis_client, runner, name="test-prober", clock=StepClock(step_s=60.0))

    [entry] = prober.round()
    assert entry["state"] == probes.QUEUED and entry["note"] == "queued behind 3 jobs", entry
    assert entry["ok"] and prober.courier.deliver() and hook.received == []
    assert _line(redis_client) == [*jobs[1:], runner.sent[0]]

    for job in jobs[1:]:  # a round a minute; each 35 s job done in turn
        _take(redis_client, job)
        [entry] = prober.round()
        assert entry["state"] == probes.QUEUED and prober.courier.deliver()
    assert entry["note"] == "queued behind 1 job" and len(runner.sent) == 1, "one probe in the line at a time"
    scrape = Scrape(metrics.render(redis_client).decode())
    assert scrape.value("ndif_probe_ok", model="org/busy") == 1.0
    assert scrape.value("ndif_probe_queued", model="org/busy") == 1.0

    _take(redis_client, runner.sent[0])  # the probe's own job ran; the next probe answers in time
    _serve(redis_client)
    runner.answer = GOOD
    [entry] = prober.round()
    assert entry["state"] == probes.OK and entry["ok"] and len(runner.sent) == 2
    assert prober.courier.deliver() and hook.received == [], "a busy model never paged anyone"


def test_a_broken_model_alerts_once_after_a_minute_and_resolves_once(redis_client, embedded_settings, hook):
    """Probes every 15 s: the alert waits until the failures span a minute, then goes out
    once however many rounds stay red, and its resolution once."""
    settings = _settings(embedded_settings, alert_webhook_url=hook.url, probe_interval_s=15.0)
    _serve(redis_client)
    runner = ThroughTheIntake(_web(settings))
    runner.answer = {"ok": False, "error": "RemoteError: CUDA error: an illegal memory access"}
    prober = probes.Prober(settings, redis_client, runner, name="test-prober", clock=StepClock(step_s=15.0))
    for _ in range(4):  # red at 0, 15, 30, 45 s
        [entry] = prober.round()
        queues.drain(redis_client, queue_for(KEY))  # the worker answered each probe (with its error)
        assert not entry["ok"] and prober.courier.deliver()
    assert hook.received == [], "failing for 45 s: not yet"
    for _ in range(6):  # 60 s and on
        prober.round()
        queues.drain(redis_client, queue_for(KEY))
        assert prober.courier.deliver()
    assert [a["status"] for a in hook.received] == ["firing"]
    firing = hook.received[0]
    assert firing["at"] - firing["failing_since"] == 60.0
    assert firing["nnsight"] == probes.runtime_of(KEY) and f"(nnsight {firing['nnsight']})" in firing["text"]

    runner.answer = GOOD
    for _ in range(3):
        prober.round()
        queues.drain(redis_client, queue_for(KEY))
        assert prober.courier.deliver()
    assert [a["status"] for a in hook.received] == ["firing", "resolved"]


def test_a_single_failure_between_green_probes_pages_no_one(redis_client, embedded_settings, hook):
    settings = _settings(embedded_settings, alert_webhook_url=hook.url)
    _serve(redis_client)
    runner = ThroughTheIntake(_web(settings))
    prober = probes.Prober(settings, redis_client, runner, name="test-prober", clock=StepClock(step_s=60.0))
    for answer in (GOOD, {"ok": False, "error": "ConnectionError: reset"}, GOOD, GOOD):
        runner.answer = answer
        prober.round()
        queues.drain(redis_client, queue_for(KEY))
        assert prober.courier.deliver()
    assert hook.received == []


def test_a_probe_waiting_for_a_deployment_no_worker_runs_is_a_failure(redis_client, embedded_settings):
    """Its worker stopped with the probe in the line: nobody will run it, so the wait
    says nothing of a busy model; the probe is judged as it answered (it timed out)."""
    settings = _settings(embedded_settings)
    web = _web(settings)
    _serve(redis_client)
    runner = ThroughTheIntake(web)
    prober = probes.Prober(settings, redis_client, runner, name="test-prober", clock=StepClock(step_s=60.0))
    [entry] = prober.round()
    assert entry["state"] == probes.QUEUED and entry["note"] == "queued, next"
    registry.remove_deployment(redis_client, "w0", KEY)
    actions.deploy(redis_client, KEY, pinned=True, replicas=1, dtype=None)  # still wanted, held by no one
    assert probes.queued_behind(redis_client, KEY) is None
    prober.runner = runner = type(runner)(web)
    runner.probe = lambda model_key, timeout_s: dict(LATE, model_key=model_key)
    [entry] = prober.round()
    assert entry["state"] == probes.FAILING and not entry["ok"] and "no answer within" in entry["error"]
