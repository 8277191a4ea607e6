"""Co-batching: requests/s and p50/p95 from N client threads
against one worker, with co-batching off (a stack with ``NDIF_COBATCH_MAX=1``)
and on (the default), side by side in one run, every value compared with the
local solo run.

Two tables, like ``throughput``: the main model's (``cobatch``; on a CPU with
the tiny model, bound by the client and the web, so its 16-client cells say
little about the worker) and, in the full CPU run, ``cobatch_compute`` on the
compute-bound model (``throughput_compute``'s gpt2-medium-shaped random model,
``NDIF_TORCH_THREADS=1``), on two stacks of their own. The 16-client and the
off-vs-local targets are checked on the compute-bound cells (on a GPU on the
main model's); the 1-client cost on the main model's cells, where the fixed
cost of co-batching is not hidden under ~250 ms of compute.

Each cell alternates local / off / on ``plan.cobatch_rounds`` times (its
requests split between the rounds), so all three columns see the same machine. The clients
are real nnsight clients, one thread and one client model each, all started
at once behind a barrier: with one worker the requests really queue behind it
and the on stack can gather them. Every value is compared with the local
reference: ``torch.equal`` (counted as exact), else within
``COBATCH_TOLERANCE`` (counted apart; every prompt here has one token length,
so no padding is involved and any such value is reported, not hidden).
torch, nnsight and ``bench.workloads`` are imported inside the methods.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Optional

from bench import measure
from bench.columns import Column, run_clients
from bench.plan import COBATCH_TOLERANCE, COMPUTE_THREADS


class CobatchSection:
    """Mixin of ``bench.core.Bench``: ``cobatch()``, ``compute_cobatch()`` and their cells."""

    def start_cobatch_off(self) -> None:
        """Start the main model's off stack (``NDIF_COBATCH_MAX=1``) in a thread, alongside the
        main stack's start (the run's first seconds, before anything is measured), so the section
        does not wait ~10 s for it; it idles until ``cobatch()`` and is stopped right after."""
        self.cobatch_stack = self.new_stack(NDIF_COBATCH_MAX="1")
        self._cobatch_start_error: Optional[BaseException] = None

        def start() -> None:
            try:
                self.cobatch_stack.start()
            except BaseException as error:  # noqa: BLE001 - raised again by cobatch()
                self._cobatch_start_error = error

        self._cobatch_starter = threading.Thread(target=start, name="cobatch-off-stack", daemon=True)
        self._cobatch_starter.start()

    def cobatch(self) -> None:
        """The main model's cells: the main stack (co-batching on, the default) against the off
        stack started by ``start_cobatch_off``, stopped after this section."""
        from bench.workloads import small_trace

        started = time.perf_counter()
        if getattr(self, "cobatch_stack", None) is None:
            self.start_cobatch_off()
        self._cobatch_starter.join()
        off = self.cobatch_stack
        try:
            if self._cobatch_start_error is not None:
                raise RuntimeError(f"the co-batching-off stack did not start: {self._cobatch_start_error}")
            ref = self.refs.get("small_trace") or self.reference("cobatch", small_trace, self.model)
            cells = self.cobatch_cells(off, self.stack, self.model_info, self.spec, self.plan.cobatch, ref,
                                       self.model)
        finally:
            with contextlib.suppress(Exception):
                off.discard()
            self.cobatch_stack = None
        role = "checked" if self.args.device == "cuda" else "informational"
        self.record_cobatch("cobatch", cells, self.plan.cobatch, self.model_info,
                            {"role": role, "model": self.model_info.name, "repo_id": self.model_info.repo_id,
                             "elapsed_s": round(time.perf_counter() - started, 1)},
                            note=("informational on a CPU: the tiny model's cells are bound by the client and the "
                                  "web; the 16-client targets are checked on cobatch_compute (full run), the "
                                  "1-client cost on these cells"
                                  if self.args.device != "cuda" else None))

    def compute_cobatch(self) -> None:
        """The compute-bound model's cells, on two stacks of their own (off and on), both with
        ``NDIF_TORCH_THREADS=1``; every other stack is stopped first (free the cores), the local
        column on one torch thread."""
        from bench.workloads import small_trace

        info = self.throughput_model()
        threads = COMPUTE_THREADS
        started = time.perf_counter()
        off = on = None
        with self.compute_model(info) as (spec, _):
            try:
                local = self.client(info.repo_id, local=True)
                ref = self.reference("cobatch_compute", small_trace, local, spec=spec)
                off = self.new_stack(NDIF_TORCH_THREADS=str(threads), NDIF_COBATCH_MAX="1")
                on = self.new_stack(NDIF_TORCH_THREADS=str(threads))
                self.at_once(lambda stack: stack.start(), (off, on))
                cells = self.cobatch_cells(off, on, info, spec, self.plan.compute_cobatch, ref, local)
            finally:
                for stack in (off, on):
                    if stack is not None:
                        with contextlib.suppress(Exception):
                            stack.discard()
        self.record_cobatch(
            "cobatch_compute", cells, self.plan.compute_cobatch, info,
            {"role": "checked", "model": info.name, "repo_id": info.repo_id, "torch_threads": threads,
             "elapsed_s": round(time.perf_counter() - started, 1)},
            note=(f"{info.name} ({info.repo_id}, random weights), NDIF_TORCH_THREADS={threads} on two stacks of "
                  f"their own (off: NDIF_COBATCH_MAX=1; on: the default), every other stack stopped; local "
                  f"column with torch.set_num_threads({threads})"),
        )

    def cobatch_cells(self, off, on, info, spec, plan, ref: Any, local_model) -> dict:
        """Every (clients, requests per client) of ``plan``: local back-to-back (``local_model``,
        in this process), off and on, the three alternating ``plan.cobatch_rounds`` times (each
        round a share of the cell's requests; a one-client cell alternates every request), so
        every column sees the same machine (others' load on a shared one comes and goes within
        seconds); each stack warmed (deployed, a few concurrent requests) before anything is
        measured."""
        from bench.workloads import small_trace

        rounds = max(1, self.plan.cobatch_rounds)
        most = max(clients for clients, _ in plan)
        clients_models = [self.client(info.repo_id) for _ in range(most)]
        for stack in (off, on):  # deploy the model on each stack (not measured)
            self.call(small_trace, clients_models[0], stack.url, spec=spec)
        cold = [model for model in clients_models if id(model) not in self.warmed]
        if cold:  # each client model's first (slower, client-side) request, not measured
            self.cobatch_round(small_trace, cold, 1, on.url, None, spec)
            self.warmed.update({id(model): model for model in cold})
        for stack in (off, on):  # and each worker's first concurrent requests
            self.cobatch_round(small_trace, clients_models[:min(4, most)], 1, stack.url, None, spec)
        cells: dict = {}
        for clients, per_client in plan:
            parts: dict = {"local": [], "off": [], "on": []}
            # One client: local / off / on every request. Its target is a difference of
            # a couple of ms, and this machine's speed drifts by more within a block of ten.
            cell_rounds = per_client if clients == 1 else rounds
            split = [per_client // cell_rounds + (1 if i < per_client % cell_rounds else 0) for i in range(cell_rounds)]
            for n in split:
                if n == 0:
                    continue
                parts["local"].append(self.local_round(small_trace, local_model, clients * n, ref, spec))
                for name, stack in (("off", off), ("on", on)):
                    parts[name].append(self.cobatch_round(small_trace, clients_models[:clients], n, stack.url,
                                                          ref, spec))
            cells[f"{clients}c"] = {"clients": clients, "local": _merge(parts["local"]),
                                    "off": _merge(parts["off"]), "on": _merge(parts["on"])}
        return cells

    def local_round(self, fn: Callable, model, total: int, ref: Any, spec) -> dict:
        """``total`` requests one after another in this process: a round of the local column."""
        column = Column()
        started = time.perf_counter()
        for _ in range(total):
            self.measure_into(column, fn, model, None, ref, spec=spec)
        values = {"exact": 0, "within_tolerance": 0, "max_abs_diff": 0.0, "shared": []}
        return {"column": column, "wall_s": time.perf_counter() - started, "requests": total, "values": values}

    def cobatch_round(self, fn: Callable, models: list, per_client: int, host: str, ref: Any, spec) -> dict:
        """``len(models)`` threads, each ``per_client`` requests one after another with its own
        client model, all released at once; the raw samples, the wall time, the values' verdicts
        and the ``meta["cobatch"]`` (rows' requests sharing each forward) of every answer."""
        import nnsight

        nnsight.CONFIG.API.HOST = host
        columns = [Column() for _ in models]
        found = [{"exact": 0, "within_tolerance": 0, "max_abs_diff": 0.0, "shared": []} for _ in models]
        barrier = threading.Barrier(len(models) + 1)

        def client(i: int) -> None:
            barrier.wait()
            for _ in range(per_client):
                try:
                    ms, saves, meta = self.call(fn, models[i], host, spec=spec)
                except Exception as error:  # noqa: BLE001 - recorded, the run goes on
                    columns[i].errors.append(f"{type(error).__name__}: {str(error)[:500]}")
                    continue
                columns[i].samples.append(ms)
                columns[i].record_meta(meta)
                found[i]["shared"].append(int(meta.get("cobatch") or 1))
                if ref is None:
                    continue
                columns[i].checked += 1
                difference = measure.difference(saves, ref)
                if difference is None:
                    found[i]["exact"] += 1
                    continue
                diff = _max_abs_diff(saves, ref)
                if diff is not None and diff <= COBATCH_TOLERANCE:
                    found[i]["within_tolerance"] += 1
                    found[i]["max_abs_diff"] = max(found[i]["max_abs_diff"], diff)
                else:
                    columns[i].wrong += 1
                    columns[i].first_wrong = columns[i].first_wrong or (
                        f"{difference} (max abs diff {diff})" if diff is not None else difference)

        wall = run_clients(client, len(models), barrier, self.client_nice)
        merged = Column()
        values = {"exact": 0, "within_tolerance": 0, "max_abs_diff": 0.0, "shared": []}
        for column, own in zip(columns, found):
            merged.absorb(column)
            values["exact"] += own["exact"]
            values["within_tolerance"] += own["within_tolerance"]
            values["max_abs_diff"] = max(values["max_abs_diff"], own["max_abs_diff"])
            values["shared"] += own["shared"]
        return {"column": merged, "wall_s": wall, "requests": len(models) * per_client, "values": values}

    def record_cobatch(self, name: str, cells: dict, plan, info, extra: dict, note: Optional[str] = None) -> None:
        for cell in cells.values():
            off, on, local = cell["off"], cell["on"], cell["local"]
            cell["ratios"] = {
                "on/off rps": _ratio(on.get("rps"), off.get("rps")),
                "off/local rps": _ratio(off.get("rps"), local.get("rps")),
                "on/local rps": _ratio(on.get("rps"), local.get("rps")),
                "on-off p50 ms": (round(on["p50_ms"] - off["p50_ms"], 3)
                                  if on.get("p50_ms") is not None and off.get("p50_ms") is not None else None),
            }
        entry: dict = {"cells": cells, "plan": [list(p) for p in plan], "rounds": self.plan.cobatch_rounds,
                       "tolerance": COBATCH_TOLERANCE}
        entry.update(extra)
        self.out["workloads"][name] = entry
        self.save_json()
        self.emit(self.header(name, "requests per client: " + ", ".join(f"{c} clients x {n}" for c, n in plan)
                              + f", local / off / on alternating {self.plan.cobatch_rounds}x; local = the same number "
                                "of requests one after another in-process; client threads at nice "
                              f"{self.client_nice}", model=info.name))
        if note:
            self.emit(f"   {note}")
        # Rows shaped like the throughput table's, over other columns and ratios:
        # kept apart so each table's code reads as what it prints.
        rows = []
        for cell in cells.values():
            tag = f"{cell['clients']:>2}c"
            rows.append((f"{tag} req/s", [measure.fmt(cell[c].get("rps")) for c in ("local", "off", "on")]
                         + [measure.fmt(cell["ratios"]["on/off rps"], "x"), measure.fmt(cell["ratios"]["off/local rps"], "x")]))
            for q in ("p50", "p95"):
                rows.append((f"{tag} {q} ms", [measure.fmt(cell[c].get(f"{q}_ms")) for c in ("local", "off", "on")]
                             + [measure.fmt(_ratio(cell["on"].get(f"{q}_ms"), cell["off"].get(f"{q}_ms")), "x"),
                                measure.fmt(_ratio(cell["off"].get(f"{q}_ms"), cell["local"].get(f"{q}_ms")), "x")]))
            rows.append((f"{tag} shared fwd", ["", measure.fmt(cell["off"]["shared_mean"]),
                                               measure.fmt(cell["on"]["shared_mean"]), "", ""]))
            rows.append((f"{tag} correct", ["ref", _verdict(cell["off"]), _verdict(cell["on"]), "", ""]))
        self.emit(measure.render_table("", ["local", "off", "on", "on/off", "off/local"], rows).lstrip("\n"))
        self.emit("   shared fwd: mean requests per forward (meta cobatch); correct: exact (torch.equal) "
                  f"+ within {COBATCH_TOLERANCE:g} / checked")
        for label, cell in cells.items():
            for col in ("off", "on"):
                if cell[col].get("errors"):
                    self.emit(f"   {label} {col} ERRORS: {cell[col]['errors'][0]}")
                if cell[col].get("first_difference"):
                    self.emit(f"   {label} {col} WRONG VALUES: {cell[col]['first_difference']}")
        self.emit("   server p50 run_ms (queue_ms) off | on: " + ", ".join(
            f"{label} {cell['off']['server_p50_ms'].get('run_ms', '-')} ({cell['off']['server_p50_ms'].get('queue_ms', '-')})"
            f" | {cell['on']['server_p50_ms'].get('run_ms', '-')} ({cell['on']['server_p50_ms'].get('queue_ms', '-')})"
            for label, cell in cells.items()))


def _merge(parts: list) -> dict:
    """One column's cell from its rounds: the samples together, req/s over the rounds' wall time."""
    merged = Column()
    values = {"exact": 0, "within_tolerance": 0, "max_abs_diff": 0.0, "shared": []}
    wall = requests = 0.0
    for part in parts:
        merged.absorb(part["column"])
        wall += part["wall_s"]
        requests += part["requests"]
        for key in ("exact", "within_tolerance"):
            values[key] += part["values"][key]
        values["max_abs_diff"] = max(values["max_abs_diff"], part["values"]["max_abs_diff"])
        values["shared"] += part["values"]["shared"]
    cell = merged.summary()
    shared = values.pop("shared")
    cell.update(requests=int(requests), wall_s=round(wall, 3), rps=round(len(merged.samples) / wall, 3) if wall else None,
                exact=values["exact"], within_tolerance=values["within_tolerance"],
                max_abs_diff=values["max_abs_diff"],
                shared_mean=round(sum(shared) / len(shared), 2) if shared else None,
                shared_max=max(shared) if shared else None)
    return cell


def _verdict(cell: dict) -> str:
    if cell.get("correct") is None:
        return "-"
    text = f"{cell['exact']}+{cell['within_tolerance']}/{cell['checked']}"
    return text if cell["correct"] else f"WRONG {text}"


def _max_abs_diff(a: Any, b: Any) -> Optional[float]:
    """The largest absolute difference between two results of the same structure, dtypes and
    shapes (None when they differ in any of these, or hold unequal non-tensors)."""
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return None
        if not a.is_floating_point():
            return 0.0 if torch.equal(a.cpu(), b.cpu()) else None
        return float((a.detach().cpu().double() - b.detach().cpu().double()).abs().max()) if a.numel() else 0.0
    if type(a) is not type(b):
        return None
    if isinstance(a, dict):
        if set(a) != set(b):
            return None
        parts = [_max_abs_diff(a[k], b[k]) for k in a]
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return None
        parts = [_max_abs_diff(x, y) for x, y in zip(a, b)]
    else:
        return 0.0 if a == b else None
    if any(p is None for p in parts):
        return None
    return max(parts, default=0.0)


def _ratio(a, b):
    return round(a / b, 3) if a and b else None
