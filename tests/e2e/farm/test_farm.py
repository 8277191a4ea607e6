"""The farm with two real workers (distinct names, fake GPU sets, small memory
budgets) and several tiny models: placement, routing, LRU eviction, pinning,
a model too big for anyone, the operator CLI, replicas in /status, a worker
killed, and Flower.

The tests run in order and share one farm; each says what it starts from.
"""

from __future__ import annotations

import json
import os
import signal
import time
import types

import httpx
import nnsight
import pytest
import torch
from nnsight.intervention.backends.remote import RemoteBackend, RemoteError

from tests.support import pace
from tests.support.clients.remote import poll, slow_job, wait_status
from tests.support.stacks.stack import client_on_stack
from tests.support.cases.tiny_model import PROMPT, build_tiny_gpt2, client_model

GiB = 1024**3
SMALL = ["farm/m1", "farm/m2", "farm/m3", "farm/m4"]
HUGE = "farm/huge"
W0 = "gpu0@farm-test"
W1 = "gpu1@farm-test"


@pytest.fixture(scope="module")
def farm(tmp_path_factory, hf_home):
    for i, repo in enumerate(SMALL):
        build_tiny_gpt2(hf_home, repo, n_layer=2, seed=10 + i)
    build_tiny_gpt2(hf_home, HUGE, n_layer=4, n_embd=256, seed=20)
    size = _weights(hf_home, SMALL[0])
    env = {
        # Place models by their weights alone, so the budgets below are exact.
        "NDIF_PADDING_FACTOR": "0", "NDIF_PADDING_BYTES": "0",
        "NDIF_REPLICA_WAIT_S": "3600", "NDIF_REPLICA_IDLE_S": "3600",
        # The stack's own worker has room for two small models, the second worker for one.
        "NDIF_WORKER_NAME": W0, "NDIF_WORKER_GPUS": "0", "NDIF_WORKER_MEMORY_GIB": str(2.5 * size / GiB),
    }
    workers = [(W1, "1", 1.5 * size / GiB)]
    with client_on_stack(tmp_path_factory.mktemp("farm"), hf_home, env, workers, full=True) as stack:  # Flower too
        yield types.SimpleNamespace(stack=stack, size=size)


def _weights(hf_home, repo) -> int:
    from tests.support.cases.tiny_model import snapshot_dir

    return (snapshot_dir(hf_home, repo) / "model.safetensors").stat().st_size


def _key(repo: str) -> str:
    return client_model(repo).to_model_key()


def _holders(stack) -> dict[str, set]:
    """repo id -> the workers holding it (RUNNING), per /status."""
    held: dict[str, set] = {}
    for entry in stack.farm()["deployments"].values():
        if entry.get("application_state") == "RUNNING":
            held.setdefault(entry["repo_id"], set()).add(entry["worker"])
    return held


def _cli(stack, *args, check=True):
    result = stack.cli(*args, timeout=300)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def _run(repo: str) -> tuple[torch.Tensor, dict]:
    """A remote trace on ``repo``; checks the value against a local run."""
    model = client_model(repo)
    with model.trace(PROMPT, remote=True) as tracer:
        out = model.transformer.h[1].output.save()
    with model.trace(PROMPT):
        local = model.transformer.h[1].output.save()
    assert torch.equal(out, local)
    return out, tracer.backend.meta


def test_deploy_places_by_best_fit_and_jobs_go_only_to_holders(farm):
    _cli(farm.stack, "deploy", SMALL[0], "--pin")
    _cli(farm.stack, "deploy", SMALL[1])
    _cli(farm.stack, "deploy", SMALL[2])
    held = _holders(farm.stack)
    # m1 takes the tightest fit (the one-model worker); m2 and m3 fill the other.
    assert held == {SMALL[0]: {W1}, SMALL[1]: {W0}, SMALL[2]: {W0}}
    for repo in SMALL[:3]:
        for _ in range(2):
            _, meta = _run(repo)
            assert {meta["worker"]} == held[repo]


def test_a_fourth_model_evicts_the_least_recently_used_unpinned_one(farm):
    _run(SMALL[1])
    _run(SMALL[2])  # m2 is now the least recently used on the full worker
    _, meta = _run(SMALL[3])
    assert meta["worker"] == W0
    assert _holders(farm.stack) == {SMALL[0]: {W1}, SMALL[2]: {W0}, SMALL[3]: {W0}}

    # Asking for m2 again evicts the LRU of what is left (m3), never the pinned m1.
    _, meta = _run(SMALL[1])
    assert meta["worker"] == W0
    assert _holders(farm.stack) == {SMALL[0]: {W1}, SMALL[3]: {W0}, SMALL[1]: {W0}}
    _run(SMALL[2])
    held = _holders(farm.stack)
    assert held[SMALL[0]] == {W1}, "the pinned model was evicted"
    assert held[SMALL[2]] == {W0}


def test_a_model_too_big_for_any_worker_errors_every_queued_request(farm):
    huge = client_model(HUGE)
    backends = []
    for _ in range(3):
        with huge.trace(PROMPT, remote=True, blocking=False) as tracer:
            huge.transformer.h[0].output.save()
        backends.append(tracer.backend)
    for backend in backends:
        with pytest.raises(RemoteError) as caught:
            poll(backend)
        message = str(caught.value)
        assert f"Could not deploy {HUGE}" in message
        assert "largest worker" in message
    with pytest.raises(RemoteError, match=f"Could not deploy {HUGE}"):
        with huge.trace(PROMPT, remote=True):
            huge.transformer.h[0].output.save()
    assert HUGE not in _holders(farm.stack)
    _run(SMALL[0])  # the farm keeps serving


