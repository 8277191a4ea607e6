"""Two checkouts' workers side by side in one run, against local back-to-back.

The cobatch_compute bench's 16-client "co-batching off" cell (its
"off >= 0.9x local" target), for a change to the worker: one stack from this
checkout (``new``), one from another checkout of the project (``old``, e.g.
``git archive <commit> | tar -x -C /tmp/base``), both with
``NDIF_TORCH_THREADS=1`` and ``NDIF_COBATCH_MAX=1`` on the gpt2-medium-shaped
random model, and the local column (the same requests one after another in
this process, one torch thread). Rounds rotate local / old / new, each round
``--clients`` real nnsight clients released at once (one request each), so
the three columns see the same machine: on a shared one, others' load comes
and goes within seconds, and only ratios measured this way mean anything.
Every answer is ``torch.equal`` to the local run, or the run stops.

    .venv/bin/python bench/pipeline_ab.py --base /tmp/base [--rounds 8] [--clients 16]

Each stack runs its own checkout's code: ``tests/support/stacks/stack.py`` starts the CLI
with the checkout as its working directory.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

PROMPT = "It was the best of times, it was the worst of times."


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="another checkout of the project (its tests/support/stacks/stack.py is used)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--hf-home", default=os.environ.get("HF_HOME", str(ROOT / "tests" / "_out" / "hf")))
    args = parser.parse_args(argv)
    os.environ["HF_HOME"], os.environ["HF_HUB_OFFLINE"] = args.hf_home, "1"

    import nnsight
    import torch

    from bench import models
    from bench.columns import run_clients
    from tests.support.stacks.stack import Stack
    from tests.support.cases.tiny_model import client_model

    info = models.MODELS["gpt2-medium"]
    models.build(info, Path(args.hf_home))
    spec = importlib.util.spec_from_file_location("base_stack", Path(args.base) / "tests" / "support" / "stack.py")
    base_stack = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base_stack)
    env = {"NDIF_TORCH_THREADS": "1", "NDIF_COBATCH_MAX": "1"}
    stacks = {"old": base_stack.Stack(Path(tempfile.mkdtemp(prefix="ab-old-")), env=env),
              "new": Stack(Path(tempfile.mkdtemp(prefix="ab-new-")), env=env)}
    nnsight.CONFIG.APP.REMOTE_LOGGING = False
    try:
        for stack in stacks.values():
            stack.start()
        clients = [client_model(info.repo_id) for _ in range(args.clients)]
        local = client_model(info.repo_id)
        torch.set_num_threads(1)

        def trace(model, remote: bool):
            with model.trace(PROMPT, remote=remote):
                out = model.transformer.h[-1].output.save()
            return out

        ref = trace(local, False)

        def remote_round(url: str) -> float:
            nnsight.CONFIG.API.HOST = url
            barrier, bad = threading.Barrier(len(clients) + 1), []

            def one(i: int) -> None:
                barrier.wait()
                try:
                    if not torch.equal(trace(clients[i], True), ref):
                        bad.append("a value differs from the local run")
                except Exception as error:  # noqa: BLE001 - reported below
                    bad.append(f"{type(error).__name__}: {error}")

            elapsed = run_clients(one, len(clients), barrier)
            if bad:
                raise SystemExit(f"{url}: {bad[0]}")
            return elapsed

        def local_round() -> float:
            started = time.perf_counter()
            for _ in clients:
                if not torch.equal(trace(local, False), ref):
                    raise SystemExit("the local run is not deterministic")
            return time.perf_counter() - started

        for stack in stacks.values():  # deploy, then each client model's and the worker's first requests
            nnsight.CONFIG.API.HOST = stack.url
            trace(clients[0], True)
            remote_round(stack.url)
        walls: dict = {"local": [], "old": [], "new": []}
        order = list(walls)
        n = len(clients)
        print(f"start {time.strftime('%H:%M:%S')}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        for r in range(args.rounds):
            for name in order[r % 3:] + order[:r % 3]:
                walls[name].append(local_round() if name == "local" else remote_round(stacks[name].url))
            print(f"round {r}: " + "  ".join(f"{name} {n / walls[name][-1]:.2f} req/s" for name in order)
                  + f"  old/local {walls['local'][-1] / walls['old'][-1]:.3f}"
                  + f"  new/local {walls['local'][-1] / walls['new'][-1]:.3f}"
                  + f"  new/old {walls['old'][-1] / walls['new'][-1]:.3f}  load {os.getloadavg()[0]:.2f}", flush=True)
        rps = {name: n * len(w) / sum(w) for name, w in walls.items()}
        print("req/s over all rounds: " + "  ".join(f"{name} {value:.3f}" for name, value in rps.items()))
        print(f"old/local {rps['old'] / rps['local']:.3f}  new/local {rps['new'] / rps['local']:.3f}  "
              f"new/old {rps['new'] / rps['old']:.3f}")

        def median(a: str, b: str) -> float:
            return statistics.median(walls[b][i] / walls[a][i] for i in range(args.rounds))

        print(f"median of the rounds: old/local {median('old', 'local'):.3f}  new/local {median('new', 'local'):.3f}  "
              f"new/old {median('new', 'old'):.3f}")
        print(f"end {time.strftime('%H:%M:%S')}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        for stack in stacks.values():
            try:
                stack.stop()
            except Exception as error:  # noqa: BLE001 - the other one is stopped too
                print(f"could not stop a stack: {error}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
