"""Throughput: requests/s from N client threads, each with its own client
model, with one worker and then two, on the main model and (full CPU run) on
a compute-bound one on a stack of its own.

Why two models on a CPU: the tiny model costs ~1 ms of compute per request
while the client costs ~20-30 ms of CPU per call, so its cells measure the
client process and the web; the two-workers target is checked on the
compute-bound model's cells (``throughput_compute``), see ``bench/run.py``'s
docstring. torch, nnsight and ``bench.workloads`` are imported inside the
methods: ``bench/run.py`` sets ``HF_HOME`` and the offline flags first.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Callable, Optional

from bench import measure
from bench.columns import Column, last_meta, run_clients
from bench.models import MODELS, BenchModel
from bench.plan import COMPUTE_THREADS


class ThroughputSection:
    """Mixin of ``bench.core.Bench``: ``throughput()``, ``compute_throughput()`` and their cells."""

    def throughput_model(self) -> Optional[BenchModel]:
        """The compute-bound model the throughput target is measured on, or None
        (measured on the main model's cells: a GPU run, or ``--smoke``)."""
        choice = self.args.throughput_model
        if choice == "auto":
            choice = "gpt2-medium" if self.args.device == "cpu" and not self.args.smoke else "main"
        return None if choice == "main" else MODELS[choice]

    @contextlib.contextmanager
    def compute_model(self, info: BenchModel):
        """The compute-bound model's cells (throughput_compute, cobatch_compute) each
        run on stacks of their own: build the model once, stop every other stack
        (their idle services must not share the cores), and hold torch at
        ``COMPUTE_THREADS`` for the local column, as the workers' NDIF_TORCH_THREADS.
        Yields the workload spec and the seconds the build took."""
        import torch

        from bench import models
        from bench.workloads import Spec

        started = time.perf_counter()
        models.build(info, self.hf_home)
        built_s = time.perf_counter() - started
        for stack_name in ("iso_stack", "zygote_stack", "stack", "compute_stack"):
            stack = getattr(self, stack_name)
            if stack is not None:
                with contextlib.suppress(Exception):
                    stack.discard()
                setattr(self, stack_name, None)
        spec = Spec(gpt2=info.gpt2, gen_tokens=self.plan.gen_tokens, session_traces=self.plan.session_traces,
                    big_bytes=self.plan.big_bytes)
        saved_threads = torch.get_num_threads()
        torch.set_num_threads(COMPUTE_THREADS)
        try:
            yield spec, built_s
        finally:
            torch.set_num_threads(saved_threads)

    def throughput(self) -> None:
        """The main model's throughput cells (on a CPU run with the tiny model:
        client-bound, informational; see the module's docstring)."""
        from bench.workloads import small_trace

        started = time.perf_counter()
        ref = self.refs.get("small_trace") or self.reference("throughput", small_trace, self.model)
        cells, second = self.throughput_cells(self.stack, self.model, self.model_info, self.spec,
                                              self.plan.throughput, ref, self.local_rate)
        compute = self.throughput_model()
        role, note = "checked", None
        if compute is not None:
            role, note = "informational", (f"informational: the two-workers target is checked on throughput_compute "
                                           f"({compute.name})" + ("; on a CPU these cells are bound by the client and "
                                                                  "the web, not the workers"
                                                                  if self.args.device != "cuda" else ""))
        elif self.args.device != "cuda":
            role, note = "informational", ("informational: on a CPU these cells are bound by the client and the web, "
                                           "not the workers; the two-workers target is not checked on them "
                                           "(the full run measures it on a compute-bound model)")
        self.record_throughput("throughput", cells, second, self.plan.throughput, self.model_info,
                               {"role": role, "model": self.model_info.name, "repo_id": self.model_info.repo_id,
                                "elapsed_s": round(time.perf_counter() - started, 1)},
                               note=note)

    def compute_throughput(self) -> None:
        """Throughput on the compute-bound model, on a stack of its own with
        ``NDIF_TORCH_THREADS=1`` (the main stack is stopped first, so its idle
        services do not share the cores); the local column with one torch
        thread too, so the compute and the values match the workers'."""
        from bench.workloads import small_trace

        info = self.throughput_model()
        threads = COMPUTE_THREADS
        started = time.perf_counter()
        with self.compute_model(info) as (spec, built_s):
            local = self.client(info.repo_id, local=True)
            ref = self.reference("throughput_compute", small_trace, local, spec=spec)
            self.compute_stack = self.new_stack(NDIF_TORCH_THREADS=str(threads))
            self.compute_stack.start()
            first_ms, _, first_meta = self.call(small_trace, self.client(info.repo_id), self.compute_stack.url,
                                                spec=spec)

            def local_rate(fn: Callable, total: int, ref: Any) -> dict:
                return self.local_rate(fn, total, ref, model=local, spec=spec)

            cells, second = self.throughput_cells(self.compute_stack, local, info, spec,
                                                  self.plan.compute_throughput, ref, local_rate)
        self.record_throughput(
            "throughput_compute", cells, second, self.plan.compute_throughput, info,
            {"role": "checked", "model": info.name, "repo_id": info.repo_id, "torch_threads": threads,
             "build_s": round(built_s, 3), "first_request": {"ms": round(first_ms, 3), "meta": first_meta},
             "elapsed_s": round(time.perf_counter() - started, 1)},
            note=(f"{info.name} ({info.repo_id}, random weights), NDIF_TORCH_THREADS={threads} in a stack of its "
                  f"own (the main stack stopped), local column with torch.set_num_threads({threads}); first "
                  f"request (deploys it): {first_ms:.0f} ms"),
        )
        self.compute_stack.discard()
        self.compute_stack = None

    def throughput_cells(self, stack, local_model, info: BenchModel, spec, plan: list, ref: Any,
                         local_rate: Callable) -> tuple[dict, Optional[str]]:
        """Every (clients, requests per client) of ``plan`` in the local, null and
        ours columns with one worker, then ours again after a second worker
        joins and the model is deployed on both."""
        from bench.workloads import small_trace

        self.null.prepare(ref, self.compress, self.max_inline)
        most = max(clients for clients, _ in plan)
        clients_models = [self.client(info.repo_id) for _ in range(most)]
        cells: dict = {}
        local_cells = {}
        for clients, per_client in plan:
            local_cells[clients] = local_rate(small_trace, clients * per_client, ref)
            null_cell = self.rate(small_trace, clients_models[:clients], per_client, self.null.url, ref, spec)
            ours_cell = self.rate(small_trace, clients_models[:clients], per_client, stack.url, ref, spec)
            cells[f"{clients}c_1w"] = {"clients": clients, "workers": 1, "local": local_cells[clients],
                                       "null": null_cell, "ours": ours_cell}
        second = None
        try:
            second = self.add_second_worker(stack, local_model)
        except Exception as error:  # noqa: BLE001 - recorded; one-worker cells still stand
            self.out.setdefault("errors", []).append(f"second worker ({info.name}): {type(error).__name__}: {error}")
            self.emit(f"   second worker could not be added: {error}")
        if second is not None:
            # Warm the new worker (its first requests) with a few concurrent ones, not measured.
            self.rate(small_trace, clients_models[:4], 1, stack.url, None, spec)
            for clients, per_client in plan:
                ours_cell = self.rate(small_trace, clients_models[:clients], per_client, stack.url, ref, spec)
                cells[f"{clients}c_2w"] = {"clients": clients, "workers": 2, "local": local_cells[clients],
                                           "null": cells[f"{clients}c_1w"]["null"], "ours": ours_cell}
        return cells, second

    def local_rate(self, fn: Callable, total: int, ref: Any, model=None, spec=None) -> dict:
        column = Column()
        started = time.perf_counter()
        for _ in range(total):
            self.measure_into(column, fn, model if model is not None else self.model, None, ref, spec=spec)
        wall = time.perf_counter() - started
        cell = column.summary(check=False)
        cell.update(requests=total, wall_s=round(wall, 3), rps=round(len(column.samples) / wall, 3))
        return cell

    def rate(self, fn: Callable, models: list, per_client: int, host: str, ref: Any, spec=None) -> dict:
        """``len(models)`` threads, each sending ``per_client`` requests one after
        another with its own client model; requests/s over the whole wall time."""
        import nnsight

        spec = spec or self.spec
        nnsight.CONFIG.API.HOST = host
        for model in models:  # warm: each client model's first request (wherever it goes: client-side costs)
            if id(model) not in self.warmed:
                with contextlib.suppress(Exception):
                    fn(model, {"remote": True}, spec)
                self.warmed[id(model)] = model
        columns = [Column() for _ in models]
        workers: dict = {}
        lock = threading.Lock()
        barrier = threading.Barrier(len(models) + 1)

        def client(i: int) -> None:
            barrier.wait()
            for _ in range(per_client):
                self.measure_into(columns[i], fn, models[i], host, ref, spec=spec)
                worker = last_meta().get("worker")
                if worker:
                    with lock:
                        workers[worker] = workers.get(worker, 0) + 1

        wall = run_clients(client, len(models), barrier, self.client_nice)
        merged = Column()
        for column in columns:
            merged.absorb(column)
        cell = merged.summary()
        cell.update(requests=len(models) * per_client, wall_s=round(wall, 3),
                    rps=round(len(merged.samples) / wall, 3), served_by=workers)
        return cell

    def add_second_worker(self, stack, model) -> str:
        name = f"bench2@{socket.gethostname()}"
        stack.add_worker(name, gpus=self.args.second_worker_gpus, memory_gib=self.args.second_worker_memory_gib)
        key = model.to_model_key()
        stack.cli("deploy", key, "--replicas", "2", "--timeout", "180", timeout=240, check=True)
        return name

    def record_throughput(self, name: str, cells: dict, second: Optional[str], plan: list, info: BenchModel,
                          extra: dict, note: Optional[str] = None) -> None:
        entry: dict = {"cells": cells, "second_worker": second, "plan": plan}
        entry.update(extra)
        for cell in cells.values():
            cell["ratios"] = {
                "ours/local rps": round(cell["ours"]["rps"] / cell["local"]["rps"], 3) if cell["local"].get("rps") else None,
                "ours/null rps": round(cell["ours"]["rps"] / cell["null"]["rps"], 3) if cell["null"].get("rps") else None,
            }
        self.out["workloads"][name] = entry
        self.save_json()
        self.emit(self.header(name, "requests per client: "
                              + ", ".join(f"{c} clients x {n}" for c, n in plan)
                              + "; local = the same number of requests one after another in-process; client "
                                f"threads at nice {self.client_nice}",
                              model=info.name))
        if note:
            self.emit(f"   {note}")
        rows = []
        for label, cell in cells.items():
            tag = f"{cell['clients']:>2}c {cell['workers']}w"
            rows.append((f"{tag} req/s", [measure.fmt(cell[c].get("rps")) for c in ("local", "null", "ours")]
                         + [measure.fmt(cell["ratios"]["ours/local rps"], "x"), measure.fmt(cell["ratios"]["ours/null rps"], "x")]))
            for q in ("p50", "p95"):
                rows.append((f"{tag} {q} ms", [measure.fmt(cell[c].get(f"{q}_ms")) for c in ("local", "null", "ours")]
                             + [measure.fmt(_ratio(cell["ours"].get(f"{q}_ms"), cell["local"].get(f"{q}_ms")), "x"),
                                measure.fmt(_ratio(cell["ours"].get(f"{q}_ms"), cell["null"].get(f"{q}_ms")), "x")]))
            rows.append((f"{tag} correct", ["ref", measure.fmt(cell["null"]["correct"]), measure.fmt(cell["ours"]["correct"]), "", ""]))
        self.emit(measure.render_table("", ["local", "null", "ours", "ours/local", "ours/null"], rows).lstrip("\n"))
        for label, cell in cells.items():
            for col in ("null", "ours"):
                if cell[col].get("errors"):
                    self.emit(f"   {label} {col} ERRORS: {cell[col]['errors'][0]}")
                if cell[col].get("first_difference"):
                    self.emit(f"   {label} {col} WRONG VALUES: {cell[col]['first_difference']}")
            if cell["workers"] == 2:
                self.emit(f"   {label}: served by {cell['ours'].get('served_by')}")
        self.emit("   ours server p50 run_ms (queue_ms): " + ", ".join(
            f"{label} {cell['ours']['server_p50_ms'].get('run_ms', '-')} ({cell['ours']['server_p50_ms'].get('queue_ms', '-')})"
            for label, cell in cells.items()))


def _ratio(a, b):
    return round(a / b, 3) if a and b else None
