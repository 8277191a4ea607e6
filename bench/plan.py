"""What a bench run does: its workloads, their titles and how many repetitions.

Apart from the code that runs them so that the numbers a run is made of (the
full and the smoke plan, the workload names ``--only`` accepts) can be read
and changed in one short place; everything else in the bench reads them from
here. Imports nothing heavy: ``bench/run.py`` sets ``HF_HOME`` and the offline
flags before anything imports transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024
COMPUTE_THREADS = 1  # NDIF_TORCH_THREADS of the compute-bound throughput stack: one "device" per worker
OUT_DIR = ROOT / "bench" / "_out"
TIME_WORKLOADS = ("small_trace", "every_layer", "generate", "session", "big_result")
ALL = TIME_WORKLOADS + ("cold_start", "isolation", "throughput", "cobatch", "fairness", "cpu_per_request",
                        "capacity")
# The farm's code that cpu_per_request holds this checkout's against: main before the work to halve
# the CPU a request costs (its numbers are in docs/performance.md, "CPU per request").
CPU_BASE = "6cb6711"
# Co-batched values against the local solo run: torch.equal where no padding is involved, else within
# the engine's stated tolerance (tests/support/clients/load.py's COBATCH_TOLERANCE, measured in
# tests/inprocess/workers/cobatch/test_engine.py; a smoke test keeps them equal).
COBATCH_TOLERANCE = 1e-5
TITLES = {
    "small_trace": "small trace: one forward pass, one hidden state saved",
    "every_layer": "trace saving every layer's output",
    "generate": "generate {gen_tokens} tokens, per-step saves (last hidden, logits) and the ids",
    "session": "a session of {session_traces} traces (one request)",
    "big_result": "a {big_mib} MiB result (a tensor made inside the block)",
    "cold_start": "cold start: first request on an undeployed model (local = bare from_pretrained)",
    "throughput": "throughput: small traces from N client threads (each its own client model)",
    "throughput_compute": "throughput on a compute-bound model: small traces from N client threads, "
                          "{torch_threads} torch thread per worker and locally",
    "cobatch": "co-batching: small traces from N client threads against one worker, NDIF_COBATCH_MAX=1 (off) "
               "vs the default (on)",
    "cobatch_compute": "co-batching on a compute-bound model: small traces from N client threads against one "
                       "worker, off vs on, {torch_threads} torch thread per worker and locally",
    "isolation": "isolation: small trace in a jailed child (NDIF_DEFAULT_TRUSTED=0) vs in the worker",
    "cpu_per_request": "CPU-ms of each process kind per small trace, a base commit vs this checkout",
    "fairness": "fairness: one key floods a model's queue, five work interactively; first in first out "
                "(NDIF_FAIR_TURNS=0) vs fair turns",
}


@dataclass
class Plan:
    """Repetitions and sizes of one run (``FULL`` or ``SMOKE``, edited by ``--reps`` and ``--big-mib``)."""

    reps: dict
    warmup: int
    big_bytes: int
    cold_reps: int
    isolation_reps: int
    throughput: list  # (clients, requests per client)
    compute_throughput: list  # the same, on the compute-bound model (~250 ms per request)
    cobatch: list = ((1, 100), (4, 8), (16, 3))  # (clients, requests per client) per stack, co-batching off and on
    compute_cobatch: list = ((1, 6), (4, 2), (16, 6))  # the same, on the compute-bound model
    cobatch_rounds: int = 2  # each cell alternates off / on this many times (its requests split between rounds)
    fairness: tuple = (40, 2)  # the flooding key's jobs; how many times around the five light keys go
    cpu: tuple = (6, 25)  # cpu_per_request: rounds, small traces per stack per round
    cpu_base: str = CPU_BASE
    gen_tokens: int = 20
    session_traces: int = 5


FULL = Plan(
    reps={"small_trace": 40, "every_layer": 30, "generate": 15, "session": 20, "big_result": 5},
    warmup=2, big_bytes=256 * MiB, cold_reps=5, isolation_reps=30,
    throughput=[(1, 30), (4, 10), (16, 4)],
    compute_throughput=[(1, 2), (4, 1), (16, 2)],
)
SMOKE = Plan(
    reps={"small_trace": 5, "every_layer": 4, "generate": 3, "session": 3, "big_result": 2},
    warmup=1, big_bytes=16 * MiB, cold_reps=1, isolation_reps=5,
    throughput=[(1, 4), (4, 2), (16, 1)],
    compute_throughput=[(1, 2), (4, 1), (16, 1)],
    cobatch=((4, 2),), compute_cobatch=((4, 1),), cobatch_rounds=1, fairness=(8, 1), cpu=(2, 4),
)

