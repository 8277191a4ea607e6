"""Sharing a model between keys, with the real client against the shared auth
farm: fair turns on its queue (``ndif_celery/state/turns.py``) and cancels
(only a job's owner may cancel it, ``POST /cancel/<id>``).

One key floods the model with a hundred jobs; five other keys then send one
job each. Keys with waiting jobs take turns, so each of the five finishes
before the flooder's tenth job, where first-in first-out would have made
them wait for all hundred. The web and the worker are killed in the middle
(``up`` restarts both) and no job is lost. The keys are untrusted: each job
runs alone, in its jailed child, so the order of ends is the order of turns.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import nnsight
import pytest
import redis

from ndif_celery.state import jobs
from tests.support import pace
from tests.support.clients.remote import client_pointed_at, final_status, slow_job, wait_status
from tests.support.waiting import wait_until

pytestmark = pytest.mark.pools("auth")

FLOOD = 100
LIGHT = 5


def _key(stack, email: str, *flags: str) -> str:
    result = stack.cli("keys", "create", "--email", email, *flags)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def _as(key: str, model, steps: int = 0):
    nnsight.CONFIG.API.APIKEY = key
    return slow_job(model, steps)


def test_keys_take_turns_and_restarts_lose_nothing(stack_pool, model):
    stack = stack_pool.get("auth")
    with client_pointed_at(stack.url):
        trusted = _key(stack, "deployer@turns.test", "--trusted")
        flooder = _key(stack, "flooder@turns.test")
        light = [_key(stack, f"light{n}@turns.test") for n in range(LIGHT)]
        _as(trusted, model)  # the model deployed (offered to untrusted keys from now on)
        # A long job first, so the flood is all queued before anything of it runs.
        blocker = _as(_key(stack, "blocker@turns.test"), model, steps=int(pace.bound(8) / 0.05))
        wait_status(stack.url, blocker.job_id, "RUNNING", headers={"ndif-api-key": blocker.api_key})
        flood = [_as(flooder, model) for _ in range(FLOOD)]
        lights = [_as(key, model) for key in light]

        os.killpg(stack.pids()["web"], signal.SIGKILL)  # `up` restarts both
        stack.wait_answers()
        worker = stack.pids()["worker"]
        os.kill(worker, signal.SIGKILL)
        wait_until(lambda: stack.pids().get("worker") not in (None, worker), pace.bound(60), "the worker to restart")

        for backend in [blocker, *flood, *lights]:
            latest = final_status(stack.url, backend.job_id, headers={"ndif-api-key": backend.api_key},
                                  timeout_s=300)
            assert latest["status"] == "COMPLETED", latest
        client = redis.Redis.from_url(stack.redis_url)
        try:
            ended = {backend.job_id: client.zscore(jobs.ENDED, backend.job_id) for backend in [*flood, *lights]}
        finally:
            client.close()
    tenth = ended[flood[9].job_id]
    late = [backend.job_id for backend in lights if ended[backend.job_id] >= tenth]
    assert not late, f"light keys' jobs ended after the flooder's tenth: {late}"
    print(f"the light keys' jobs ended {time.time() - max(ended[b.job_id] for b in lights):.1f} s ago; the "
          f"flooder's tenth {time.time() - tenth:.1f} s ago; its last {time.time() - ended[flood[-1].job_id]:.1f} s ago")


def test_only_its_owner_cancels_a_job(stack_pool, model):
    """``POST /cancel/<id>`` with the job's key: a waiting job leaves the queue,
    a running one is interrupted, each ends with an ERROR saying so; another
    key is refused (403) and changes nothing."""
    stack = stack_pool.get("auth")
    with client_pointed_at(stack.url):
        owner, other = _key(stack, "owner@cancel.test", "--trusted"), _key(stack, "other@cancel.test", "--trusted")
        running = _as(owner, model, steps=4000)  # 200 s
        headers = {"ndif-api-key": owner}
        wait_status(stack.url, running.job_id, "RUNNING", headers=headers)
        waiting = _as(owner, model, steps=1)

        def cancel(job_id: str, key: str) -> httpx.Response:
            return httpx.post(f"{stack.url}/cancel/{job_id}", headers={"ndif-api-key": key}, timeout=30)

        for job_id in (waiting.job_id, running.job_id):
            refused = cancel(job_id, other)
            assert refused.status_code == 403 and "only its owner" in refused.json()["detail"], refused.text
        assert httpx.get(f"{stack.url}/response/{waiting.job_id}", headers=headers).json()["status"] == "QUEUED"
        assert cancel(waiting.job_id, owner).json()["cancelled"] == "removed from the queue"
        assert cancel(running.job_id, owner).json()["cancelled"].startswith("cancelling on")
        for backend in (waiting, running):
            latest = final_status(stack.url, backend.job_id, headers=headers)
            assert latest["status"] == "ERROR" and "cancelled at your request" in latest["description"], latest
        assert cancel(running.job_id, owner).status_code == 409  # ended already
        assert cancel("0" * 32, owner).status_code == 404
