"""Throughput through one web host and through two, on the multi-host harness.

    .venv/bin/python bench/hosts.py [--clients 4,16] [--requests 48] [--rounds 2] [--out PATH]

Six hosts as network namespaces (``tests/support/stacks/host_farm.py``: a broker host with
Redis, the S3-protocol store and beat; two web hosts; two worker hosts holding
the model; a client host), every service started from the CLI, one gunicorn
process per web host. For each number of clients, ``--requests`` blocking
small traces (layer 0's output of the tiny GPT-2), from that many client
threads on the client host, each with its own client model: all through web1
(``one``), then spread over web1 and web2 (``two``), alternating the two cells
``--rounds`` times so both see the same (noisy) machine. Printed: requests/s
of each, ``two/one``, the CPU seconds each web host's processes spent per
request (how the web's work splits), and how many answers equal the local run
(``torch.equal``).

What it can show on one machine: every host shares its cores, so the web tier
scales out here only as far as the web was the bottleneck; the client's own
CPU (~20-30 ms per call, the GIL of one process) and the workers take the
same cores. The ``web CPU`` columns show the split that, on separate
machines, is what adds capacity. Needs root (``ip netns``); a separate
script, not part of ``make bench`` or its smoke run (about two minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

OUT = ROOT / "bench" / "_out" / "hosts.json"


def _web_cpu_s(host) -> float:
    """CPU seconds (user + system) the processes on ``host`` have spent so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in host.pids():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


def _small_trace(model, url):
    from tests.support.cases.tiny_model import PROMPT

    with model.trace(PROMPT, remote=url) if url else model.trace(PROMPT):
        out = model.transformer.h[0].output.save()
    return out


def run_cell(farm, models: list, urls: list, requests: int, expected) -> dict:
    """``requests`` blocking traces from ``len(models)`` threads on the client
    host, thread i through ``urls[i % len(urls)]``; wall time and correctness."""
    import torch

    from bench.columns import run_clients

    clients = len(models)
    share = [requests // clients + (1 if i < requests % clients else 0) for i in range(clients)]
    done = {"correct": 0, "checked": 0, "errors": []}
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)

    def client(i: int) -> None:
        barrier.wait()
        for _ in range(share[i]):
            try:
                got = _small_trace(models[i], urls[i % len(urls)])
            except Exception as error:  # noqa: BLE001 - counted, the cell goes on
                with lock:
                    done["errors"].append(f"{type(error).__name__}: {str(error)[:300]}")
                continue
            with lock:
                done["checked"] += 1
                done["correct"] += bool(torch.equal(got, expected))

    before = [_web_cpu_s(web) for web in farm.webs]
    wall = farm.client.call(run_clients, client, clients, barrier)
    cpu = [_web_cpu_s(web) - b for web, b in zip(farm.webs, before)]
    return {"wall_s": wall, "web_cpu_s": cpu, **done}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default="4,16", help="client thread counts, comma-separated")
    parser.add_argument("--requests", type=int, default=48, help="requests per cell and round")
    parser.add_argument("--rounds", type=int, default=3, help="times each cell runs, alternating")
    parser.add_argument("--hf-home", help="offline HF cache (default $HF_HOME, else tests/_out/hf)")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    hf_home = Path(args.hf_home or os.environ.get("HF_HOME") or ROOT / "tests" / "_out" / "hf").resolve()
    os.environ.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

    from tests.support.stacks import netns

    why = netns.unavailable()
    if why:
        print(f"SKIP: {why}")
        return 0

    import nnsight

    from bench import measure
    from tests.support.stacks.host_farm import HostFarm
    from tests.support.cases.tiny_model import REPO_ID, build_tiny_gpt2, client_model

    build_tiny_gpt2(hf_home, REPO_ID)
    nnsight.CONFIG.APP.REMOTE_LOGGING = False
    counts = [int(c) for c in args.clients.split(",")]
    out: dict = {"commit": measure.git_commit(), "cpus": os.cpu_count(), "requests": args.requests,
                 "rounds": args.rounds, "cells": {}}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ndif-bench-hosts-") as folder, \
            HostFarm(Path(folder), hf_home) as farm:
        farm.start()
        farm.deploy(REPO_ID, replicas=2)
        out["farm_start_s"] = round(time.monotonic() - started, 1)
        urls = [farm.url(web) for web in farm.webs]
        local = client_model(REPO_ID)
        expected = _small_trace(local, None)
        models = [client_model(REPO_ID) for _ in range(max(counts))]
        for model in models:  # each client's first request (slower) is not measured
            for url in urls:
                farm.client.call(_small_trace, model, url)
        for clients in counts:
            cells = {"one": [], "two": []}
            for _ in range(args.rounds):
                for cell, through in (("one", urls[:1]), ("two", urls)):
                    cells[cell].append(run_cell(farm, models[:clients], through, args.requests, expected))
            out["cells"][clients] = {cell: _summary(runs) for cell, runs in cells.items()}
        out["loadavg_after"] = os.getloadavg()
    out["elapsed_s"] = round(time.monotonic() - started, 1)
    _print(out)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"JSON: {args.out}")
    return 0


def _summary(runs: list) -> dict:
    wall = sum(r["wall_s"] for r in runs)
    answered = sum(r["checked"] for r in runs)
    cpu = [sum(r["web_cpu_s"][i] for r in runs) for i in range(len(runs[0]["web_cpu_s"]))]
    return {
        "requests_per_s": round(answered / wall, 2) if wall else None,
        "web_cpu_ms_per_request": [round(1000 * c / answered, 2) if answered else None for c in cpu],
        "correct": sum(r["correct"] for r in runs), "checked": answered,
        "errors": [e for r in runs for e in r["errors"]][:5],
    }


def _print(out: dict) -> None:
    print(f"\n== hosts: throughput through one web host and two (bench/hosts.py), commit {out['commit']}, "
          f"{out['cpus']} CPUs, {out['requests']} requests x {out['rounds']} rounds per cell, "
          f"farm up in {out['farm_start_s']} s")
    print(f"{'clients':>7}  {'one req/s':>9}  {'two req/s':>9}  {'two/one':>7}  "
          f"{'web CPU ms/req one (web1, web2)':>32}  {'two (web1, web2)':>18}  correct")
    for clients, cell in out["cells"].items():
        one, two = cell["one"], cell["two"]
        ratio = two["requests_per_s"] / one["requests_per_s"] if one["requests_per_s"] and two["requests_per_s"] else 0
        print(f"{clients:>7}  {one['requests_per_s']:>9}  {two['requests_per_s']:>9}  {ratio:>6.2f}x  "
              f"{str(one['web_cpu_ms_per_request']):>32}  {str(two['web_cpu_ms_per_request']):>18}  "
              f"{one['correct'] + two['correct']}/{one['checked'] + two['checked']}")
        for name in ("one", "two"):
            if cell[name]["errors"]:
                print(f"   {name} ERRORS: {cell[name]['errors'][0]}")
    print(f"load average after: {', '.join(f'{x:.2f}' for x in out['loadavg_after'])}; elapsed {out['elapsed_s']} s")


if __name__ == "__main__":
    sys.exit(main())
