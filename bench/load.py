"""The load test: 50 concurrent real clients x 20 requests each, own prompts.

    .venv/bin/python bench/load.py [--clients 50] [--requests 20] [--workers 1]

Starts a stack of its own (embedded Redis, gunicorn web, ``--workers`` Celery
workers), checks every answer against the same block run locally (torch.equal),
and prints lost / wrong / duplicated counts and p50/p95/p99 latency as seen by
the client. Exits non-zero if anything was lost, wrong or duplicated.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HOME", str(ROOT / "tests" / "_out" / "hf"))
os.environ["HF_HUB_OFFLINE"] = "1"

from tests.support.clients.load import expected_results, run_load  # noqa: E402
from tests.support.stacks.stack import Stack  # noqa: E402
from tests.support.cases.tiny_model import REPO_ID, build_tiny_gpt2, client_model  # noqa: E402


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--workers", type=int, default=1, help="Celery workers in the stack")
    args = parser.parse_args()
    build_tiny_gpt2(Path(os.environ["HF_HOME"]), REPO_ID)
    import nnsight

    nnsight.CONFIG.APP.REMOTE_LOGGING = False
    model = client_model()
    print(f"computing {args.clients * args.requests} local answers ...", flush=True)
    expected = expected_results(model, args.clients, args.requests)
    with Stack(Path(tempfile.mkdtemp(prefix="ndif-load-")), env={
        "HF_HOME": os.environ["HF_HOME"], "HF_HUB_OFFLINE": "1",
        "NDIF_MAX_REPLICAS": str(args.workers), "NDIF_REPLICA_WAIT_S": "0",
    }) as stack:
        for n in range(1, args.workers):
            stack.add_worker(f"cpu{n}@load", gpus="", memory_gib=4)
        nnsight.CONFIG.API.HOST = stack.url
        with model.trace("warm up", remote=True):
            model.transformer.h[-1].output.save()
        report = run_load(model, args.clients, args.requests, expected)
    print(f"load test, tiny GPT-2, {args.workers} worker(s), commit {commit()}")
    print(report.summary())
    lost = report.expected - len(report.latencies_s) - len(report.wrong)
    print(f"lost {lost}, wrong {len(report.wrong)}, duplicated {report.duplicated}")
    for c, r, why in (report.failed + report.wrong)[:10]:
        print(f"  client {c} request {r}: {why}")
    return 0 if lost == 0 and not report.wrong and report.duplicated == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
