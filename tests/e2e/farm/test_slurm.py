"""Elastic workers on a real one-node SLURM cluster (``tests/support/stacks/slurm.py``).

The farm runs no worker of its own (``NDIF_UP_WORKER=0``) and launches them
through ``sbatch`` (``NDIF_LAUNCHER=slurm``, ``deploy/slurm/ndif-worker.sbatch``):
jobs that wait make it submit a worker, which joins, runs them with the
client's local values, leaves when idle, and its allocation ends; the next
burst launches again. A launch SLURM refuses ends the jobs with SLURM's words.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import uuid

import httpx
import pytest

from tests.support.cases import conformance
from tests.support.clients.remote import client_pointed_at
from tests.support.stacks import slurm
from tests.support.stacks.stack import Stack, offline_env

IDLE_S = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = slurm.missing()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the SLURM tests: {why}")
        pytest.skip(why)
    cluster = slurm.SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


@pytest.fixture(autouse=True)
def empty_queue_after(cluster):
    """Each test leaves SLURM's queue empty, whatever it asserted: the next one counts on it."""
    yield
    if cluster.queue():
        cluster.run("scancel", "--full", f"--partition={cluster.partition}")
        cluster.until_empty()


def _farm(home, hf_home, cluster, **env) -> Stack:
    return Stack(home, env={**offline_env(hf_home), **cluster.env, "NDIF_UP_WORKER": "0", "NDIF_LAUNCHER": "slurm",
                            "NDIF_LAUNCH_AFTER_S": "2", "NDIF_LAUNCH_IDLE_S": str(IDLE_S), "NDIF_LAUNCH_GPUS": "0",
                            "NDIF_LAUNCH_MAX_WORKERS": "1", "NDIF_SLURM_TIME_LIMIT": "00:15:00", **env})


@pytest.fixture(scope="module")
def farm(cluster, tmp_path_factory, hf_home):
    stack = _farm(tmp_path_factory.mktemp("slurm-farm"), hf_home, cluster)
    stack.start()
    yield stack
    stack.discard()


def _launches(stack) -> list:
    return json.loads(stack.cli("launches", "--json", check=True).stdout)


def _burst(stack, model, local_results, tmp_path) -> None:
    with client_pointed_at(stack.url):
        for case in (conformance.case_read_outputs, conformance.case_generate_iter):
            conformance.assert_same(case(model, lambda m: {"remote": True}, tmp_path), local_results(case))


def _left(stack, cluster) -> None:
    """The launched worker left when idle: SLURM lists nothing, the farm no worker, the launch ENDED."""
    cluster.until_empty(timeout_s=IDLE_S + 90)
    stack.until(lambda: not stack.operator_farm()["cluster"]["workers"], "the worker to leave the registry",
                timeout_s=30)
    stack.until(lambda: all(row["state"] == "ENDED" for row in _launches(stack)), "the launch to be seen ENDED",
                timeout_s=30)


def test_waiting_jobs_launch_a_worker_that_leaves_when_idle_and_again(farm, cluster, model, local_results, tmp_path):
    assert not farm.operator_farm()["cluster"]["workers"], "the farm starts with no worker"
    assert _launches(farm) == []
    _burst(farm, model, local_results, tmp_path)
    first = _launches(farm)
    assert len(first) == 1 and first[0]["state"] == "RUNNING", first
    assert first[0]["worker"].startswith(f"slurm{first[0]['id']}@"), first
    assert [line.split("|")[1:] for line in cluster.queue()] == [["ndif-worker", "RUNNING"]]
    listed = farm.cli("launches", check=True).stdout
    assert f"slurm {first[0]['id']}" in listed and "RUNNING" in listed and first[0]["worker"] in listed
    # Seen where an operator looks: /metrics and the dashboard.
    assert 'ndif_launches{state="RUNNING"} 1.0' in httpx.get(f"{farm.url}/metrics", timeout=10).text
    page = httpx.get(f"{farm.url}/dashboard", timeout=10).text
    assert f"slurm {first[0]['id']}" in page and first[0]["worker"] in page
    _left(farm, cluster)
    # A second burst launches again.
    _burst(farm, model, local_results, tmp_path)
    second = [row for row in _launches(farm) if row["id"] != first[0]["id"]]
    assert len(second) == 1 and second[0]["worker"].startswith(f"slurm{second[0]['id']}@"), second
    _left(farm, cluster)


