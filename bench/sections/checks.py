"""The issue's targets, read from the run's JSON: one PASS/FAIL/SKIP each,
and the one line saying whether every remote column got the local values.

Apart from the sections that measure because a target reads several tables
(the small trace against the null and local columns, the big result against
its floor and memory, throughput on whichever cells measure the workers) and
is tested on made-up JSON (tests/e2e/bench/test_bench_smoke.py) without running any.
"""

from __future__ import annotations

from typing import Callable, Optional

from bench.plan import MiB


class TargetChecks:
    """Mixin of ``bench.core.Bench``: ``checks()`` and ``values_line()``."""

    def checks(self) -> list[dict]:
        w = self.out["workloads"]
        checks = []

        def add(name: str, ok: Optional[bool], detail: str) -> None:
            checks.append({"name": name, "pass": ok, "verdict": "SKIP" if ok is None else ("PASS" if ok else "FAIL"),
                           "detail": detail})

        small = w.get("small_trace", {}).get("columns", {})
        name = f"small trace p50 ({self.model_info.name}): ours <= null + local + 3 ms"
        try:
            o, n, loc = small["ours"]["p50_ms"], small["null"]["p50_ms"], small["local"]["p50_ms"]
            add(name, o <= n + loc + 3, f"ours {o:.1f} ms vs null {n:.1f} + local {loc:.1f} + 3 = {n + loc + 3:.1f} ms")
        except (KeyError, TypeError):
            add(name, None, "not measured")

        big = w.get("big_result", {})
        try:
            o, floor = big["columns"]["ours"]["p50_ms"], big["floor"]["total"]["p50_ms"]
            add(f"{self.plan.big_bytes // MiB} MiB result p50: ours <= 2 x serialization floor", o <= 2 * floor,
                f"ours {o:.0f} ms vs 2 x {floor:.0f} = {2 * floor:.0f} ms (floor: make+save+zstd+write+read+unzstd+load)")
        except (KeyError, TypeError):
            add("big result p50: ours <= 2 x serialization floor", None, "not measured")
        try:
            memory, limit = big["memory"], 2.5 * self.plan.big_bytes
            parts, ok = [], True
            for service in ("web", "worker"):
                grow = memory[service]["peak_increase_bytes"]
                ok = ok and grow < limit
                parts.append(f"{service} +{grow / MiB:.0f} MiB (peak {memory[service]['peak_rss_bytes'] / MiB:.0f} MiB)")
            add(f"{self.plan.big_bytes // MiB} MiB result: peak RSS increase of web and worker < 2.5 x result",
                ok if memory.get("peak_reset") else None,
                ", ".join(parts) + f" vs {limit / MiB:.0f} MiB" + ("" if memory.get("peak_reset") else " (peak reset failed)"))
        except (KeyError, TypeError):
            add("big result: peak RSS of web and worker < 2.5 x result", None, "not measured")

        cold = w.get("cold_start", {}).get("columns", {})
        try:
            o, bare = cold["ours"]["p50_ms"], cold["local"]["p50_ms"]
            add("cold start p50: ours <= 1.3 x bare from_pretrained + 1 s", o <= 1.3 * bare + 1000,
                f"ours {o:.0f} ms vs 1.3 x {bare:.0f} + 1000 = {1.3 * bare + 1000:.0f} ms")
        except (KeyError, TypeError):
            add("cold start p50: ours <= 1.3 x bare from_pretrained + 1 s", None, "not measured")

        self.throughput_check(w, add)
        self.cobatch_checks(w, add)

        iso = w.get("isolation", {})
        added = iso.get("isolated_added_p50_ms")
        add("isolated adds <= 25 ms p50 over in-process", None if added is None else added <= 25,
            "not measured" if added is None else f"{added:+.1f} ms")
        zygote = iso.get("zygote_added_p50_ms")
        add("isolated through the zygote adds <= 25 ms p50 over in-process", None if zygote is None else zygote <= 25,
            "not measured" if zygote is None else f"{zygote:+.1f} ms")
        for check in w.get("capacity", {}).get("checks", []):  # the waiting-clients targets, from bench/capacity.py
            add(f"capacity: {check['name']}", check["pass"], check["detail"])
        cpu = w.get("cpu_per_request", {}).get("cpu_ms")
        name = "cpu per request: the farm's (web + worker + redis) <= 0.5 x the base's"
        if cpu:
            new, base = cpu["new"]["farm"], cpu["base"]["farm"]
            add(name, new <= 0.5 * base, f"{new:.2f} CPU-ms vs 0.5 x {base:.2f} = {0.5 * base:.2f} "
                f"(base {w['cpu_per_request']['base']}; web {cpu['new']['web']:.2f} vs {cpu['base']['web']:.2f}, "
                f"worker {cpu['new']['worker']:.2f} vs {cpu['base']['worker']:.2f}, "
                f"redis {cpu['new']['redis']:.2f} vs {cpu['base']['redis']:.2f})")
        else:
            add(name, None, "not measured")
        fair = w.get("fairness", {}).get("orders", {})
        name = "fairness: light keys' p95 wait <= 2 x one job's run time (fair turns)"
        try:
            wait, run, fifo = fair["fair"]["light_wait_p95_ms"], fair["fair"]["run_p50_ms"], fair["fifo"]
            add(name, wait <= 2 * run, f"{wait:.0f} ms vs 2 x {run:.0f} = {2 * run:.0f} ms; first in first out: "
                f"{fifo['light_wait_p95_ms']:.0f} ms; Jain {fair['fair']['jain']:.2f} vs {fifo['jain']:.2f}")
        except (KeyError, TypeError):
            add(name, None, "not measured")
        return checks

    def throughput_check(self, w: dict, add: Callable) -> None:
        """Two workers >= 1.6 x one worker, on the cells that measure the workers:
        the compute-bound model's where they ran, else the main model's on a
        GPU. On a CPU without compute-bound cells: SKIP (the tiny model's cells
        are bound by the client, whatever the workers do)."""
        entry, plan = w.get("throughput_compute"), self.plan.compute_throughput
        if entry is None and w.get("throughput", {}).get("role") == "checked":
            entry, plan = w["throughput"], self.plan.throughput
        most = max((c for c, _ in plan), default=16)
        if entry is None:
            most = max((c for c, _ in self.plan.throughput), default=16)
            name = f"throughput, {most} clients: two workers >= 1.6 x one worker"
            main = w.get("throughput", {}).get("cells", {})
            if main.get(f"{most}c_1w") and main.get(f"{most}c_2w"):
                one, two = main[f"{most}c_1w"]["ours"]["rps"], main[f"{most}c_2w"]["ours"]["rps"]
                add(name, None, f"not checked: no compute-bound cells in this run (the full CPU run has them); "
                                f"the {self.model_info.name} model's client-bound cells, informational: "
                                f"{two:.1f} req/s with two workers vs {one:.1f} with one")
            else:
                add(name, None, "not measured")
            return
        setting = (f"{entry['model']}, NDIF_TORCH_THREADS={entry['torch_threads']}" if "torch_threads" in entry
                   else f"{entry['model']}, {self.args.device}")
        name = f"throughput, {most} clients ({setting}): two workers >= 1.6 x one worker"
        cells = entry.get("cells", {})
        try:
            one, two = cells[f"{most}c_1w"]["ours"], cells[f"{most}c_2w"]["ours"]
            correct = one["correct"] and two["correct"]
            add(name, two["rps"] >= 1.6 * one["rps"] and correct,
                f"{two['rps']:.2f} req/s vs 1.6 x {one['rps']:.2f} = {1.6 * one['rps']:.2f} req/s "
                f"(ratio {two['rps'] / one['rps']:.2f}; {entry['repo_id']}; values "
                f"{'all equal to the local run' if correct else 'WRONG or missing'})")
        except (KeyError, TypeError, ZeroDivisionError):
            add(name, None, "not measured")

    def cobatch_checks(self, w: dict, add: Callable) -> None:
        """The three co-batching targets: the most clients, one worker, co-batching on >= 2.0 x off, and off
        >= 0.9 x the local back-to-back rate, on the cells that measure the worker (the
        compute-bound model's, else the main model's on a GPU; SKIP on a CPU without them); one
        client, on costs <= +2 ms p50 over off, on the main model's cells (the fixed cost, not
        hidden under the compute-bound model's ~250 ms). Each also needs every value right."""
        entry, plan = w.get("cobatch_compute"), self.plan.compute_cobatch
        if entry is None and w.get("cobatch", {}).get("role") == "checked":
            entry, plan = w["cobatch"], self.plan.cobatch
        most = max((c for c, _ in plan), default=16)
        targets = (("on", "off", 2.0, "co-batching on >= 2.0 x off"),
                   ("off", "local", 0.9, "co-batching off >= 0.9 x local back-to-back"))
        if entry is None:
            main = w.get("cobatch", {}).get("cells", {})
            most = max((c for c, _ in self.plan.cobatch), default=16)
            for a, b, factor, what in targets:
                name = f"cobatch, {most} clients, one worker: {what}"
                cell = main.get(f"{most}c")
                if cell:
                    add(name, None, f"not checked: no compute-bound cells in this run (the full CPU run has them); "
                                    f"the {self.model_info.name} model's client-bound cells, informational: "
                                    f"{a} {cell[a]['rps']:.1f} req/s vs {b} {cell[b]['rps']:.1f}")
                else:
                    add(name, None, "not measured")
        else:
            setting = (f"{entry['model']}, NDIF_TORCH_THREADS={entry['torch_threads']}" if "torch_threads" in entry
                       else f"{entry['model']}, {self.args.device}")
            for a, b, factor, what in targets:
                name = f"cobatch, {most} clients, one worker ({setting}): {what}"
                try:
                    cell = entry["cells"][f"{most}c"]
                    x, y = cell[a]["rps"], cell[b]["rps"]
                    correct = all(cell[c]["correct"] for c in (a, b) if c != "local")
                    add(name, x >= factor * y and correct,
                        f"{x:.2f} req/s vs {factor} x {y:.2f} = {factor * y:.2f} req/s (ratio {x / y:.2f}; values "
                        f"{'all equal to the local run (exact or within tolerance)' if correct else 'WRONG or missing'})")
                except (KeyError, TypeError, ZeroDivisionError):
                    add(name, None, "not measured")
        name = f"cobatch, 1 client ({self.model_info.name}): co-batching on costs <= +2 ms p50 over off"
        try:
            cell = w["cobatch"]["cells"]["1c"]
            on, off = cell["on"]["p50_ms"], cell["off"]["p50_ms"]
            correct = cell["on"]["correct"] and cell["off"]["correct"]
            server = {side: cell[side].get("server_p50_ms", {}) for side in ("on", "off")}
            inside = ""
            if all("run_ms" in server[side] and "queue_ms" in server[side] for side in server):
                own = {side: server[side]["queue_ms"] + server[side]["run_ms"] for side in server}
                inside = f"; the server's own p50 queue + run: on {own['on']:.1f} ms vs off {own['off']:.1f} ms"
            add(name, on - off <= 2.0 and correct,
                f"on {on:.1f} ms vs off {off:.1f} ms: {on - off:+.1f} ms (values "
                f"{'all equal to the local run' if correct else 'WRONG or missing'}){inside}")
        except (KeyError, TypeError):
            add(name, None, "not measured")

    def values_line(self) -> str:
        """One line: did every remote column get exactly the local values?"""
        groups = []
        for name, entry in self.out["workloads"].items():
            if "columns" in entry:
                groups.append((name, entry["columns"]))
            for label, cell in entry.get("cells", {}).items():
                groups.append((f"{name}/{label}", {c: cell[c] for c in ("null", "ours", "off", "on") if c in cell}))
        bad, checked = [], 0
        for label, columns in groups:
            for col, summary in columns.items():
                if summary.get("correct") is None:
                    continue
                checked += 1
                if not summary["correct"]:
                    bad.append(f"{label}/{col}")
        if bad:
            return f"WRONG or missing values in {', '.join(bad)} ({checked} columns checked)"
        near = sum(1 for _, columns in groups for summary in columns.values() if summary.get("within_tolerance"))
        if near:
            return (f"every remote column returned exactly the local values, co-batched ones within the engine's "
                    f"tolerance in {near} columns ({checked} columns checked)")
        return f"every remote column returned exactly the local values ({checked} columns checked)"

