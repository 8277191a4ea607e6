"""What the farm was asked to keep, on a real farm through the real CLI: a
deploy that cannot load returns at once with the worker and the reason;
``ndif-celery deployments`` shows every wish (a file, the boot list, a hand
deploy, a schedule, a first request, an unmeetable scale) beside what runs;
``export`` round-trips through ``deploy -f``; ``--dry-run`` changes nothing;
``--sync`` needs ``--force`` to evict a pinned model or everything.

One stack (``up``: embedded Redis, gunicorn, one Celery worker, beat) with a
boot list; the tests run in order and share it. The planning and the
controller's rules are unit-tested in tests/inprocess/ndif_celery/farm/test_deployments.py.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import nnsight
import pytest
import torch

from tests.support.stacks.stack import Stack, client_on_stack
from tests.support.cases.tiny_model import PROMPT, build_tiny_gpt2, client_model, snapshot_dir

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


def _docs_shape(section: str, names: dict) -> "re.Pattern":
    """The example output under docs/farm.md's heading ``section`` as a pattern:
    its names replaced by this stack's, each ``<...>`` standing for any text."""
    text = (Path(__file__).resolve().parents[3] / "docs" / "farm.md").read_text()
    after = text[text.index(f"### {section}\n"):]
    example = after[after.index("```\n") + 4:]
    example = example[: example.index("```")].strip()
    for name, ours in names.items():
        example = example.replace(name, ours)
    parts = re.split(r"<[^<>]+>", example)
    return re.compile(".+?".join(re.escape(part) for part in parts), re.S)


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
    assert _docs_shape("A deploy that cannot load", {"org/b": BROKEN, "gpu0@host": WORKER}).fullmatch(
        said.strip()), f"docs/farm.md's example is not what the CLI prints: {said}"
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
    # One worker: the second replica has nowhere to go (recorded all the same with --wait-for-workers).
    scaled = _cli(stack, "scale", HAND, "2", "--no-wait", "--wait-for-workers").stdout
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
    header = text.splitlines()[0].split()
    assert header[0] == "MODEL" and {"SOURCE", "WANT", "RUN", "STATE"} <= set(header), text
    _cli(stack, "scale", HAND, "1")


def test_unmeetable_wishes_fail_at_once_naming_why_and_change_nothing(stack, tmp_path):
    """One live worker: a second replica, of a scale, a deploy, a window or a
    file's entry, is refused in seconds, not at the end of --timeout."""
    before = _rows(stack)
    only_one = f"only 1 live worker can serve it ({WORKER}) (it needs "
    started = time.monotonic()
    refused = _cli(stack, "scale", HAND, "2", ok=False)
    took = time.monotonic() - started
    assert took < FAIL_FAST_S, f"took {took:.1f} s"
    assert refused.stderr.startswith(f"Error: 2 replicas of {HAND} wanted but {only_one}"), refused.stderr
    assert refused.stderr.rstrip().endswith("; start another worker or scale to 1"), refused.stderr
    assert _docs_shape("Wishes the live workers cannot meet", {"org/b": HAND, "gpu0@host": WORKER}).fullmatch(
        refused.stderr.strip()), f"docs/farm.md's example is not what the CLI prints: {refused.stderr}"
    refused = _cli(stack, "deploy", ASKED, "--replicas", "3", ok=False).stderr
    assert f"Error: 3 replicas of {ASKED} wanted but {only_one}" in refused and "deploy --replicas 1" in refused
    refused = _cli(stack, "schedule", "add", FILED, "--from", "now", "--to", "+1h", "--replicas", "2", ok=False)
    assert f"the live workers cannot meet this window: 2 replicas of {FILED} wanted but {only_one}" in refused.stderr

    # A file with one good entry (HAND, made the file's) and one unmeetable one; its --sync would
    # evict FILED. The dry run says so; the sync itself changes nothing at all.
    models = tmp_path / "models.yaml"
    models.write_text(f"- repo: {HAND}\n- repo: {ASKED}\n  replicas: 2\n")
    plan = _cli(stack, "deploy", "-f", str(models), "--sync", "--dry-run").stdout
    assert f"{FILED}: would evict, no longer listed from {WORKER}" in plan
    assert f"refused, the live workers cannot meet it: 2 replicas of {ASKED} wanted but {only_one}" in plan, plan
    assert "start another worker or set `replicas: 1`" in plan and "dry run: nothing was changed" in plan
    started = time.monotonic()
    refused = _cli(stack, "deploy", "-f", str(models), "--sync", ok=False).stderr
    assert time.monotonic() - started < FAIL_FAST_S
    assert f"{models}: the live workers cannot meet it: 2 replicas of {ASKED} wanted but {only_one}" in refused
    assert "Nothing was changed (give --wait-for-workers to apply it and wait)." in refused
    assert f"{FILED}: evicted" not in refused
    time.sleep(1)  # an eviction sent would show by now
    assert _rows(stack) == before, "nothing of the file was applied"
    assert len(json.loads(_cli(stack, "schedule", "list", "--json").stdout)) == 1, "only the first window"


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
