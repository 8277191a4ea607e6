"""The workloads timed in three columns (local, null, ours), and the cold start.

One section because they are measured the same way: the local run's values as
the reference, the null server answering with them, the columns interleaved
request by request. The big result adds what only it needs: the peak RSS of
the web and the worker (``watch_memory``) and the serialization floor it is
held against. torch, transformers and ``bench.workloads`` (which imports
torch) are imported inside the methods: ``bench/run.py`` sets ``HF_HOME`` and
the offline flags before anything imports transformers.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import Callable

from bench import measure
from bench.columns import Column
from bench.plan import MiB


class TimedSections:
    """Mixin of ``bench.core.Bench``: ``time_workload(name)`` and ``cold_start()``."""

    def time_workload(self, name: str) -> None:
        from bench import workloads

        fn = workloads.WORKLOADS[name]
        reps = self.plan.reps[name]
        ref = self.refs[name] = self.reference(name, fn, self.model)
        prepared = self.null.prepare(ref, self.compress, self.max_inline)
        columns = {"local": Column(), "null": Column(), "ours": Column()}
        hosts = {"local": None, "null": self.null.url, "ours": self.stack.url}
        extra: dict = {"null_prepared": prepared, "result_tensor_bytes": measure.result_bytes(ref)}
        for col, host in hosts.items():
            for _ in range(self.plan.warmup):
                with contextlib.suppress(Exception):
                    self.call(fn, self.model, host)
        memory = self.watch_memory() if name == "big_result" else None
        order = list(hosts)
        for rep in range(reps):  # interleaved, rotating, so all columns see the same machine
            for col in order[rep % 3:] + order[: rep % 3]:
                self.measure_into(columns[col], fn, self.model, hosts[col], ref)
        if memory is not None:
            extra["memory"] = memory()
        if name == "big_result":
            extra["floor"] = self.serialization_floor(ref, reps)
            extra["ours_result_bytes"] = columns["ours"].meta.get("result_bytes")
            extra["size_ok"] = extra["result_tensor_bytes"] >= self.plan.big_bytes
            extra["ours_inline"] = columns["ours"].meta.get("inline")
        notes = []
        if name == "big_result":
            wire = extra.get("ours_result_bytes") or 0
            notes.append(f"result tensors {extra['result_tensor_bytes'] / MiB:.1f} MiB; on the wire (ours, "
                         f"{'zstd' if self.compress else 'raw'}) {wire / MiB:.1f} MiB; floor p50 "
                         f"{extra['floor']['total'].get('p50_ms', 0):.0f} ms; peak RSS increase: web "
                         f"{extra['memory'].get('web', {}).get('peak_increase_bytes', 0) / MiB:.0f} MiB, worker "
                         f"{extra['memory'].get('worker', {}).get('peak_increase_bytes', 0) / MiB:.0f} MiB")
        self.record(name, columns, f"{reps} reps + {self.plan.warmup} warm-up per column", extra, notes=notes)

    # -- big result: memory and the serialization floor --

    def watch_memory(self) -> Callable[[], dict]:
        """Reset the peak RSS of the web's and the worker's processes now; the
        returned function reads the peaks (and the increase over now)."""
        pids = self.stack.pids()
        groups = {service: measure.process_tree(pids[service]) for service in ("web", "worker") if service in pids}
        before = {s: {p: measure.proc_status_kib(p, "VmRSS") for p in ps} for s, ps in groups.items()}
        reset = measure.reset_peak_rss(p for ps in groups.values() for p in ps)

        def read() -> dict:
            out = {"peak_reset": reset}
            for service, procs in groups.items():
                peaks = {p: measure.proc_status_kib(p, "VmHWM") for p in procs}
                grow = {p: peaks[p] - before[service].get(p, 0) for p in procs}
                top = max(procs, key=lambda p: grow[p])
                out[service] = {
                    "processes": len(procs),
                    "peak_rss_bytes": max(peaks.values()) * 1024,
                    "peak_increase_bytes": grow[top] * 1024,
                    "rss_before_bytes": before[service].get(top, 0) * 1024,
                    "per_process": {str(p): {"before_kib": before[service].get(p, 0), "peak_kib": peaks[p]} for p in procs},
                }
            return out

        return read

    def serialization_floor(self, ref: dict, reps: int) -> dict:
        """torch.save + zstd + write + read + unzstd + torch.load of the same
        result, in one process (the tensor made the same way first)."""
        import io

        import torch
        import zstandard

        from bench.workloads import make_big

        steps: dict = {k: [] for k in ("make", "save", "compress", "write", "read", "decompress", "load", "total")}
        sizes = {}
        with tempfile.TemporaryDirectory(prefix="ndif-bench-floor-") as tmp:
            path = Path(tmp) / "result.pt.zst"
            for _ in range(reps):
                marks = [time.perf_counter()]
                big = make_big(self.plan.big_bytes // 4)
                marks.append(time.perf_counter())
                buffer = io.BytesIO()
                torch.save({"big": big, "hidden": ref["hidden"]}, buffer, pickle_protocol=4)
                marks.append(time.perf_counter())
                data = zstandard.ZstdCompressor(level=3).compress(buffer.getbuffer()) if self.compress else buffer.getvalue()
                marks.append(time.perf_counter())
                with open(path, "wb") as f:
                    f.write(data)
                marks.append(time.perf_counter())
                back = path.read_bytes()
                marks.append(time.perf_counter())
                raw = zstandard.ZstdDecompressor().decompress(back) if self.compress else back
                marks.append(time.perf_counter())
                loaded = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)
                marks.append(time.perf_counter())
                for key, start, end in zip(list(steps)[:-1], marks, marks[1:]):
                    steps[key].append((end - start) * 1000)
                steps["total"].append((marks[-1] - marks[0]) * 1000)
                sizes = {"raw_bytes": buffer.getbuffer().nbytes, "stored_bytes": len(data)}
                assert torch.equal(loaded["big"], ref["big"]), "floor round trip changed the tensor"
                del big, buffer, data, back, raw, loaded
        out = {k: measure.stats(v) for k, v in steps.items()}
        out.update(sizes)
        return out

    # -- cold start --

    def cold_start(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from bench.workloads import small_trace

        repo = self.model_info.cold_repo_id
        reps = self.plan.cold_reps
        cold = self.client(repo)
        cold_local = self.client(repo, local=True)
        ref = self.reference("cold_start", small_trace, cold_local)
        key = cold.to_model_key()
        columns = {"local": Column(), "null": Column(), "ours": Column()}
        load_kwargs: dict = {"dtype": getattr(torch, self.model_info.dtype)}
        if self.args.device == "cuda":
            load_kwargs["device_map"] = "cuda"
        AutoModelForCausalLM.from_pretrained(repo, **load_kwargs)  # warm: imports, page cache
        for _ in range(reps):
            started = time.perf_counter()
            loaded = AutoModelForCausalLM.from_pretrained(repo, **load_kwargs)
            if self.args.device == "cuda":
                torch.cuda.synchronize()
            columns["local"].samples.append((time.perf_counter() - started) * 1000)
            del loaded
        self.null.prepare(ref, self.compress, self.max_inline)
        self.call(small_trace, cold, self.null.url)
        for _ in range(reps):
            self.measure_into(columns["null"], small_trace, cold, self.null.url, ref)
        evictions = []
        for _ in range(reps):
            evicted = self.stack.cli("evict", key, "--timeout", "120")
            evictions.append((evicted.stdout + evicted.stderr).strip()[-200:])
            self.measure_into(columns["ours"], small_trace, cold, self.stack.url, ref)
        self.record("cold_start", columns, f"{reps} reps (evicted before each)",
                    {"model_key": key, "evictions": evictions},
                    notes=["local = bare AutoModelForCausalLM.from_pretrained; null = a small trace; "
                           "ours = a small trace on the evicted model (queue_ms includes the load)"])
