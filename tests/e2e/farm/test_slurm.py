"""Elastic workers on a real one-node SLURM cluster (``tests/support/stacks/slurm.py``).

The farm runs no worker of its own (``NDIF_UP_WORKER=0``) and launches them
through ``sbatch`` (``NDIF_LAUNCHER=slurm``, ``deploy/slurm/ndif-worker.sbatch``):
jobs that wait make it submit a worker, which joins, runs them with the
client's local values, leaves when idle, and its allocation ends; the next
burst launches again. A launch SLURM refuses ends the jobs with SLURM's words.
"""

from __future__ import annotations

import json
import os
import threading
import time

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
    stack.until(lambda: not cluster.queue(), "the idle worker's allocation to end", timeout_s=IDLE_S + 90)
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

    def client():
        with client_pointed_at(farm.url):
            try:
                done["hidden"] = _slow_first_time(model, marker)
            except BaseException as error:  # noqa: BLE001 - reported below
                done["error"] = error

    thread = threading.Thread(target=client)
    thread.start()
    running = farm.until(lambda: [row for row in _launches(farm) if row["state"] == "RUNNING" and row.get("worker")
                                  and os.path.exists(marker)], "the job to run on a launched worker", timeout_s=180)
    launch = running[0]
    # The allocation's time is up: SLURM warns the worker (its warm shutdown waits for the job), then kills it.
    assert cluster.run("scontrol", "update", f"JobId={launch['id']}", "TimeLimit=1").returncode == 0
    thread.join(timeout=600)
    assert not thread.is_alive() and "error" not in done, done
    assert conformance.same(done["hidden"], expected)
    rows = {row["id"]: row for row in _launches(farm)}
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
