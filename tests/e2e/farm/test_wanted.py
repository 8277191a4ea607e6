"""What the farm was asked to keep, on a real farm through the real CLI: a
deploy that cannot load returns at once with the worker and the reason;
``ndif-celery deployments`` shows every wish (a file, the boot list, a hand
deploy, a schedule, a first request, an unmeetable scale) beside what runs;
``export`` round-trips through ``deploy -f``; ``--dry-run`` changes nothing;
``--sync`` needs ``--force`` to evict a pinned model or everything.

One stack (``up``: embedded Redis, gunicorn, one Celery worker, beat) with a
boot list; the tests run in order and share it. The planning and the
controller's rules are unit-tested in tests/inprocess/test_deployments.py.
"""

from __future__ import annotations

import json
import re
import time

import nnsight
import pytest
import torch

from tests.support.stack import Stack, client_on_stack
from tests.support.tiny_model import PROMPT, build_tiny_gpt2, client_model, snapshot_dir

BOOT, FILED, HAND, SCHED, ASKED, BROKEN = ("wanted/boot", "wanted/filed", "wanted/hand", "wanted/sched",
                                           "wanted/asked", "wanted/broken")
WORKER = "gpu0@wanted-test"
#: The must-show bound for a deploy that cannot load, on a 2-core machine under load.
FAIL_FAST_S = 15.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory, hf_home):
    for seed, repo in enumerate((BOOT, FILED, HAND, SCHED, ASKED, BROKEN)):
        build_tiny_gpt2(hf_home, repo, n_layer=1, seed=70 + seed)
    # A damaged download: the header is whole (so the model is sized), the tensors are cut short.
    weights = (snapshot_dir(hf_home, BROKEN) / "model.safetensors").resolve()
    data = weights.read_bytes()
    weights.unlink()  # the cache may link blobs: write a new file, not through the link
    weights.write_bytes(data[: 8 + int.from_bytes(data[:8], "little") + 16])
    env = {"NDIF_DEPLOYMENTS": f"[{{repo: {BOOT}, pin: true}}]", "NDIF_WORKER_NAME": WORKER,
           "NDIF_WORKER_MEMORY_GIB": "1", "NDIF_PADDING_FACTOR": "0", "NDIF_PADDING_BYTES": "0",
           "NDIF_REPLICA_WAIT_S": "3600", "NDIF_REPLICA_IDLE_S": "3600"}
    with client_on_stack(tmp_path_factory.mktemp("wanted"), hf_home, env) as running:
        yield running


def _cli(stack: Stack, *args: str, ok: bool = True):
    result = stack.cli(*args, timeout=300)
    assert (result.returncode == 0) == ok, result.stdout + result.stderr
    return result


def _rows(stack: Stack) -> dict:
    return {row["model"]: row for row in json.loads(_cli(stack, "deployments", "--json").stdout)}


def _until(check, what: str, stack: Stack, timeout_s: float = 90.0):
    return stack.until(check, what, timeout_s)


def test_a_deploy_that_cannot_load_returns_at_once_with_the_worker_and_the_reason(stack):
    _until(lambda: _rows(stack).get(BOOT, {}).get("state") == "met", "the boot list deployed", stack)
    started = time.monotonic()
    refused = _cli(stack, "deploy", BROKEN, ok=False)
    took = time.monotonic() - started
    assert took < FAIL_FAST_S, f"took {took:.1f} s"
    assert refused.returncode == 1
    said = refused.stderr
    assert f"Error: {BROKEN}: Could not deploy {BROKEN}: it failed to load on {WORKER}: Could not load model" in said
    assert re.search(rf"Could not load model '{BROKEN}' \(.*\): \w+: \S", said), said  # the loader's own error
    row = _rows(stack)[BROKEN]
    assert (row["source"], row["target"], row["running"], row["state"]) == ("cli", 1, [], "failed")
    assert f"failed to load on {WORKER}" in row["reason"]
    # Not loaded again and again: the worker tried once, and the wish stays failed.
    time.sleep(3)
    row = _rows(stack)[BROKEN]
    assert row["state"] == "failed" and row["loading"] == []
    loads = sum(path.read_text(errors="replace").count(f"could not load {BROKEN}")
                for path in stack.logs_dir.glob("worker*.log"))
    assert loads == 1, stack.logs(40)
    _cli(stack, "evict", BROKEN)
    assert BROKEN not in _rows(stack)


