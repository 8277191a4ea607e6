"""Cost of isolation per request: the same trace, in-process (trusted key) and
in a fresh jailed child (untrusted key), side by side on one stack.

    .venv/bin/python bench/isolation.py [--requests 40]

Prints p50/p95 of the round trip seen by the real client and of the server's
own run time (``meta.run_ms``), for both paths, and their differences.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HOME", str(ROOT / "tests" / "_out" / "hf"))
os.environ["HF_HUB_OFFLINE"] = "1"

from tests.stack import Stack  # noqa: E402
from tests.tiny_model import PROMPT, REPO_ID, build_tiny_gpt2, client_model  # noqa: E402


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()
    build_tiny_gpt2(Path(os.environ["HF_HOME"]), REPO_ID)
    import nnsight

    nnsight.CONFIG.APP.REMOTE_LOGGING = False
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    with Stack(Path(tempfile.mkdtemp(prefix="ndif-bench-")), env={
        "HF_HOME": os.environ["HF_HOME"], "HF_HUB_OFFLINE": "1", "NDIF_AUTH": "1",
    }) as stack:
        keys = {
            path: stack.cli("keys", "create", "--email", f"{path}@bench", *flags).stdout.strip().splitlines()[-1]
            for path, flags in (("in-process", ["--trusted"]), ("isolated", []))
        }
        nnsight.CONFIG.API.HOST = stack.url
        model = client_model()
        rows = {}
        for path, key in keys.items():
            nnsight.CONFIG.API.APIKEY = key
            for _ in range(3):  # warm up: model loaded, caches primed
                with model.trace(PROMPT, remote=True):
                    model.transformer.h[-1].output.save()
            rows[path] = {"client": [], "server": []}
        for _ in range(args.requests):  # interleaved, so both see the same machine
            for path, key in keys.items():
                nnsight.CONFIG.API.APIKEY = key
                started = time.perf_counter()
                with model.trace(PROMPT, remote=True) as tracer:
                    model.transformer.h[-1].output.save()
                rows[path]["client"].append((time.perf_counter() - started) * 1000)
                rows[path]["server"].append(tracer.backend.meta["run_ms"])
    print(f"isolation cost, tiny GPT-2 (12 layers), {args.requests} requests each, commit {commit}")
    print(f"{'path':<12}{'client p50':>12}{'client p95':>12}{'server p50':>12}{'server p95':>12}  (ms)")
    for path, row in rows.items():
        print(f"{path:<12}{percentile(row['client'], .5):>12.1f}{percentile(row['client'], .95):>12.1f}"
              f"{percentile(row['server'], .5):>12.1f}{percentile(row['server'], .95):>12.1f}")
    added = statistics.median(rows["isolated"]["client"]) - statistics.median(rows["in-process"]["client"])
    ratio = statistics.median(rows["isolated"]["client"]) / statistics.median(rows["in-process"]["client"])
    print(f"isolated - in-process, client p50: {added:+.1f} ms (ratio {ratio:.2f})")


if __name__ == "__main__":
    main()
