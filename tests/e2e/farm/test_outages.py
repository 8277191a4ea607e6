"""Outages of the parts a job depends on: Redis (broker and job state) restarted
with jobs queued, and the object store down while a job stores its result.
Each test waits on real jobs with the real client against a stack of its own,
whose results always go through S3 (moto's S3-protocol server on loopback).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from tests.support.clients.remote import final_status, poll, slow_job, wait_status
from tests.support.stacks.servers import MotoServer
from tests.support.stacks.stack import client_on_stack
from tests.support.cases.tiny_model import PROMPT, build_tiny_gpt2, client_model

REPO = "outages/tiny"


@pytest.fixture(scope="module")
def s3():
    with MotoServer() as server:
        yield server


@pytest.fixture(scope="module")
def stack(tmp_path_factory, hf_home, s3):
    build_tiny_gpt2(hf_home, REPO, n_layer=2, seed=41)
    env = {
        "NDIF_MAX_INLINE_BYTES": "0",
        "NDIF_OBJECT_STORE_URL": s3.url,
        "NDIF_OBJECT_STORE_ACCESS_KEY": s3.access_key,
        "NDIF_OBJECT_STORE_SECRET_KEY": s3.secret_key,
        "NDIF_OBJECT_STORE_REGION": s3.region,
        "NDIF_OBJECT_STORE_BUCKET": "ndif-outage-results",
    }
    with client_on_stack(tmp_path_factory.mktemp("outages"), hf_home, env) as stack:
        yield stack


def _local(model, layer: int = 1):
    with model.trace(PROMPT):
        out = model.transformer.h[layer].output.save()
    return out


def _wait_gone(pid: int, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} did not exit")


def test_a_redis_restart_loses_no_queued_job(stack):
    """Redis (the broker and every job's state) stops and comes back from its
    append-only file while one job runs and others wait, one of them for a
    blocking client on its websocket: all of them complete."""
    model = client_model(REPO)
    stack.cli("deploy", REPO, check=True)
    running = slow_job(model, 60, layer=1)  # 3 s
    wait_status(stack.url, running.job_id, "RUNNING")
    queued = [slow_job(model, 0, layer=layer) for layer in (0, 1, 0, 1)]
    blocked = {}

    def blocking_client():
        try:
            with model.trace(PROMPT, remote=True):
                out = model.transformer.h[0].output.save()
            blocked["out"] = out
        except Exception as error:  # noqa: BLE001 - what the client raises is the point
            blocked["error"] = f"{type(error).__name__}: {error}"

    waiting = threading.Thread(target=blocking_client)
    waiting.start()
    time.sleep(0.5)  # subscribed, submitted, queued
    redis_pid = stack.pids()["redis"]
    os.kill(redis_pid, signal.SIGTERM)  # a clean restart: Redis flushes its AOF
    _wait_gone(redis_pid)
    stack.wait_answers()  # `up`'s supervisor starts it again a second later
    expected = {0: _local(model, 0), 1: _local(model, 1)}
    for backend, layer in zip([running, *queued], (1, 0, 1, 0, 1)):
        result = poll(backend, timeout_s=90)
        assert torch.equal(result["out"], expected[layer]), f"job {backend.job_id} came back wrong"
    waiting.join(timeout=60)
    assert not waiting.is_alive(), "a blocking client hung across the Redis restart"
    assert "error" not in blocked, blocked["error"]
    assert torch.equal(blocked["out"], expected[0])
    # And the farm keeps taking new work afterwards.
    with model.trace(PROMPT, remote=True):
        after = model.transformer.h[1].output.save()
    assert torch.equal(after, expected[1])


def test_an_object_store_outage_errors_with_the_reason_and_recovers(stack, s3):
    """The store is down when a job stores its result: the job ends in ERROR
    naming the store and why; the worker keeps serving, and once the store is
    back (empty, as after a crash) new jobs complete."""
    model = client_model(REPO)
    with model.trace(PROMPT, remote=True):
        model.transformer.h[1].output.save()  # deployed, store reachable
    s3.stop()
    try:
        backend = slow_job(model, 0, layer=1)
        latest = final_status(stack.url, backend.job_id, timeout_s=90)
        assert latest["status"] == "ERROR", latest
        assert "result store" in latest["description"], latest["description"]
        assert s3.url.split("//", 1)[1] in latest["description"], latest["description"]
    finally:
        s3.start()
    with model.trace(PROMPT, remote=True):
        out = model.transformer.h[1].output.save()
    assert torch.equal(out, _local(model))


def test_a_database_outage_is_refused_with_503_and_recovers(tmp_path):
    """Auth on, PostgreSQL reached through a proxy we can cut: while it is down
    every request is refused with 503 and a reason (fail closed: nobody gets
    in unchecked); once it is back the same key works again, no restart."""
    from ndif_celery import config
    from ndif_celery.accounts import db
    from tests.support.stacks.servers import TcpProxy, postgres_database
    from web.app import create_app

    url, drop = postgres_database()
    proxy = TcpProxy("127.0.0.1", 5432).start()
    try:
        url = url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
        key = db.create_key(db.engine_for(url), "outage@example.org")
        settings = config.load({"NDIF_HOME": str(tmp_path), "NDIF_AUTH": "1", "NDIF_AUTH_CACHE_S": "0",
                                "NDIF_DATABASE_URL": url})
        web = create_app(settings).test_client()
        headers = {"ndif-api-key": key}
        assert web.get("/whoami", headers=headers).get_json()["email"] == "outage@example.org"
        proxy.stop()
        for path in ("/whoami", "/response/" + "0" * 32):
            answer = web.get(path, headers=headers)
            assert answer.status_code == 503, (path, answer.status_code, answer.get_data())
            assert "database" in answer.get_json()["detail"].lower(), answer.get_json()
        answer = web.post("/request", headers=headers, data={"data": "{}"})
        assert answer.status_code == 503
        proxy.start()
        assert web.get("/whoami", headers=headers).get_json()["email"] == "outage@example.org"
    finally:
        proxy.stop()
        drop()
