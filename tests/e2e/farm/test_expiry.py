"""Results and statuses expire after ``NDIF_JOB_TTL_S``: Celery beat runs the
cleanup, the stored result is deleted, and a late poll is told the job expired
(the real client raises with that message instead of polling forever)."""

from __future__ import annotations

import os
import time

import httpx
import pytest
import redis
import torch
from nnsight.intervention.backends.remote import RemoteBackend

from ndif_celery.state import expiry
from ndif_celery.state import jobs
from ndif_celery.store import FilesystemStore
from tests.support.clients.remote import poll, slow_job
from tests.support.stacks.stack import client_on_stack
from tests.support.cases.tiny_model import PROMPT, build_tiny_gpt2, client_model

REPO = "expiry/tiny"
TTL_S = 12
URL_TTL_S = 3  # long enough for the first download at load 13 (1 s was not, once)
LEDGER_DAYS = 10 / 86400  # ten seconds, so the test sees the ledger pruned too


@pytest.fixture(scope="module")
def stack(tmp_path_factory, hf_home):
    build_tiny_gpt2(hf_home, REPO, n_layer=2, seed=42)
    env = {"NDIF_MAX_INLINE_BYTES": "0", "NDIF_JOB_TTL_S": str(TTL_S), "NDIF_CLEANUP_INTERVAL_S": "1",
           "NDIF_RESULT_URL_TTL_S": str(URL_TTL_S), "NDIF_LEDGER_RETENTION_DAYS": str(LEDGER_DAYS)}
    with client_on_stack(tmp_path_factory.mktemp("expiry"), hf_home, env) as stack:
        yield stack


def test_an_expired_job_is_cleaned_up_and_says_so(stack):
    model = client_model(REPO)
    stack.cli("deploy", REPO, check=True)  # loading counts against nobody's TTL
    backend = slow_job(model, 0, layer=1)
    result = poll(backend, timeout_s=30)
    with model.trace(PROMPT):
        expected = model.transformer.h[1].output.save()
    assert torch.equal(result["out"], expected)
    stored = stack.home / "results" / jobs.result_key(backend.job_id)
    assert stored.is_file()
    assert backend.job_id in stack.cli("jobs", "--json", check=True).stdout  # in the ledger, for now
    # The first URL has expired by now (NDIF_RESULT_URL_TTL_S): a late poll
    # within the job's TTL gets a freshly signed one and still downloads.
    first_url = httpx.get(f"{stack.url}/response/{backend.job_id}").json()["data"]
    time.sleep(URL_TTL_S + 1.1)
    assert httpx.get(first_url).status_code == 403
    again = RemoteBackend(model.to_model_key(), blocking=False, job_id=backend.job_id)
    assert torch.equal(poll(again, timeout_s=5)["out"], expected)
    deadline = time.monotonic() + TTL_S + 30
    while stored.exists():
        assert time.monotonic() < deadline, f"the beat's cleanup never deleted {stored}\n{stack.logs()}"
        time.sleep(0.2)
    client = redis.Redis.from_url(stack.redis_url)
    assert not any(client.exists(key) for key in jobs.job_keys(backend.job_id))
    with pytest.raises(Exception, match="has expired") as raised:
        backend()  # the real client's poll
    assert f"{TTL_S} s (NDIF_JOB_TTL_S)" in str(raised.value)
    # Its ledger row goes too, past NDIF_LEDGER_RETENTION_DAYS.
    deadline = time.monotonic() + 30
    while backend.job_id in stack.cli("jobs", "--json", check=True).stdout:  # an interpreter a look: not too often
        assert time.monotonic() < deadline, f"the ledger row of {backend.job_id} was never pruned\n{stack.logs()}"
        time.sleep(2)


def test_the_sweep_removes_only_what_is_past_its_ttl(stack, tmp_path):
    """Against a real Redis (a database of its own on the stack's server)."""
    client = redis.Redis.from_url(stack.redis_url.rsplit("/", 1)[0] + "/7")
    client.flushdb()
    store = FilesystemStore(tmp_path, "http://127.0.0.1:1", "secret", 60)
    now = time.time()
    old, fresh = "a" * 32, "b" * 32
    for job_id, ended in ((old, now - 100), (fresh, now - 1)):
        store.put(jobs.result_key(job_id), b"result")
        for key in jobs.job_keys(job_id):
            client.set(key, b"x")
        client.zadd(jobs.ENDED, {job_id: ended})
    store.put("results/orphan-old.pt", b"o")
    store.put("results/orphan-new.pt", b"o")
    os.utime(store.path("results/orphan-old.pt"), (now - 100, now - 100))
    client.zadd(expiry.EXPIRED, {"c" * 32: now - expiry.REMEMBER_EXPIRED_S - 1})

    swept = expiry.sweep(client, store, ttl_s=10, now=now)

    assert swept == {"jobs": 1, "orphan_results": 1}
    left = set(store.older_than("results/", now + 1))  # everything still stored
    assert left == {jobs.result_key(fresh), "results/orphan-new.pt"}
    assert not any(client.exists(key) for key in jobs.job_keys(old))
    assert all(client.exists(key) for key in jobs.job_keys(fresh))
    assert expiry.expired(client, old, 10) and not expiry.expired(client, fresh, 10)
    assert client.zscore(expiry.EXPIRED, "c" * 32) is None  # forgotten after a month
    assert expiry.sweep(client, store, ttl_s=10, now=now) == {"jobs": 0, "orphan_results": 0}
    client.flushdb()
