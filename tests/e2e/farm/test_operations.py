"""Operators' tools on one real farm: declarative deployments, scheduled
pins, synthetic health probes and usage, driven through the real CLI, the real
nnsight client and raw HTTP against one stack (``up``: embedded Redis,
gunicorn, a Celery worker, beat, Flower) with auth on, plus a second worker
that joins. The tests run in order and share the farm; each says what it
starts from. Short intervals come from the NDIF_* variables (a probe every two
seconds, the controller every 0.5 s). Parsing and window logic are unit-tested
in tests/inprocess/ndif_celery/farm/test_deployments.py, test_schedules.py, test_probes.py and
test_usage.py.

Keys: ``probe`` (admin, trusted: the beat's ``NDIF_PROBE_API_KEY``), ``ada``
and ``bob`` (trusted). The stack's worker owns two (fake) GPUs, the one that
joins one, so GPU-seconds are each job's run time times 2 or 1.
"""

from __future__ import annotations

import json
import types

import httpx
import nnsight
import pytest
import torch
from nnsight.intervention.backends.remote import RemoteError

from ndif_celery.accounts import db
from ndif_celery.farm.actions import model_key_for
from ndif_celery.monitoring.alerts import ALERT_AFTER_S
from ndif_celery.policy.model_policy import TRANSFORMERS_MODEL
from tests.support.clients.load import COBATCH_TOLERANCE
from tests.support.stacks.servers import Receiver
from tests.support.stacks.stack import Stack
from tests.support.cases.tiny_model import PROMPT, build_tiny_gpt2, client_model, snapshot_dir

BOOT, A, B, C, SCHED = "ops/boot", "ops/a", "ops/b", "ops/c", "ops/sched"
TAGGER = "ops/tagger"  # deployed as a token classifier, for named users
W0, W1 = "gpu0@ops-test", "gpu2@ops-test"
DEVICES = {W0: 2, W1: 1}


METRICS_TOKEN = "prometheus-scrape-token-5d2c"


@pytest.fixture(scope="module")
def ops(tmp_path_factory, hf_home):
    for seed, repo in enumerate((BOOT, A, B, C, SCHED, TAGGER)):
        build_tiny_gpt2(hf_home, repo, n_layer=1, seed=40 + seed)
    home = tmp_path_factory.mktemp("operations") / "home"
    home.mkdir(parents=True)
    engine = db.engine_for(f"sqlite:///{home / 'ndif.db'}")
    keys = {
        "probe": db.create_key(engine, "probe@ops.test", ("admin", "trusted")),
        "ada": db.create_key(engine, "ada@ops.test", ("trusted",)),
        "bob": db.create_key(engine, "bob@ops.test", ("trusted",)),
    }
    ids = {row["email"].split("@")[0]: row["id"] for row in db.list_keys(engine)}
    engine.dispose()
    receiver = Receiver()
    stack = Stack(home, env={
        "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "NDIF_AUTH": "1", "NDIF_ISOLATION": "fork",  # every key trusted: no job needs an exec'd zygote
        "NDIF_DEPLOYMENTS": f"[{{repo: {BOOT}, pin: true}}]",
        "NDIF_PROBE_INTERVAL_S": "2", "NDIF_PROBE_TIMEOUT_S": "30", "NDIF_PROBE_API_KEY": keys["probe"],
        "NDIF_METRICS_TOKEN": METRICS_TOKEN,
        "NDIF_ALERT_WEBHOOK_URL": receiver.url,
        "NDIF_WORKER_NAME": W0, "NDIF_WORKER_GPUS": "0,1", "NDIF_WORKER_MEMORY_GIB": "1",
        "NDIF_PADDING_FACTOR": "0", "NDIF_PADDING_BYTES": "0",
        "NDIF_REPLICA_WAIT_S": "3600", "NDIF_REPLICA_IDLE_S": "3600",
    })
    api = nnsight.CONFIG.API
    saved = api.HOST, api.APIKEY
    try:
        stack.start()
        api.HOST = stack.url
        yield types.SimpleNamespace(stack=stack, keys=keys, ids=ids, receiver=receiver, hf_home=hf_home, ran=[])
    finally:
        api.HOST, api.APIKEY = saved
        stack.discard()
        receiver.close()


def _until(check, what: str, stack: Stack, timeout_s: float = 90.0):
    return stack.until(check, what, timeout_s)


