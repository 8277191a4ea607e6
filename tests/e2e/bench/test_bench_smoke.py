"""The bench's smoke run (``bench/run.py --smoke``, about a minute) completes,
measures every workload in every column, and the values the client got from
the null server and from our stack are exactly the local ones. Plus the GPU
bench's CPU-side parts (``--dry-run``: the 1.1B Llama config, and every
workload run locally on a scaled-down Llama built by the same code).

Timings are not asserted (the targets are the bench's business, and this
machine is shared); only that the numbers exist and are positive. The smoke
run is ``make test-bench``'s (CI runs it after ``make test``, which leaves it out).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.stacks import launcher
from tests.support.paths import ROOT

TIMED = ("small_trace", "every_layer", "generate", "session", "big_result", "cold_start")
COLUMNS = ("local", "null", "ours")


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    # The bench's stacks inherit this environment: their workers start warm, forked
    # from this pytest process's launcher (tests/support/stacks/launcher.py), since what a
    # smoke run proves is that every workload is measured and exact, not a worker's start.
    env = dict(os.environ)
    # Unpinned (tests/conftest.py pins it for the suite): the bench's workers measure
    # their threads per model and its local column follows them (bench/core.py).
    env.pop("NDIF_TORCH_THREADS", None)
    env.update(launcher.stack_env(env))
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


def _positive_cell(cell: dict, where: str) -> None:
    assert cell.get("n", 0) >= 1, f"{where}: no samples ({cell.get('errors')})"
    assert cell["p50_ms"] > 0 and cell["p95_ms"] >= cell["p50_ms"], f"{where}: {cell}"
    assert not cell.get("errors"), f"{where}: {cell['errors']}"


@pytest.mark.bench_smoke  # `make test-bench`, not `make test`
def test_smoke_bench_measures_everything_and_gets_the_local_values(tmp_path):
    out = tmp_path / "bench.json"
    # cpu_per_request's base: the pinned commit where this clone has its history, else this
    # checkout itself (a shallow clone): the section's machinery is what the smoke run proves.
    from bench.plan import CPU_BASE

    pinned = subprocess.run(["git", "cat-file", "-e", f"{CPU_BASE}^{{commit}}"], cwd=ROOT).returncode == 0
    proc = _run(["--smoke", "--out", str(out)] + ([] if pinned else ["--cpu-base", str(ROOT)]), timeout=600)
    report = f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, report
    data = json.loads(out.read_text())
    assert "crashed" not in data, data.get("crashed")
    assert data["smoke"] is True and data["commit"] and data["commit"] != "unknown"
    # The worker chose its torch threads for the model, and the local column ran on them.
    assert data["torch_threads"] >= 1, data.get("first_request")

    workloads = data["workloads"]
    for name in TIMED:
        columns = workloads[name]["columns"]
        for col in COLUMNS:
            _positive_cell(columns[col], f"{name}/{col}")
        # The client got exactly the local values from both servers.
        assert columns["null"]["correct"] is True, f"{name}: null server gave wrong values {columns['null']}"
        assert columns["ours"]["correct"] is True, f"{name}: our stack gave wrong values {columns['ours']}"
        assert workloads[name]["ratios"]["ours/local p50"] > 0 and workloads[name]["ratios"]["ours/null p50"] > 0

    big = workloads["big_result"]
    assert big["size_ok"] and big["result_tensor_bytes"] >= data["plan"]["big_bytes"]
    assert big["null_prepared"]["mode"] == "url" and big["ours_inline"] is False  # the store path, both
    # Random floats: zstd saves a few percent at most, so the wire carries about the full size.
    assert big["ours_result_bytes"] >= 0.85 * data["plan"]["big_bytes"]
    assert big["floor"]["total"]["p50_ms"] > 0
    for service in ("web", "worker"):
        assert big["memory"][service]["peak_rss_bytes"] > 0

    isolation = workloads["isolation"]["columns"]
    for col in COLUMNS + ("ours_isolated", "ours_zygote"):
        _positive_cell(isolation[col], f"isolation/{col}")
        if col != "local":
            assert isolation[col]["correct"] is True, f"isolation/{col}: {isolation[col]}"

    cells = workloads["throughput"]["cells"]
    expected = {f"{clients}c_{workers}w" for clients, _ in data["plan"]["throughput"] for workers in (1, 2)}
    assert set(cells) == expected, workloads["throughput"]
    for label, cell in cells.items():
        for col in COLUMNS:
            assert cell[col]["rps"] > 0, f"throughput {label}/{col}: {cell[col]}"
            _positive_cell(cell[col], f"throughput {label}/{col}")
        assert cell["null"]["correct"] is True and cell["ours"]["correct"] is True, f"throughput {label}"

    # The smoke run keeps to the tiny model: its throughput cells are client-bound on a CPU, so
    # they are informational and the two-workers target is SKIP here (the full CPU run checks it
    # on the compute-bound model, throughput_compute, which the smoke run does not build).
    if data["device"] == "cpu":
        assert workloads["throughput"]["role"] == "informational"
    assert "throughput_compute" not in workloads

    # Co-batching: a small cell on the tiny model, off (NDIF_COBATCH_MAX=1) vs on, every
    # value the local one (exact, or within the engine's tolerance), and requests really shared forwards.
    cobatch = workloads["cobatch"]
    assert set(cobatch["cells"]) == {f"{clients}c" for clients, _ in data["plan"]["cobatch"]}, cobatch
    for label, cell in cobatch["cells"].items():
        for col in ("local", "off", "on"):
            assert cell[col]["rps"] > 0, f"cobatch {label}/{col}: {cell[col]}"
            _positive_cell(cell[col], f"cobatch {label}/{col}")
        for col in ("off", "on"):
            assert cell[col]["correct"] is True, f"cobatch {label}/{col}: {cell[col]}"
            assert cell[col]["exact"] + cell[col]["within_tolerance"] == cell[col]["checked"] > 0, cell[col]
        assert cell["off"]["shared_max"] == 1, cell["off"]  # off: every request alone
        assert cell["ratios"]["on/off rps"] > 0
    assert "cobatch_compute" not in workloads

    # Fairness: both orders ran, with waits, run times and a Jain index in (0, 1].
    for order, row in workloads["fairness"]["orders"].items():
        assert row["run_p50_ms"] > 0 and row["light_wait_p95_ms"] >= row["light_wait_p50_ms"] >= 0, (order, row)
        assert 0 < row["jain"] <= 1, (order, row)

    # CPU per request: both stacks (the base commit's code and this checkout's) answered every
    # request with the local values; each process kind's CPU-ms per request, the farm's above zero.
    cpu = workloads["cpu_per_request"]
    assert cpu["base"] == (CPU_BASE if pinned else str(ROOT)), cpu
    assert cpu["wrong"] == {"base": 0, "new": 0}, cpu
    for name in ("base", "new"):
        assert cpu["cpu_ms"][name]["farm"] > 0 and cpu["cpu_ms"][name]["client"] > 0, cpu
        assert cpu["cpu_ms"][name]["worker"] > 0 and cpu["cpu_ms"][name]["web"] > 0, cpu

    # The small trace's timeline: every hop measured, summing to about the whole request.
    hops = workloads["small_trace"]["columns"]["ours"]["timeline_mean_ms"]
    assert set(hops) >= {"client_to_web", "web", "broker", "start", "deserialize", "forward", "encode",
                         "relay_and_client"}, hops
    assert sum(hops.values()) <= workloads["small_trace"]["columns"]["ours"]["mean_ms"] * 1.05, hops

    # Every other target is measured and reported as PASS or FAIL (a FAIL does not fail the run).
    # Nine targets (the isolation target twice: fork and zygote; fairness's one; cpu per request),
    # co-batching's three and the capacity section's five.
    names = [check["name"] for check in data["checks"]]
    assert len([n for n in names if not n.startswith(("capacity", "cobatch"))]) == 9, names
    assert len([n for n in names if n.startswith("cobatch")]) == 3, names
    assert len([n for n in names if n.startswith("capacity")]) == 5, names
    for check in data["checks"]:
        if check["name"].startswith("throughput") and data["device"] == "cpu":
            assert check["verdict"] == "SKIP" and "no compute-bound cells" in check["detail"], check
        elif check["name"].startswith("cobatch") and data["device"] == "cpu":
            # The smoke plan has neither compute-bound cells nor a 1-client cell.
            assert check["verdict"] == "SKIP", check
        else:
            assert check["verdict"] in ("PASS", "FAIL"), check
        assert f"{check['verdict']}  {check['name']}" in proc.stdout
    for name in TIMED + ("isolation", "throughput", "cobatch", "fairness", "cpu_per_request"):
        assert f"== {name}:" in proc.stdout
    assert proc.stdout.count(f"commit {data['commit']}") >= len(TIMED) + 3
    assert "every remote column returned exactly the local values" in proc.stdout, report
    # Where the run's minutes went: every section's wall time, in the JSON and the last line.
    assert set(data["section_s"]) == set(TIMED) | {"isolation", "throughput", "cobatch", "fairness", "cpu_per_request", "capacity"}, \
        data["section_s"]
    assert all(took >= 0 for took in data["section_s"].values()) and sum(data["section_s"].values()) > 0
    assert f"isolation {data['section_s']['isolation']:.0f}" in proc.stdout


def test_gpu_bench_cpu_side_parts():
    assert subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu.sh")]).returncode == 0
    proc = _run(["--model", "llama-1b", "--dry-run"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert 1.0e9 < info["model"]["parameters"] < 1.2e9  # ~1.1B
    assert info["model"]["bf16_bytes"] == 2 * info["model"]["parameters"]
    assert set(info["workload_result_bytes"]) == {"small_trace", "every_layer", "generate", "session", "big_result"}
    assert all(size > 0 for size in info["workload_result_bytes"].values())


def _throughput_cell(rps: float, correct: bool = True) -> dict:
    return {"rps": rps, "correct": correct}


def test_throughput_target_is_checked_on_the_compute_bound_cells():
    """The two-workers target reads the compute-bound model's 16-client cells
    (not the tiny model's), says which model and thread setting, and can fail:
    on the rate, and on wrong values."""
    sys.path.insert(0, str(ROOT))
    from bench import run

    args = run.parse_args(["--only", "throughput"])
    args.device = "cpu"
    bench = run.Bench(args, run.FULL, run.MODELS["tiny"], ROOT / "tests" / "_out" / "hf")
    most = max(c for c, _ in run.FULL.compute_throughput)

    def verdict(one: float, two: float, correct: bool = True) -> dict:
        bench.out["workloads"] = {
            "throughput": {"role": "informational", "cells": {
                f"{c}c_{w}w": {"ours": _throughput_cell(100.0)} for c, _ in run.FULL.throughput for w in (1, 2)}},
            "throughput_compute": {"role": "checked", "model": "gpt2-medium", "repo_id": "ndif-bench/gpt2-medium-random",
                                   "torch_threads": 1, "cells": {
                                       f"{most}c_1w": {"ours": _throughput_cell(one)},
                                       f"{most}c_2w": {"ours": _throughput_cell(two, correct)}}},
        }
        [check] = [c for c in bench.checks() if c["name"].startswith("throughput")]
        assert "gpt2-medium" in check["name"] and "NDIF_TORCH_THREADS=1" in check["name"], check
        return check

    assert verdict(1.0, 1.7)["verdict"] == "PASS"
    assert verdict(1.0, 1.5)["verdict"] == "FAIL"
    assert verdict(1.0, 1.9, correct=False)["verdict"] == "FAIL"
    # Without compute-bound cells on a CPU: SKIP, the tiny model's numbers only as information.
    del bench.out["workloads"]["throughput_compute"]
    [check] = [c for c in bench.checks() if c["name"].startswith("throughput")]
    assert check["verdict"] == "SKIP" and "client-bound" in check["detail"], check


def test_cobatch_targets_are_checked_on_the_compute_bound_cells():
    """The co-batching targets: on >= 2.0 x off and off >= 0.9 x local on the compute-bound
    model's most-clients cell, the 1-client cost on the main model's; each can fail, on the rate
    and on wrong values; the bench's tolerance is the engine's stated one."""
    sys.path.insert(0, str(ROOT))
    from bench import run
    from bench.plan import COBATCH_TOLERANCE
    from tests.support.clients.load import COBATCH_TOLERANCE as STATED

    assert STATED == COBATCH_TOLERANCE

    args = run.parse_args(["--only", "cobatch"])
    args.device = "cpu"
    bench = run.Bench(args, run.FULL, run.MODELS["tiny"], ROOT / "tests" / "_out" / "hf")
    most = max(c for c, _ in run.FULL.compute_cobatch)

    def col(rps: float, p50: float = 30.0, correct: bool = True) -> dict:
        return {"rps": rps, "p50_ms": p50, "correct": correct}

    def verdicts(on: float, off: float, local: float, p50_on: float = 30.0, correct: bool = True) -> list:
        bench.out["workloads"] = {
            "cobatch": {"role": "informational", "cells": {"1c": {"on": col(30.0, p50_on), "off": col(30.0),
                                                                   "local": col(60.0)}}},
            "cobatch_compute": {"role": "checked", "model": "gpt2-medium", "torch_threads": 1, "cells": {
                f"{most}c": {"on": col(on, correct=correct), "off": col(off), "local": col(local)}}},
        }
        found = [c for c in bench.checks() if c["name"].startswith("cobatch")]
        assert len(found) == 3 and all("gpt2-medium" in c["name"] for c in found[:2]), found
        return [c["verdict"] for c in found]

    assert verdicts(2.1, 1.0, 1.0) == ["PASS", "PASS", "PASS"]
    assert verdicts(1.9, 1.0, 1.0) == ["FAIL", "PASS", "PASS"]
    assert verdicts(2.1, 1.0, 1.2) == ["PASS", "FAIL", "PASS"]
    assert verdicts(2.1, 1.0, 1.0, p50_on=32.5) == ["PASS", "PASS", "FAIL"]
    assert verdicts(2.1, 1.0, 1.0, correct=False)[0] == "FAIL"
    # Without compute-bound cells on a CPU: SKIP, the tiny model's numbers only as information.
    del bench.out["workloads"]["cobatch_compute"]
    assert [c["verdict"] for c in bench.checks() if c["name"].startswith("cobatch")][:2] == ["SKIP", "SKIP"]