def rows_joined(rows: dict) -> str:
    """The worker of the launch that is still running."""
    return next(row["worker"] for row in rows.values() if row["state"] == "RUNNING")


def _slow_first_time(model, marker: str):
    """A trace whose first run holds its worker for minutes, and any later run does not."""
    with model.trace(conformance.PROMPT, remote=True):
        if not os.path.exists(marker):
            open(marker, "w").close()
            time.sleep(300)
        hidden = model.transformer.h[0].output.save()
    return hidden


def test_a_time_limit_reached_mid_job_sends_the_job_to_the_next_worker(farm, cluster, model, tmp_path):
    with model.trace(conformance.PROMPT):
        expected = model.transformer.h[0].output.save()
    marker = str(tmp_path / "first-run-started")
    done: dict = {}
    before = {row["id"] for row in _launches(farm)}

    def client():
        with client_pointed_at(farm.url):
            try:
                done["hidden"] = _slow_first_time(model, marker)
            except BaseException as error:  # noqa: BLE001 - reported below
                done["error"] = error

    thread = threading.Thread(target=client)
    thread.start()
    running = farm.until(lambda: [row for row in _launches(farm) if row["state"] == "RUNNING" and row.get("worker")
                                  and row["id"] not in before and os.path.exists(marker)],
                         "the job to run on a launched worker", timeout_s=180)
    launch = running[0]
    # The allocation's time is up: SLURM warns the worker (its warm shutdown waits for the job), then kills it.
    assert cluster.run("scontrol", "update", f"JobId={launch['id']}", "TimeLimit=1").returncode == 0
    thread.join(timeout=600)
    assert not thread.is_alive() and "error" not in done, done
    assert conformance.same(done["hidden"], expected)
    rows = {row["id"]: row for row in _launches(farm) if row["id"] not in before}
    assert rows[launch["id"]]["state"] == "ENDED" and "TIMEOUT" in rows[launch["id"]]["reason"], rows
    assert len(rows) == 2, "the job went to a worker launched after the first was killed"
    last = farm.until(lambda: json.loads(farm.cli("jobs", "--json", "--limit", "1", check=True).stdout),
                      "the job's ledger row", timeout_s=30)[0]
    assert (last["outcome"], last["attempt"]) == ("COMPLETED", 2) and last["worker"] == rows_joined(rows), last
    _left(farm, cluster)


def test_a_launch_slurm_refuses_ends_the_jobs_with_slurms_reason(cluster, tmp_path, hf_home, model):
    stack = _farm(tmp_path / "home", hf_home, cluster, NDIF_SLURM_PARTITION="nosuch")
    stack.start()
    try:
        with client_pointed_at(stack.url), pytest.raises(Exception) as raised:
            with model.trace(conformance.PROMPT, remote=True):
                model.output.logits.save()
        assert "Could not launch a worker for" in str(raised.value), raised.value
        assert "Invalid partition name specified" in str(raised.value), raised.value
        rows = _launches(stack)
        assert [row["state"] for row in rows] == ["REFUSED"] and "Invalid partition" in rows[0]["reason"], rows
        assert not cluster.queue()
    finally:
        stack.discard()


# --- the beat's decisions, ticked by hand against the same cluster and a real Redis ----------