def _held(stack: Stack) -> dict[str, dict]:
    """repo -> {worker: entry} of the HOT deployments in /status."""
    held: dict[str, dict] = {}
    for entry in stack.farm()["deployments"].values():
        if entry.get("deployment_level") == "HOT":
            held.setdefault(entry["repo_id"], {})[entry["worker"]] = entry
    return held


def _running(stack: Stack, repo: str, replicas: int = 1):
    entries = _held(stack).get(repo, {})
    running = [e for e in entries.values() if e["application_state"] == "RUNNING"]
    return running if len(running) == replicas == len(entries) else None


def _cli(stack: Stack, *args: str, ok: bool = True):
    result = stack.cli(*args, timeout=300)
    assert (result.returncode == 0) == ok, result.stdout + result.stderr
    return result


def _trace(ops, repo: str, key: str, record: bool = True, **named):
    """A remote trace as ``key`` (``named``: the client model's revision, say); its
    logits equal a local run's. Returns the job's meta."""
    nnsight.CONFIG.API.APIKEY = ops.keys[key]
    model = client_model(repo, **named)
    with model.trace(PROMPT, remote=True) as tracer:
        out = model.transformer.h[0].output.save()
    with model.trace(PROMPT):
        local = model.transformer.h[0].output.save()
    meta = dict(tracer.backend.meta)
    # Alone, bit for bit; co-batched with a probe's trace, within the engine's stated tolerance.
    assert torch.equal(out, local) if meta.get("cobatch", 1) == 1 else torch.allclose(out, local, rtol=0,
                                                                                 atol=COBATCH_TOLERANCE), meta
    if record:
        ops.ran.append((key, repo, meta))
    return meta


