"""The bench's smoke run (``bench/run.py --smoke``, about a minute) completes,
measures every workload in every column, and the values the client got from
the null server and from our stack are exactly the local ones. Plus the GPU
bench's CPU-side parts (``--dry-run``: the 1.1B Llama config, and every
workload run locally on a scaled-down Llama built by the same code).

Timings are not asserted (the targets are the bench's business, and this
machine is shared); only that the numbers exist and are positive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMED = ("small_trace", "every_layer", "generate", "session", "big_result", "cold_start")
COLUMNS = ("local", "null", "ours")


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), *args],
        cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=timeout,
    )


def _positive_cell(cell: dict, where: str) -> None:
    assert cell.get("n", 0) >= 1, f"{where}: no samples ({cell.get('errors')})"
    assert cell["p50_ms"] > 0 and cell["p95_ms"] >= cell["p50_ms"], f"{where}: {cell}"
    assert not cell.get("errors"), f"{where}: {cell['errors']}"


def test_smoke_bench_measures_everything_and_gets_the_local_values(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run(["--smoke", "--out", str(out)], timeout=600)
    report = f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, report
    data = json.loads(out.read_text())
    assert "crashed" not in data, data.get("crashed")
    assert data["smoke"] is True and data["commit"] and data["commit"] != "unknown"

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
    for col in COLUMNS + ("ours_isolated",):
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

    # Every target is measured and reported as PASS or FAIL (a FAIL does not fail the run).
    assert len(data["checks"]) == 6
    for check in data["checks"]:
        assert check["verdict"] in ("PASS", "FAIL"), check
        assert f"{check['verdict']}  {check['name']}" in proc.stdout
    for name in TIMED + ("isolation", "throughput"):
        assert f"== {name}:" in proc.stdout
    assert proc.stdout.count(f"commit {data['commit']}") >= len(TIMED) + 2
    assert "every remote column returned exactly the local values" in proc.stdout, report


def test_gpu_bench_cpu_side_parts():
    assert subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu.sh")]).returncode == 0
    proc = _run(["--model", "llama-1b", "--dry-run"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert 1.0e9 < info["model"]["parameters"] < 1.2e9  # ~1.1B
    assert info["model"]["bf16_bytes"] == 2 * info["model"]["parameters"]
    assert set(info["workload_result_bytes"]) == {"small_trace", "every_layer", "generate", "session", "big_result"}
    assert all(size > 0 for size in info["workload_result_bytes"].values())
