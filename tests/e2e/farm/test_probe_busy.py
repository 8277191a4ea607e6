"""A busy, healthy model pages no one: the health probe behind three 35 s jobs.

A real stack (one worker, jobs one at a time: ``NDIF_COBATCH_MAX=1``), the beat
probing the pinned tiny model every 2 s with the real client and a 60 s
timeout, a webhook receiver on loopback. A researcher queues three 35 s jobs
(105 s of work, more than the probe's timeout). The probe's job takes the
front of the line (``state.turns``): it waits for the job running, answers
green while the other two still wait, and no alert goes out. The in-process
tier drives the same with a clock, including a probe whose time runs out in
the line ("queued behind N jobs") and a broken model's single alert:
tests/inprocess/ndif_celery/monitoring/test_probe_queue.py.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import redis

from ndif_celery.farm.actions import model_key_for
from ndif_celery.monitoring import probes
from tests.support.clients.remote import poll, slow_job, wait_status
from tests.support.stacks.stack import client_on_stack
from tests.support.cases.tiny_model import REPO_ID
from tests.support.stacks.webhook import Hook

KEY = model_key_for(REPO_ID)
STEPS = 700  # x 50 ms: a 35 s job


@pytest.fixture(scope="module")
def farm(tmp_path_factory, hf_home):
    hook = Hook().start()
    env = {"NDIF_COBATCH_MAX": "1", "NDIF_DEPLOYMENTS": f"[{{repo: {REPO_ID}, pin: true}}]",
           "NDIF_PROBE_INTERVAL_S": "2", "NDIF_PROBE_TIMEOUT_S": "60", "NDIF_PROBE_API_KEY": "probe-key",
           "NDIF_ALERT_WEBHOOK_URL": hook.url}
    try:
        with client_on_stack(tmp_path_factory.mktemp("probe-busy"), hf_home, env) as stack:
            yield stack, hook, redis.Redis.from_url(stack.redis_url)
    finally:
        hook.stop()


def _probe(client) -> dict:
    raw = client.hget(probes.PROBES, KEY)
    return json.loads(raw) if raw else {}


def _status(stack, job_id: str) -> str:
    return httpx.get(f"{stack.url}/response/{job_id}", timeout=10).json()["status"]


def test_three_long_jobs_ahead_of_the_probe_page_no_one(farm, model):
    stack, hook, client = farm
    stack.until(lambda: _probe(client).get("ok"), "the probe green", timeout_s=240)
    jobs = [slow_job(model, STEPS) for _ in range(3)]
    wait_status(stack.url, jobs[0].job_id, "RUNNING")
    # A probe sent now waits for the job running, not for the two behind it.
    waited = stack.until(lambda: (lambda row: row if row.get("ok") and (row.get("latency_s") or 0) > 5 else None)(
        _probe(client)), "a green probe that waited for the running job", timeout_s=90)
    assert _status(stack, jobs[2].job_id) == "QUEUED", "the probe answered before the last job even started"
    assert waited["state"] == probes.OK and waited["failures"] == 0, waited
    for backend in jobs:
        poll(backend, timeout_s=150)
    time.sleep(6)  # a few more rounds, and the courier's pass
    failed = {field.decode(): int(n) for field, n in client.hgetall(probes.RUNS).items()
              if field.decode().endswith("|failed")}
    assert not any(failed.values()), failed
    assert _probe(client)["ok"] and hook.received == [], "a busy model paged the operator"
