"""What a key's jobs hold in Redis, attacked on real stacks (auth off and on).

A job cancelled while it waits used to free its key's slot and keep its
payload for the job TTL (a day): a key could submit and cancel until the
broker was full, and everyone's next request got 503. Now the step that
frees the slot deletes the payload and gives its bytes back
(``statuses._release``), and what a key parks counts against
``NDIF_MAX_PARKED_BYTES_PER_KEY`` (the refusal itself: tests/inprocess/ndif_celery/test_intake.py).
"""

from __future__ import annotations

import json
import time

import httpx
import nnsight
import pytest
import redis

from tests.support import pace
from tests.support.clients.remote import client_pointed_at, final_status, slow_job, wait_status
from tests.support.waiting import wait_until

JOBS = 100
PAYLOAD_BYTES = 8 << 20
SLACK_BYTES = 16 << 20  # what the stack's own work may move Redis's memory meanwhile


def _used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def _submit(stack, model, blob: bytes, headers: dict) -> str:
    envelope = {"model_key": model.to_model_key(), "session_id": "", "compress": False, "env": {}}
    answer = httpx.post(f"{stack.url}/request", data={"data": json.dumps(envelope)},
                        files={"blob": ("request", blob, "application/octet-stream")}, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["id"]


@pytest.mark.pools("fs", "auth")
@pytest.mark.parametrize("kind", ["fs", "auth"], ids=["auth off", "auth on"])
def test_cancelled_queued_payloads_leave_redis_at_once(stack_pool, model, kind):
    stack = stack_pool.get(kind)
    headers = {}
    with client_pointed_at(stack.url):
        if kind == "auth":
            made = stack.cli("keys", "create", "--email", "parker@bytes.test", "--trusted", check=True)
            nnsight.CONFIG.API.APIKEY = made.stdout.strip().splitlines()[-1]
            headers = {"ndif-api-key": nnsight.CONFIG.API.APIKEY}
        blocker = slow_job(model, steps=int(pace.bound(120) / 0.05))  # holds the only worker: the rest wait
        wait_status(stack.url, blocker.job_id, "RUNNING", headers=headers)
        client = redis.Redis.from_url(stack.redis_url)
        try:
            baseline = _used_memory(client)
            blob = bytes(range(256)) * (PAYLOAD_BYTES // 256)
            queued = [_submit(stack, model, blob, headers) for _ in range(JOBS)]
            parked = _used_memory(client) - baseline
            assert parked > 0.9 * JOBS * PAYLOAD_BYTES, parked
            started = time.monotonic()
            for job_id in queued:
                answer = httpx.post(f"{stack.url}/cancel/{job_id}", headers=headers, timeout=30)
                assert answer.json().get("cancelled") == "removed from the queue", answer.text
            cancelled_s = time.monotonic() - started
            wait_until(lambda: _used_memory(client) - baseline < SLACK_BYTES, pace.bound(5),
                       "Redis's memory to come back to its baseline",
                       report=lambda: f"{(_used_memory(client) - baseline) >> 20} MiB over it")
            back_s = time.monotonic() - started - cancelled_s
            print(f"{kind}: {JOBS} x {PAYLOAD_BYTES >> 20} MiB parked {parked >> 20} MiB; cancelled in "
                  f"{cancelled_s:.1f} s; Redis back within {SLACK_BYTES >> 20} MiB of its baseline "
                  f"{back_s:.2f} s after the last cancel")
            assert all(client.get(f"ndif:job:{job_id}:payload") is None for job_id in queued)
        finally:
            httpx.post(f"{stack.url}/cancel/{blocker.job_id}", headers=headers, timeout=30)
            client.close()
        assert final_status(stack.url, blocker.job_id, headers=headers)["status"] == "ERROR"