@pytest.fixture
def ticked(cluster, redis_client, embedded_settings, tmp_path, monkeypatch):
    """``make(script_body, **settings) -> Elastic``: the beat's thread, not started, whose
    launches run ``script_body`` as their batch script on the test cluster."""
    from ndif_celery.farm import elastic, launchers

    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])

    def make(script_body: str, **changes):
        script = tmp_path / "launch.sbatch"
        script.write_text(f"#!/bin/bash\n{script_body}\n")
        settings = dataclasses.replace(embedded_settings, home=tmp_path, launcher="slurm", launch_after_s=0.5,
                                       launch_max_workers=1, launch_gpus=0, slurm_script=script, **changes)
        return elastic.Elastic(settings, redis_client, launchers.SlurmLauncher(settings), name="test")

    yield make
    cluster.run("scancel", "--full", f"--partition={cluster.partition}")


def _wait(client, app, seconds: float):
    from ndif_celery.celery_app import queue_for
    from ndif_celery.farm import actions
    from ndif_celery.state import jobs, queues, registry

    key = actions.model_key_for("slurm/waiting")
    job = jobs.Job(id=uuid.uuid4().hex, model_key=key, received_at=time.time() - seconds)
    client.sadd(registry.QUEUES, queue_for(key))
    client.lpush(*queues.job_message(app, job))
    return job


def _said(client, job) -> dict:
    from ndif_celery.state import jobs

    return json.loads(client.get(jobs.status_key(job.id)))


def test_paused_launching_launches_nothing_and_says_so(ticked, redis_client, embedded_settings, cluster):
    from ndif_celery.celery_app import make_app
    from ndif_celery.state import launches

    beat = ticked("sleep 300")
    redis_client.set(launches.PAUSED, "1")
    job = _wait(redis_client, make_app(embedded_settings), 5)
    beat.tick()
    assert cluster.queue() == [] and launches.read(redis_client) == {}
    assert "launching workers is paused by the farm's operator" in _said(redis_client, job)["description"]
    redis_client.delete(launches.PAUSED)
    beat.tick()
    assert len(cluster.queue()) == 1 and "A worker is being launched for your job" in _said(redis_client, job)["description"]


def test_at_the_cap_a_waiting_job_is_told_and_no_worker_more_is_launched(ticked, redis_client, embedded_settings,
                                                                         cluster):
    from ndif_celery.celery_app import make_app
    from ndif_celery.state import launches, registry

    beat = ticked("sleep 300")
    app = make_app(embedded_settings)
    first = _wait(redis_client, app, 5)
    beat.tick()
    [launch_id] = launches.read(redis_client)
    # Its worker joins, and is busy: a job waiting now may not launch a second (NDIF_LAUNCH_MAX_WORKERS=1).
    registry.register_worker(redis_client, {"name": f"slurm{launch_id}@node", "pid": 1, "last_seen": time.time()})
    beat.tick()
    assert launches.read(redis_client)[launch_id]["worker"] == f"slurm{launch_id}@node"
    assert "the farm has launched as many workers as it may (1)" in _said(redis_client, first)["description"]
    assert len(cluster.queue()) == 1


def test_a_launch_that_ends_before_its_worker_joins_ends_the_jobs_instead_of_launching_again(
        ticked, redis_client, embedded_settings, cluster):
    from ndif_celery.celery_app import make_app
    from ndif_celery.state import launches

    beat = ticked("echo 'cannot start here' >&2; exit 3")
    job = _wait(redis_client, make_app(embedded_settings), 5)
    beat.tick()
    [launch_id] = launches.read(redis_client)
    deadline = time.monotonic() + 60
    while launches.read(redis_client)[launch_id]["state"] != "ENDED":
        assert time.monotonic() < deadline, launches.read(redis_client)
        time.sleep(0.5)
        beat.tick()
    said = _said(redis_client, job)
    assert said["status"] == "ERROR", said
    assert f"slurm job {launch_id} ended before it joined the farm: FAILED" in said["description"], said
    assert f"slurm-{launch_id}.log" in said["description"]
    assert len(launches.read(redis_client)) == 1, "not launched again"