def _metric(stack: Stack, name: str, bearer: str = "", **labels) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
    text = httpx.get(stack.url + "/metrics", headers=headers, timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def _dashboard(ops) -> str:
    response = httpx.get(ops.stack.url + "/dashboard", auth=("ops", ops.keys["probe"]), timeout=20)
    assert response.status_code == 200, response.text[:300]
    return response.text


# --- declarative deployments ------------------------------------------------------------


def test_boot_deployments_after_up_and_again_when_a_worker_joins(ops):
    """NDIF_DEPLOYMENTS is applied when the farm starts; evicted by hand, it is
    deployed again when a second worker joins the farm."""
    stack = ops.stack
    [entry] = _until(lambda: _running(stack, BOOT), "ops/boot deployed at boot", stack)
    assert entry["pinned"] and entry["worker"] == W0
    _cli(stack, "evict", BOOT)
    assert BOOT not in _held(stack)
    stack.add_worker(W1, gpus="2", memory_gib=1)
    [again] = _until(lambda: _running(stack, BOOT), "ops/boot deployed again after a worker joined", stack)
    assert again["pinned"]


def test_a_models_file_is_applied_then_synced(ops, tmp_path, hf_home):
    """``deploy -f``: loads, pins and who may use it; ``--sync`` with a shorter file
    evicts what the file no longer lists and leaves a hand-deployed model alone."""
    stack = ops.stack
    models = tmp_path / "models.yaml"
    models.write_text(f"- repo: {BOOT}\n  pin: true\n"
                      f"- repo: {A}\n  pin: true\n  users: [ada@ops.test]\n"
                      f"- repo: {B}\n"
                      f"- repo: {TAGGER}\n  task: token-classification\n  users: [ada@ops.test]\n")
    out = _cli(stack, "deploy", "-f", str(models)).stdout
    assert f"{A}: added" in out and f"{B}: added" in out and f"{BOOT}: unchanged" not in out.split("added")[0]
    _cli(stack, "deploy", C)  # by hand: not the file's
    held = _held(stack)
    assert all(_running(stack, repo) for repo in (A, B, C)), held
    assert [e["pinned"] for e in held[A].values()] == [True] and not any(e["pinned"] for e in held[B].values())

    _trace(ops, A, "ada")
    # Bob names A's weights every way: the default branch, "main", the commit it points at.
    commit = snapshot_dir(hf_home, A).name
    nnsight.CONFIG.API.APIKEY = ops.keys["bob"]
    for revision in (None, "main", commit):
        named = client_model(A, revision=revision)
        with pytest.raises(RemoteError, match="deployed on this farm for named users only"):
            with named.trace(PROMPT, remote=True):
                named.transformer.h[0].output.save()
    # Ada's trace by the commit runs on the one deployment there is, not on a copy.
    _trace(ops, A, "ada", revision=commit)
    assert [entry["model_key"] for entry in stack.farm()["deployments"].values() if entry["repo_id"] == A] == [
        model_key_for(A)], "a second deployment of the same weights"
    # The tagger, asked for by its task's alias ("ner" is token-classification), by raw HTTP.
    for task in ("ner", "token-classification"):
        sent = f"{TRANSFORMERS_MODEL}:{json.dumps({'repo_id': TAGGER, 'revision': None, 'task': task})}"  # as sent
        envelope = {"model_key": sent, "session_id": "", "compress": False, "env": {}}
        refused = httpx.post(f"{stack.url}/request", data={"data": json.dumps(envelope)},
                             files={"blob": ("request", b"x", "application/octet-stream")},
                             headers={"ndif-api-key": ops.keys["bob"]}, timeout=30)
        assert refused.status_code == 403 and "for named users only" in refused.json()["detail"], refused.text
    _trace(ops, B, "bob")

    bad = tmp_path / "bad.yaml"
    bad.write_text(f"- repo: {A}\n- repo: {B}\n  replicas: two\n")
    refused = _cli(stack, "deploy", "-f", str(bad), "--sync", ok=False)
    assert "entry 2 (ops/b): field `replicas` must be a whole number" in refused.stderr
    assert _running(stack, B), "a bad file changes nothing"

    models.write_text(f"- repo: {BOOT}\n  pin: true\n- repo: {A}\n  pin: true\n  users: [ada@ops.test]\n")
    out = _cli(stack, "deploy", "-f", str(models), "--sync").stdout
    assert f"{B}: evicted, no longer listed" in out
    held = _held(stack)
    assert B not in held and _running(stack, C) and _running(stack, A), held


def test_scale_adds_and_removes_replicas(ops):
    stack = ops.stack
    _cli(stack, "scale", A, "2")
    assert {e["worker"] for e in _running(stack, A, replicas=2)} == {W0, W1}
    out = _cli(stack, "scale", A, "1").stdout
    evicted = out.split("evicting the replicas on ")[1].splitlines()[0]
    [kept] = _running(stack, A)
    assert evicted in (W0, W1) and kept["worker"] != evicted
    assert f"{A}: 1 replica(s), on {kept['worker']}" in out, "the confirmation names the worker that keeps it"


# --- scheduled pins -----------------------------------------------------------------------


def test_a_schedule_window_pins_then_unpins(ops):
    stack = ops.stack
    # A window long enough to be read as active on a loaded machine (the load can take 20 s there).
    out = _cli(stack, "schedule", "add", SCHED, "--from", "+1s", "--to", "+30s").stdout
    schedule_id = out.split(":")[0]
    [entry] = _until(lambda: _running(stack, SCHED), "ops/sched loaded in its window", stack, 30)
    assert entry["pinned"]
    listed = json.loads(_cli(stack, "schedule", "list", "--json").stdout)
    assert [(w["id"], w["repo"], w["state"]) for w in listed] == [(schedule_id, SCHED, "active")]
    page = _dashboard(ops)
    assert schedule_id in page.split('id="schedule"')[1].split("</table>")[0]
    _until(lambda: SCHED not in _held(stack), "ops/sched evicted when its window closed", stack, 60)
    assert json.loads(_cli(stack, "schedule", "list", "--json").stdout)[0]["state"] == "ended"
    _cli(stack, "schedule", "remove", schedule_id)
    assert "no schedules" in _cli(stack, "schedule", "list").stdout


# --- health probes ---------------------------------------------------------------------------


def _probe_ok(ops, repo: str, ok: bool) -> bool:
    return _metric(ops.stack, "ndif_probe_ok", model=repo) == (1.0 if ok else 0.0)


def _redeploy(stack: Stack, repo: str) -> None:
    _cli(stack, "evict", repo)
    _cli(stack, "deploy", repo, "--pin")


def test_a_probe_goes_red_when_the_weights_are_corrupted_and_green_after(ops):
    """The corruption is what a damaged model cache does: the checkpoint's bytes
    change on disk under an unchanged header (every float scaled by 1.5, as a bad
    sync or a disk error would leave them), and the next load reads them. The
    trusted path's weight check (workers/models/integrity.py) compares against what was
    loaded, so it sees nothing: only a probe that knows the right answer does.
    The probe's reference was recorded by its first green probe, at boot."""
    import numpy

    stack = ops.stack
    _until(lambda: _probe_ok(ops, BOOT, True), "ops/boot's probe green", stack)
    assert _metric(stack, "ndif_probe_latency_seconds", model=BOOT) > 0
    weights = (snapshot_dir(ops.hf_home, BOOT) / "model.safetensors").resolve()
    original = weights.read_bytes()
    header = 8 + int.from_bytes(original[:8], "little")
    data = numpy.frombuffer(original[header:], dtype=numpy.float32) * numpy.float32(1.5)
    try:
        weights.write_bytes(original[:header] + data.tobytes())
        _redeploy(stack, BOOT)
        _until(lambda: _probe_ok(ops, BOOT, False), "ops/boot's probe red on corrupted weights", stack)
        firing = _until(lambda: [a for a in ops.receiver.received if a["status"] == "firing" and a["model"] == BOOT],
                        "the webhook's firing alert, a minute red", stack, ALERT_AFTER_S + 30)
        assert "differ from the reference" in firing[-1]["error"], firing
        page = _dashboard(ops).split('id="probes"')[1].split("</table>")[0]
        assert "FAILING" in page and "the weights changed" in page
        probes = json.loads(_cli(stack, "probes", "--json").stdout)
        assert [p["ok"] for p in probes if p["repo"] == BOOT] == [False]
    finally:
        weights.write_bytes(original)
    _redeploy(stack, BOOT)
    _until(lambda: _probe_ok(ops, BOOT, True), "ops/boot's probe green again", stack)
    resolved = _until(lambda: [a for a in ops.receiver.received if a["status"] == "resolved" and a["model"] == BOOT],
                      "the webhook's resolved alert", stack, 30)
    assert resolved
    assert _metric(stack, "ndif_probe_runs_total", model=BOOT, result="failed") >= 1


# --- usage -------------------------------------------------------------------------------------


def test_usage_totals_match_the_jobs_the_test_ran(ops):
    stack = ops.stack
    for _ in range(2):
        _trace(ops, A, "ada")
    nnsight.CONFIG.API.APIKEY = ops.keys["bob"]
    model = client_model(C)
    with pytest.raises(RemoteError):
        with model.trace(PROMPT, remote=True):
            model.transformer.h[7].output.save()  # one layer: an IndexError on the worker
    ada = [meta for key, _, meta in ops.ran if key == "ada"]
    assert len(ada) == 4  # two here, two in test_a_models_file_is_applied_then_synced (one by the commit)
    expected = {
        "jobs": len(ada), "errors": 0,
        "gpu_seconds": sum(m["run_ms"] / 1000 * DEVICES[m["worker"]] for m in ada),
        "run_seconds": sum(m["run_ms"] / 1000 for m in ada),
        "bytes_in": sum(m["payload_bytes"] for m in ada), "bytes_out": sum(m["result_bytes"] for m in ada),
    }
    report = json.loads(_cli(stack, "usage", "--email", "ada@ops.test", "--json").stdout)
    [row] = report["keys"]
    assert row["owner"] == f"key:{ops.ids['ada']}" and row["email"] == "ada@ops.test"
    for name, value in expected.items():
        assert row[name] == pytest.approx(value, abs=2e-3), (name, row, expected)
    assert [m["model"] for m in report["models"]] == [A]

    bob = json.loads(_cli(stack, "usage", "--key", str(ops.ids["bob"]), "--json").stdout)["total"]
    assert (bob["jobs"], bob["errors"]) == (2, 1), "bob's trace on ops/b and his error; the 403 is not a job"
    text = _cli(stack, "usage", "--since", "1h").stdout
    assert "ada@ops.test" in text and "bob@ops.test" in text
    assert "probe@ops.test" not in text, "the probes' own jobs are kept apart"
    owners = {row["owner"] for row in json.loads(_cli(stack, "usage", "--json").stdout)["keys"]}
    assert owners == {f"key:{ops.ids['ada']}", f"key:{ops.ids['bob']}"}, owners
    with_probes = json.loads(_cli(stack, "usage", "--probes", "--json").stdout)["keys"]
    [probe] = [row for row in with_probes if row["owner"] == f"key:{ops.ids['probe']}"]
    assert probe["email"] == "probe@ops.test" and probe["jobs"] > len(ada), "asked for, they are there"
    assert "probe@ops.test" in _cli(stack, "usage", "--since", "1h", "--probes").stdout

    # Per-key series to a scraper with the metrics token, or an admin key; not to anyone.
    jobs = _until(lambda: _metric(stack, "ndif_usage_jobs_total", METRICS_TOKEN,
                                  key=f"key:{ops.ids['ada']}") == len(ada), "ada's jobs in /metrics", stack, 15)
    assert jobs
    assert _metric(stack, "ndif_usage_gpu_seconds_total", ops.keys["probe"], key=f"key:{ops.ids['ada']}") == pytest.approx(
        expected["gpu_seconds"], abs=2e-3)
    for shown in ("", ops.keys["ada"], "not-the-token"):
        text = httpx.get(stack.url + "/metrics", headers={"Authorization": f"Bearer {shown}"} if shown else {},
                         timeout=10).text
        assert "ndif_usage_" not in text and "key:" not in text, f"per-key series shown to {shown or 'anyone'}"
        assert "ndif_jobs_total" in text, "the farm's totals are for everyone"
    page = _dashboard(ops).split('id="usage"')[1].split("</table>")[0]
    assert "ada@ops.test" in page and f"key:{ops.ids['ada']}" in page


# --- the health probes' jobs kept apart ----------------------------------------------------------


def _jobs(stack: Stack, *args: str) -> list[dict]:
    return json.loads(_cli(stack, "jobs", "--since", "1h", "--limit", "100000", "--json", *args).stdout)


def test_the_probes_jobs_are_left_out_of_jobs_and_the_dashboard_unless_asked(ops):
    """A probe every two seconds per model: by now they outnumber the users' jobs many
    times. ``jobs`` and the dashboard show the users' (all of them) and no probe's;
    ``--probes`` and ``?probes=1`` show the probes' too."""
    stack = ops.stack
    probe, ada, bob = (f"key:{ops.ids[name]}" for name in ("probe", "ada", "bob"))
    shown = _jobs(stack)
    assert sorted(row["owner"] for row in shown) == sorted([ada] * 4 + [bob] * 2), [
        (row["owner"], row["model"]) for row in shown]
    assert not any(row["probe"] for row in shown)
    everything = _jobs(stack, "--probes")
    probes = [row for row in everything if row["owner"] == probe]
    assert len(probes) > len(shown) and all(row["probe"] for row in probes)
    assert {row["job_id"] for row in shown} < {row["job_id"] for row in everything}

    text = _cli(stack, "jobs").stdout
    assert "ada@ops.test" in text and "bob@ops.test" in text and "probe@ops.test" not in text
    assert "probe@ops.test" in _cli(stack, "jobs", "--probes").stdout

    table = _dashboard(ops).split('id="jobs"')[1].split("</table>")[0]
    assert "ada@ops.test" in table and "bob@ops.test" in table and "probe@ops.test" not in table
    for row in shown:
        assert row["job_id"] in table
    response = httpx.get(stack.url + "/dashboard?probes=1", auth=("ops", ops.keys["probe"]), timeout=20)
    assert "probe@ops.test" in response.text.split('id="jobs"')[1].split("</table>")[0]


def test_the_beats_log_holds_no_line_of_the_probe_client(ops):
    """The nnsight client in the probe's child prints a status line per job (its id,
    QUEUED, RUNNING, COMPLETED, rewritten with a spinner while it waits). None of it
    reaches the beat's log; a probe that failed there leaves one summary line."""
    probe_ids = {row["job_id"] for row in _jobs(ops.stack, "--probes") if row["probe"]}
    assert len(probe_ids) >= 10
    log = (ops.stack.logs_dir / "beat.log").read_text(errors="replace")
    assert "beat" in log.lower(), "the beat's log, with the beat's own lines"
    mentions = [line for line in log.splitlines() if any(job_id in line for job_id in probe_ids)]
    summaries = [line for line in mentions if line.startswith("probe_runner: the probe of ") and " failed: " in line]
    assert mentions == summaries, mentions[:5]
    assert len(summaries) < len(probe_ids) / 2