def _submit(repo: str, slow_steps: int = 0) -> RemoteBackend:
    return slow_job(client_model(repo), slow_steps)


def _latest(stack, job_id) -> dict:
    return httpx.get(f"{stack.url}/response/{job_id}", timeout=10).json()


def test_cli_status_queue_and_kill(farm):
    stack = farm.stack
    status = json.loads(_cli(stack, "status", "--json").stdout)
    pinned = [e for e in status["deployments"].values() if e["repo_id"] == SMALL[0] and e["deployment_level"] == "HOT"]
    assert pinned and pinned[0]["pinned"] is True and pinned[0]["worker"] == W1
    # Cached on the workers' disk, loaded nowhere: listed COLD, as NDIF does.
    assert status["deployments"][HUGE] == {"repo_id": HUGE, "deployment_level": "COLD"}
    workers = status["cluster"]["workers"]
    assert set(workers) == {W0, W1}
    assert workers[W1]["gpus"] == ["1"] and workers[W0]["gpus"] == ["0"]
    from ndif_celery.farm.sizing import weight_bytes

    assert workers[W1]["memory_used_bytes"] == weight_bytes(_key(SMALL[0]), None) <= farm.size
    assert workers[W1]["memory_free_bytes"] == workers[W1]["memory_bytes"] - workers[W1]["memory_used_bytes"]
    human = _cli(stack, "status").stdout
    assert W0 in human and W1 in human and SMALL[0] in human and "pinned" in human

    running = _submit(SMALL[0], slow_steps=600)  # up to 30 s, on W1
    wait_status(stack.url, running.job_id, "RUNNING")
    queued = [_submit(SMALL[0]) for _ in range(2)]
    rows = {row["model_key"]: row for row in json.loads(_cli(stack, "queue", "--json").stdout)}
    row = rows[_key(SMALL[0])]
    assert row["depth"] == 2 and row["jobs"] == [b.job_id for b in queued]
    assert row["head_wait_s"] >= 0
    assert SMALL[0] in _cli(stack, "queue").stdout

    # A queued job leaves the queue; the one behind it is told its new position.
    assert "removed from the queue" in _cli(stack, "kill", queued[0].job_id).stdout
    with pytest.raises(RemoteError, match="cancelled by the operator"):
        poll(queued[0])
    wait_status(stack.url, queued[1].job_id, "QUEUED", contains="(position 1")  # and, once the model ran jobs, about how long

    # The running job is interrupted; the queue moves on.
    started = time.monotonic()
    assert "cancelling on" in _cli(stack, "kill", running.job_id).stdout
    with pytest.raises(RemoteError, match="cancelled by the operator"):
        poll(running)
    assert time.monotonic() - started < pace.bound(10)
    assert "out" in poll(queued[1])

    missing = _cli(stack, "kill", "0" * 32, check=False)
    assert missing.returncode != 0 and "no job" in missing.stderr


def test_cli_evict_then_two_replicas_in_nnsight_status(farm, monkeypatch):
    stack = farm.stack
    for repo in SMALL:
        _cli(stack, "evict", repo)
    assert _holders(stack) == {}
    assert "not deployed" in _cli(stack, "evict", SMALL[0]).stdout

    _cli(stack, "deploy", SMALL[2], "--replicas", "2")
    assert _holders(stack) == {SMALL[2]: {W0, W1}}
    status = nnsight.status()
    assert status[SMALL[2]]["hot_replicas"] == 2
    assert status[SMALL[2]]["state"] == "RUNNING"
    import huggingface_hub

    monkeypatch.setattr(
        huggingface_hub.HfApi, "model_info", lambda self, repo_id, **_: types.SimpleNamespace(id=repo_id)
    )
    assert nnsight.is_model_running(SMALL[2]) is True
    assert nnsight.is_model_running(SMALL[3]) is False
    # Both replicas serve the model's one queue.
    busy = [_submit(SMALL[2], slow_steps=20) for _ in range(4)]
    for backend in busy:
        assert "out" in poll(backend)
    assert {_latest(stack, b.job_id)["meta"]["worker"] for b in busy} == {W0, W1}


def test_a_killed_worker_disappears_and_its_models_redeploy_elsewhere(farm):
    stack = farm.stack
    _cli(stack, "evict", SMALL[2])
    _, meta = _run(SMALL[0])  # not deployed by anyone: the request places it, best fit on W1
    assert meta["worker"] == W1
    assert _holders(stack) == {SMALL[0]: {W1}}
    pid = stack.farm()["cluster"]["workers"][W1]["pid"]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while True:
        status = stack.farm()
        on_dead = [e for e in status["deployments"].values() if e.get("worker") == W1]
        if W1 not in status["cluster"]["workers"] and not on_dead:
            break
        assert time.monotonic() - killed < pace.bound(20), "the dead worker is still in /status"
        time.sleep(0.5)
    # A new request for its model deploys it on the surviving worker.
    _, meta = _run(SMALL[0])
    assert meta["worker"] == W0


def test_flower_shows_the_workers_and_its_metrics(farm):
    flower = farm.stack.flower_url
    metrics = httpx.get(f"{flower}/metrics", timeout=10)
    assert metrics.status_code == 200
    assert "flower_events_total" in metrics.text
    assert W0 in metrics.text
    page = httpx.get(f"{flower}/workers", timeout=10)
    assert page.status_code == 200 and W0 in page.text