def test_wanted_vs_running_names_each_wish_its_source_and_why_one_is_not_met(stack, tmp_path):
    models = tmp_path / "models.yaml"
    models.write_text(f"- repo: {FILED}\n")
    _cli(stack, "deploy", "-f", str(models))
    _cli(stack, "deploy", HAND)
    _cli(stack, "schedule", "add", SCHED, "--from", "now", "--to", "+300s")
    nnsight.CONFIG.API.APIKEY = "anyone"
    model = client_model(ASKED)
    with model.trace(PROMPT, remote=True):
        out = model.transformer.h[0].output.save()
    with model.trace(PROMPT):
        local = model.transformer.h[0].output.save()
    assert torch.equal(out, local)
    scaled = _cli(stack, "scale", HAND, "2", "--no-wait").stdout  # one worker: the second replica has nowhere to go
    assert f"{HAND}: 2 replica(s) requested" in scaled
    rows = _until(lambda: (lambda rows: rows if rows.get(SCHED, {}).get("running")
                           and rows.get(HAND, {}).get("reason") else None)(_rows(stack)),
                  "the schedule's model running and the scale's reason", stack)
    seen = {repo: (row["source"], row["target"], row["running"], row["state"]) for repo, row in rows.items()}
    assert seen == {
        BOOT: ("boot", 1, [WORKER], "met"),
        FILED: ("file", 1, [WORKER], "met"),
        HAND: ("cli", 2, [WORKER], "unmet"),
        SCHED: ("schedule", 1, [WORKER], "met"),
        ASKED: ("request", None, [WORKER], "met"),
    }, rows
    assert rows[BOOT]["pinned"] and rows[SCHED]["pinned"] and not rows[FILED]["pinned"]
    assert rows[HAND]["reason"] == f"Could not deploy {HAND}: no live worker can take another replica of it."
    text = _cli(stack, "deployments").stdout
    assert "no live worker can take another replica of it" in text and "schedule" in text
    _cli(stack, "scale", HAND, "1")


def test_export_round_trips_and_a_dry_run_changes_nothing(stack, tmp_path):
    exported = tmp_path / "exported.yaml"
    _cli(stack, "export", "-o", str(exported))
    text = exported.read_text()
    for repo in (BOOT, FILED, HAND):
        assert f"repo: {repo}" in text
    assert ASKED not in text, "a request's model is nobody's wish"
    before = _rows(stack)
    plan = _cli(stack, "deploy", "-f", str(exported), "--sync", "--dry-run").stdout
    assert "dry run: nothing was changed" in plan
    assert f"{HAND}: would change (source cli -> file)" in plan and f"{FILED}: unchanged" in plan
    assert _rows(stack) == before, "the dry run changed the farm"
    _cli(stack, "deploy", "-f", str(exported), "--sync")
    again = tmp_path / "again.yaml"
    _cli(stack, "export", "-o", str(again))
    assert again.read_text() == text, "deploy -f of an export, exported again, is the same file"


def test_sync_needs_force_to_evict_a_pinned_model_or_everything(stack, tmp_path):
    listed = tmp_path / "listed.yaml"
    listed.write_text(f"- repo: {BOOT}\n  pin: true\n- repo: {FILED}\n  pin: true\n- repo: {HAND}\n")
    _cli(stack, "deploy", "-f", str(listed), "--sync")  # what the export's apply made the file's, listed again
    empty = tmp_path / "empty.yaml"
    empty.write_text("[]\n")
    before = _rows(stack)
    refused = _cli(stack, "deploy", "-f", str(empty), "--sync", ok=False)
    assert (f"--sync would evict pinned {BOOT}, {FILED}; nothing was changed. Give --force to do it."
            in refused.stderr), refused.stderr
    assert _rows(stack) == before
    plan = _cli(stack, "deploy", "-f", str(empty), "--sync", "--dry-run").stdout
    assert f"refused without --force: --sync would evict pinned {BOOT}, {FILED}" in plan
    out = _cli(stack, "deploy", "-f", str(empty), "--sync", "--force").stdout
    for repo in (BOOT, FILED, HAND):
        assert f"{repo}: evicted, no longer listed from {WORKER}" in out, out
    rows = _rows(stack)
    assert not {BOOT, FILED, HAND} & set(rows), rows
