"""The bench: every workload against three servers, measured in one run.

    .venv/bin/python bench/run.py            # full (under 10 minutes on 2 cores)
    .venv/bin/python bench/run.py --smoke    # about a minute: few repetitions, a 16 MiB "big" result
    .venv/bin/python bench/run.py --only small_trace,isolation --out /tmp/b.json
    .venv/bin/python bench/run.py --model llama-1b --dry-run   # CPU-side checks only

Columns, for the same block run by the unmodified nnsight 0.8.1 client:

- **local**: in this process with nnsight, no server (the compute floor);
- **null**: ``bench/null_server.py``, the wire protocol answering at once with
  the result prepared in advance (the protocol floor);
- **ours**: the full stack started through the real CLI (``tests.support.stacks.stack.Stack``:
  embedded Redis, gunicorn web, a Celery worker, Flower, filesystem store).

Workloads: ``small_trace``, ``every_layer``, ``generate`` (20 tokens, per-step
saves), ``session`` (5 traces), ``big_result`` (256 MiB, against the bare
serialization floor, with the peak RSS of the web and the worker),
``cold_start`` (first request on an undeployed model against its bare
``from_pretrained``), ``throughput`` (1, 4 and 16 client threads, one and two
workers; see below) and ``isolation`` (the isolated path, NDIF_DEFAULT_TRUSTED=0, against
the in-process path). Each table is printed with p50/p95, ours/local and
ours/null and the git commit; the targets are printed as PASS/FAIL
lines (a FAIL does not fail the run). The values every remote column gets are
compared with the local run (``torch.equal``) and the outcome is recorded.
JSON goes to ``bench/_out/bench.json`` (``bench-smoke.json`` with ``--smoke``)
or ``--out``.

Throughput on a CPU: the tiny model costs ~1 ms of compute per request while
the client costs ~20-30 ms of CPU per call, so its cells measure the client
process and the web, and a second worker on the same two cores only adds
contention. The full CPU run therefore also measures throughput on a
compute-bound model (``throughput_compute``: GPT-2 medium's shape, random
weights, ~250 ms per forward on one thread) on a stack of its own with
``NDIF_TORCH_THREADS=1`` (one intra-op thread per worker, standing for one
device per worker; the local column runs with ``torch.set_num_threads(1)``),
and the two-workers target is checked on those cells. The tiny model's cells
are still printed, as the client-bound view. ``--throughput-model`` chooses
(``auto``: the compute-bound model on a full CPU run; on a GPU, and in
``--smoke``, the main model only). On a CPU without compute-bound cells the
target is reported as SKIP, not measured on client-bound cells.

This file is the entry point (arguments, the dry run, ``main``); the run is
``bench.core.Bench``, with one module per section in ``bench/sections/``, the
plan in ``bench/plan.py`` and what a column is made of in ``bench/columns.py``
(see bench/README.md's "Layout").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench import measure  # noqa: E402  (no torch at import)
from bench.columns import CLIENT_NICE  # noqa: E402
from bench.core import Bench  # noqa: E402
from bench.models import MODELS, BenchModel  # noqa: E402
from bench.plan import ALL, FULL, OUT_DIR, SMOKE, MiB, Plan  # noqa: E402,F401  (OUT_DIR: bench/isolation.py)

# -- entry point ---------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="ndif-celery bench: local vs null server vs ours")
    parser.add_argument("--smoke", action="store_true", help="about a minute: few repetitions, a 16 MiB big result")
    parser.add_argument("--cpu-base", help="cpu_per_request's base: a commit or a checkout folder "
                        "(default bench.plan.CPU_BASE)")
    parser.add_argument("--out", help="JSON path (default bench/_out/bench.json, bench-smoke.json with --smoke)")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(ALL)}")
    parser.add_argument("--model", default="tiny", choices=sorted(MODELS), help="which model (bench/models.py)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="where the local column runs (auto: cuda when available)")
    parser.add_argument("--hf-home", help="offline HF cache (default $HF_HOME, else tests/_out/hf)")
    parser.add_argument("--stack-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the stacks (e.g. NDIF_WORKER_GPUS=0)")
    parser.add_argument("--throughput-model", default="auto", choices=["auto", "main"] + sorted(MODELS),
                        help="the compute-bound model the two-workers target is measured on, besides the main "
                             "model's throughput cells (auto: gpt2-medium on a full CPU run, none on a GPU or "
                             "with --smoke; main: none)")
    parser.add_argument("--second-worker-gpus", default="", help="GPUs of the second worker (throughput)")
    parser.add_argument("--second-worker-memory-gib", type=float, default=4.0)
    parser.add_argument("--client-nice", type=int, default=CLIENT_NICE,
                        help="nice value of the client threads (default 10: on a farm clients run on their own "
                             "machines; 0: they compete with the server for its cores as equals)")
    parser.add_argument("--big-mib", type=int, help="size of the big result in MiB (overrides the plan)")
    parser.add_argument("--reps", type=int, help="repetitions of every timed workload, cold start and isolation "
                                                 "(overrides the plan)")
    parser.add_argument("--dry-run", action="store_true",
                        help="build nothing, start nothing: check the plan, the model's config and the workloads")
    return parser.parse_args(argv)


def dry_run(args: argparse.Namespace, plan: Plan, model: BenchModel, hf_home: Path) -> int:
    """What a run would do, and the CPU-side parts that can break before a GPU
    is there: every bench file parses, the model's config and size, and every
    workload runs locally on a scaled-down twin of the model built by the same
    code (for the Llama: 2 layers, hidden 64, bf16). Starts no server."""
    import ast

    import torch

    from bench import models, workloads

    for path in sorted((ROOT / "bench").rglob("*.py")):  # the sections too
        ast.parse(path.read_text(), str(path))
    info, twin = models.dry_run(model, hf_home)
    spec = workloads.Spec(gpt2=twin.gpt2, gen_tokens=plan.gen_tokens, session_traces=plan.session_traces,
                          big_bytes=4 * MiB)
    from tests.support.cases.tiny_model import client_model

    local = client_model(twin.repo_id, dtype=getattr(torch, twin.dtype))
    ran = {}
    for name, fn in workloads.WORKLOADS.items():
        saves = fn(local, {}, spec)
        again = fn(local, {}, spec)
        found = measure.difference(again, saves)
        if found:
            raise RuntimeError(f"dry run: {name} on {twin.repo_id} is not deterministic: {found}")
        ran[name] = measure.result_bytes(saves)
    print(json.dumps({"dry_run": True, "model": info, "ran_locally_on": twin.repo_id, "workload_result_bytes": ran,
                      "only": args.only or ",".join(ALL), "plan": plan.__dict__, "commit": measure.git_commit()},
                     indent=1, default=str))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = SMOKE if args.smoke else FULL
    if args.big_mib:
        plan = replace(plan, big_bytes=args.big_mib * MiB)
    if args.reps:
        plan = replace(plan, reps={k: args.reps for k in plan.reps}, cold_reps=args.reps, isolation_reps=args.reps)
    model = MODELS[args.model]
    hf_home = Path(args.hf_home or os.environ.get("HF_HOME") or ROOT / "tests" / "_out" / "hf").resolve()
    # Before anything imports transformers / huggingface_hub (they read these once).
    os.environ["HF_HOME"] = str(hf_home)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    if args.dry_run:
        return dry_run(args, plan, model, hf_home)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    from bench import models

    models.build(model, hf_home)
    bench = Bench(args, plan, model, hf_home)
    try:
        bench.run()
    except KeyboardInterrupt:
        print("interrupted; stopping the stacks", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        bench.out["crashed"] = traceback.format_exc()
        bench.save_json()
        return 1
    finally:
        bench.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
