"""The bench: every workload against three servers, measured in one run.

    .venv/bin/python bench/run.py            # full (under 10 minutes on 2 cores)
    .venv/bin/python bench/run.py --smoke    # about a minute: few repetitions, a 16 MiB "big" result
    .venv/bin/python bench/run.py --only small_trace,isolation --out /tmp/b.json
    .venv/bin/python bench/run.py --model llama-1b --dry-run   # CPU-side checks only

Columns, for the same block run by the unmodified nnsight 0.8.1 client:

- **local**: in this process with nnsight, no server (the compute floor);
- **null**: ``bench/null_server.py``, the wire protocol answering at once with
  the result prepared in advance (the protocol floor);
- **ours**: the full stack started through the real CLI (``tests.stack.Stack``:
  embedded Redis, gunicorn web, a Celery worker, Flower, filesystem store).

Workloads: ``small_trace``, ``every_layer``, ``generate`` (20 tokens, per-step
saves), ``session`` (5 traces), ``big_result`` (256 MiB, against the bare
serialization floor, with the peak RSS of the web and the worker),
``cold_start`` (first request on an undeployed model against its bare
``from_pretrained``), ``throughput`` (1, 4 and 16 client threads, one and two
workers; see below) and ``isolation`` (the isolated path, NDIF_DEFAULT_TRUSTED=0, against
the in-process path). Each table is printed with p50/p95, ours/local and
ours/null and the git commit; the issue's targets are printed as PASS/FAIL
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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench import measure  # noqa: E402  (no torch at import)
from bench.models import MODELS, BenchModel  # noqa: E402

MiB = 1024 * 1024
COMPUTE_THREADS = 1  # NDIF_TORCH_THREADS of the compute-bound throughput stack: one "device" per worker
OUT_DIR = ROOT / "bench" / "_out"
TIME_WORKLOADS = ("small_trace", "every_layer", "generate", "session", "big_result")
ALL = TIME_WORKLOADS + ("cold_start", "isolation", "throughput", "capacity")
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
    "isolation": "isolation: small trace in a jailed child (NDIF_DEFAULT_TRUSTED=0) vs in the worker",
}


@dataclass
class Plan:
    reps: dict
    warmup: int
    big_bytes: int
    cold_reps: int
    isolation_reps: int
    throughput: list  # (clients, requests per client)
    compute_throughput: list  # the same, on the compute-bound model (~250 ms per request)
    gen_tokens: int = 20
    session_traces: int = 5


ISOLATION_GAP_S = 0.25  # between the isolation table's requests (see Bench.isolation)

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
)


# -- the remote client's meta, per thread ----------------------------------------

_last = threading.local()


def _hook_meta() -> None:
    """Keep each remote call's ``meta`` (queue_ms, run_ms, worker, ...) per thread."""
    from nnsight.intervention.backends.remote import RemoteBackend

    if getattr(RemoteBackend, "_bench_meta_hook", False):
        return
    original = RemoteBackend.__call__

    def call(self, tracer=None):
        try:
            return original(self, tracer)
        finally:
            _last.meta = self.meta

    RemoteBackend.__call__ = call
    RemoteBackend._bench_meta_hook = True


def last_meta() -> dict:
    return getattr(_last, "meta", None) or {}


# -- the null server ---------------------------------------------------------------


class NullServer:
    def __init__(self) -> None:
        from tests.servers import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "NullServer":
        import httpx

        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "null_server.py"), "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.url + "/ping", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"null server did not start: {self.proc.stderr.read().decode() if self.proc.stderr else ''}")
            time.sleep(0.05)

    def prepare(self, saved: dict, compress: bool, max_inline: int) -> dict:
        """Encode ``saved`` exactly as our worker does and make it every job's answer."""
        import httpx

        from workers import results

        data = results.encode(saved, compress)
        if len(data) <= max_inline:
            mode, body = "inline", results.completed_frame("0" * 32, "Your job has been completed.", data, {})
        else:
            mode, body = "url", bytes(data)
        answer = httpx.put(self.url + "/_null/result", content=body, timeout=120,
                           headers={"X-Null-Mode": mode, "X-Null-Compress": "1" if compress else "0"})
        answer.raise_for_status()
        return {"mode": mode, "result_bytes": len(data)}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# -- the bench ---------------------------------------------------------------------


@dataclass
class Column:
    """What one column of one workload measured."""

    samples: list = field(default_factory=list)
    server: dict = field(default_factory=dict)  # meta field -> samples (ours only)
    checked: int = 0
    wrong: int = 0
    first_wrong: Optional[str] = None
    errors: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # the last remote meta

    def record_meta(self, meta: dict) -> None:
        self.meta = meta or self.meta
        for key in ("queue_ms", "deserialize_ms", "run_ms", "isolated_ms", "upload_ms"):
            if isinstance(meta.get(key), (int, float)):
                self.server.setdefault(key, []).append(float(meta[key]))

    def summary(self, check: bool = True) -> dict:
        out = measure.stats(self.samples)
        out["server_p50_ms"] = {k: round(measure.percentile(v, 0.5), 3) for k, v in self.server.items() if v}
        out["correct"] = (self.wrong == 0 and self.checked > 0) if check else None
        out["checked"] = self.checked
        if self.first_wrong:
            out["first_difference"] = self.first_wrong
        if self.errors:
            out["errors"] = self.errors[:5]
        return out


class Bench:
    def __init__(self, args: argparse.Namespace, plan: Plan, model: BenchModel, hf_home: Path) -> None:
        self.args = args
        self.plan = plan
        self.model_info = model
        self.hf_home = hf_home
        self.only = set(args.only.split(",")) if args.only else set(ALL)
        unknown = self.only - set(ALL)
        if unknown:
            raise SystemExit(f"unknown workloads {sorted(unknown)}; known: {', '.join(ALL)}")
        from bench.workloads import Spec

        self.spec = Spec(gpt2=model.gpt2, gen_tokens=plan.gen_tokens, session_traces=plan.session_traces,
                         big_bytes=plan.big_bytes)
        self.commit = measure.git_commit()
        self.out: dict = {
            "commit": self.commit,
            "smoke": bool(args.smoke),
            "model": model.name,
            "repo_id": model.repo_id,
            "device": args.device,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "host": {"cpus": os.cpu_count(), "hostname": socket.gethostname()},
            "plan": {"reps": plan.reps, "warmup": plan.warmup, "big_bytes": plan.big_bytes,
                     "cold_reps": plan.cold_reps, "isolation_reps": plan.isolation_reps,
                     "throughput": plan.throughput, "compute_throughput": plan.compute_throughput},
            "workloads": {},
            "checks": [],
        }
        self.refs: dict = {}
        self.null: Optional[NullServer] = None
        self.stack = None
        self.iso_stack = None
        self.zygote_stack = None
        self.compute_stack = None
        # Client models that have made their first (slower) request, kept alive so their ids stay theirs.
        self.warmed: dict = {}
        self.homes: list[Path] = []
        self.max_inline = int(os.environ.get("NDIF_MAX_INLINE_BYTES") or 4 * MiB)
        self.json_path = Path(args.out) if args.out else OUT_DIR / ("bench-smoke.json" if args.smoke else "bench.json")

    # -- plumbing --

    def stack_env(self, **extra: str) -> dict:
        env = {"HF_HOME": str(self.hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        for item in self.args.stack_env:
            key, _, value = item.partition("=")
            env[key] = value
        env.update(extra)
        return env

    def new_stack(self, **extra: str):
        from tests.stack import Stack

        home = Path(tempfile.mkdtemp(prefix="ndif-bench-"))
        self.homes.append(home)
        return Stack(home, env=self.stack_env(**extra))

    def client(self, repo_id: str, local: bool = False):
        """A client model; ``local`` ones carry the device/dtype of the local column."""
        import torch

        from tests.tiny_model import client_model

        kwargs: dict = {}
        if local and self.args.device == "cuda":
            kwargs = {"device_map": "cuda", "dtype": getattr(torch, self.model_info.dtype)}
        return client_model(repo_id, **kwargs)

    def call(self, fn: Callable, model, host: Optional[str], spec=None) -> tuple[float, Any, dict]:
        """Run ``fn`` locally (host None) or remotely against ``host``; (ms, saves, meta)."""
        import nnsight

        remote = {}
        if host is not None:
            nnsight.CONFIG.API.HOST = host
            remote = {"remote": True}
        _last.meta = None
        sync = self.args.device == "cuda" and host is None
        started = time.perf_counter()
        saves = fn(model, remote, spec or self.spec)
        if sync:
            import torch

            torch.cuda.synchronize()
        return (time.perf_counter() - started) * 1000, saves, last_meta()

    def measure_into(self, column: Column, fn: Callable, model, host: Optional[str], ref: Any, spec=None) -> Any:
        try:
            ms, saves, meta = self.call(fn, model, host, spec=spec)
        except Exception as error:  # noqa: BLE001 - recorded, the run goes on
            column.errors.append(f"{type(error).__name__}: {str(error)[:500]}")
            return None
        column.samples.append(ms)
        column.record_meta(meta)
        if ref is not None:
            column.checked += 1
            found = measure.difference(saves, ref)
            if found:
                column.wrong += 1
                column.first_wrong = column.first_wrong or found
        return saves

    def save_json(self) -> None:
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.json_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.out, indent=1, default=str))
        os.replace(tmp, self.json_path)

    def emit(self, text: str) -> None:
        print(text, flush=True)

    def header(self, name: str, reps: Any, model: Optional[str] = None) -> str:
        title = TITLES[name].format(gen_tokens=self.plan.gen_tokens, session_traces=self.plan.session_traces,
                                    big_mib=self.plan.big_bytes // MiB, torch_threads=COMPUTE_THREADS)
        return f"\n== {name}: {title}\n   commit {self.commit}, model {model or self.model_info.name}, {reps}"

    # -- run --

    def run(self) -> dict:
        import nnsight

        _hook_meta()
        nnsight.CONFIG.APP.REMOTE_LOGGING = False
        self.compress = bool(nnsight.CONFIG.API.COMPRESS)
        started = time.monotonic()
        self.emit(f"bench: commit {self.commit}, model {self.model_info.name} ({self.model_info.repo_id}), "
                  f"{'smoke' if self.args.smoke else 'full'}, {os.cpu_count()} CPUs")
        self.model = self.client(self.model_info.repo_id, local=True)
        self.null = NullServer().start()
        self.stack = self.new_stack()
        started_stack = time.perf_counter()
        self.stack.start()
        self.first_request()
        self.out["stack_start_s"] = round(time.perf_counter() - started_stack, 3)
        for name in TIME_WORKLOADS:
            if name in self.only:
                self.time_workload(name)
        if "cold_start" in self.only:
            self.cold_start()
        if "isolation" in self.only:
            self.isolation()
        if "throughput" in self.only:
            self.throughput()
            if self.throughput_model() is not None:
                self.compute_throughput()
        if "capacity" in self.only:
            self.capacity()
        self.out["checks"] = self.checks()
        self.out["elapsed_s"] = round(time.monotonic() - started, 1)
        self.save_json()
        self.emit(f"\n== targets (issue #6), commit {self.commit}")
        for check in self.out["checks"]:
            self.emit(f"{check['verdict']:<4}  {check['name']}: {check['detail']}")
        self.emit(f"\nvalues: {self.values_line()}")
        self.emit(f"elapsed {self.out['elapsed_s']} s; JSON: {self.json_path}")
        return self.out

    def first_request(self) -> None:
        """The first request on a stack just started: the model is deployed by it,
        in a worker that has not loaded any model yet (recorded, not a column)."""
        from bench.workloads import small_trace

        try:
            ms, _, meta = self.call(small_trace, self.model, self.stack.url)
        except Exception as error:  # noqa: BLE001 - recorded
            self.out["first_request"] = {"error": f"{type(error).__name__}: {error}"}
            return
        self.out["first_request"] = {"ms": round(ms, 3), "meta": meta}
        self.emit(f"first request on the new stack (deploys {self.model_info.repo_id} in a fresh worker): "
                  f"{ms:.0f} ms (queue_ms {meta.get('queue_ms')}, run_ms {meta.get('run_ms')})")

    def close(self) -> None:
        import shutil

        for stack in (self.compute_stack, self.iso_stack, self.zygote_stack, self.stack):
            if stack is not None:
                with contextlib.suppress(Exception):
                    stack.stop()
        if self.null is not None:
            self.null.stop()
        if self.had_errors():  # keep the stacks' logs next to the JSON, for whoever reads it
            keep = self.json_path.with_name(self.json_path.stem + "-logs")
            shutil.rmtree(keep, ignore_errors=True)
            for i, home in enumerate(self.homes):
                if (home / "logs").is_dir():
                    shutil.copytree(home / "logs", keep / f"stack{i}", dirs_exist_ok=True)
            self.emit(f"errors during the run; the stacks' logs are in {keep}")
        for home in self.homes:
            shutil.rmtree(home, ignore_errors=True)

    def had_errors(self) -> bool:
        text = json.dumps(self.out, default=str)
        return '"errors": [' in text or '"crashed"' in text or '"error"' in text

    # -- workloads measured in three columns --

    def reference(self, name: str, fn: Callable, model, spec=None) -> Any:
        """The local run's saves (run twice: the two must agree, so the block is deterministic)."""
        _, first, _ = self.call(fn, model, None, spec=spec)
        _, second, _ = self.call(fn, model, None, spec=spec)
        found = measure.difference(second, first)
        if found:
            raise RuntimeError(f"{name} is not deterministic locally: {found}")
        return first

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

    def record(self, name: str, columns: dict, reps_text: str, extra: Optional[dict] = None,
               notes: Optional[list] = None) -> None:
        summary = {col: c.summary(check=(col != "local")) for col, c in columns.items()}
        entry = {"columns": summary, "ratios": self.ratios(summary)}
        entry.update(extra or {})
        self.out["workloads"][name] = entry
        self.save_json()
        self.emit(self.header(name, reps_text))
        cols = list(summary)
        rows = []
        for q in ("p50", "p95"):
            cells = [measure.fmt(summary[c].get(f"{q}_ms")) for c in cols]
            cells += [measure.fmt(entry["ratios"].get(f"ours/local {q}"), "x"),
                      measure.fmt(entry["ratios"].get(f"ours/null {q}"), "x")]
            rows.append((f"{q} ms", cells))
        rows.append(("correct", [measure.fmt(summary[c]["correct"]) if summary[c]["correct"] is not None else "ref"
                                 for c in cols] + ["", ""]))
        self.emit(measure.render_table("", cols + ["ours/local", "ours/null"], rows).lstrip("\n"))
        for col in cols:
            if summary[col].get("errors"):
                self.emit(f"   {col} ERRORS: {summary[col]['errors'][0]}")
            if summary[col].get("first_difference"):
                self.emit(f"   {col} WRONG VALUES: {summary[col]['first_difference']}")
        server = summary.get("ours", {}).get("server_p50_ms")
        if server:
            self.emit("   ours server p50: " + ", ".join(f"{k} {v:.1f}" for k, v in server.items()))
        for note in notes or []:
            self.emit("   " + note)

    @staticmethod
    def ratios(summary: dict) -> dict:
        out = {}
        for base in ("local", "null"):
            for q in ("p50", "p95"):
                ours, other = summary.get("ours", {}).get(f"{q}_ms"), summary.get(base, {}).get(f"{q}_ms")
                if ours and other:
                    out[f"ours/{base} {q}"] = round(ours / other, 3)
        return out

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
        from bench.workloads import small_trace

        import torch
        from transformers import AutoModelForCausalLM

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

    # -- isolation --

    def isolation(self) -> None:
        """The same trace in-process, in a child of a zygote forked from the
        worker's fork server (NDIF_ISOLATION=fork) and in one of an exec'd
        zygote (NDIF_ISOLATION=zygote, the default), each its own stack, interleaved."""
        from bench.workloads import small_trace

        reps = self.plan.isolation_reps
        self.iso_stack = self.new_stack(NDIF_DEFAULT_TRUSTED="0", NDIF_ISOLATION="fork")
        self.iso_stack.start()
        self.zygote_stack = self.new_stack(NDIF_DEFAULT_TRUSTED="0", NDIF_ISOLATION="zygote")
        self.zygote_stack.start()
        ref = self.refs.get("small_trace") or self.reference("isolation", small_trace, self.model)
        self.null.prepare(ref, self.compress, self.max_inline)
        hosts = {"local": None, "null": self.null.url, "ours": self.stack.url, "ours_isolated": self.iso_stack.url,
                 "ours_zygote": self.zygote_stack.url}
        columns = {col: Column() for col in hosts}
        for host in hosts.values():
            for _ in range(max(self.plan.warmup, 2)):
                with contextlib.suppress(Exception):
                    self.call(small_trace, self.model, host)
        order = list(hosts)
        for rep in range(reps):
            shift = rep % len(order)
            for col in order[shift:] + order[:shift]:
                # Spaced: each stack's spare child is prepared (forked, jailed,
                # warmed) in the background after a job; without a pause the
                # next column would be timed against the previous stack's
                # preparation on these few cores, not against its own path.
                time.sleep(ISOLATION_GAP_S)
                self.measure_into(columns[col], small_trace, self.model, hosts[col], ref)
        # And back to back on each stack: the next request may have to wait for its spare.
        burst = {col: Column() for col in ("ours", "ours_isolated", "ours_zygote")}
        for col, column in burst.items():
            for _ in range(max(reps // 2, 2)):
                self.measure_into(column, small_trace, self.model, hosts[col], ref)
        burst_p50 = {col: column.summary().get("p50_ms") for col, column in burst.items()}
        for stack in (self.iso_stack, self.zygote_stack):
            stack.stop()
        self.iso_stack = self.zygote_stack = None
        summary = {col: c.summary() for col, c in columns.items()}

        def added(col: str) -> Optional[float]:
            if summary["ours"].get("p50_ms") and summary[col].get("p50_ms"):
                return round(summary[col]["p50_ms"] - summary["ours"]["p50_ms"], 3)
            return None

        def server_p50(col: str) -> Optional[float]:
            values = columns[col].server.get("isolated_ms", [])
            return round(measure.percentile(values, .5), 3) if values else None

        fork_added, zygote_added = added("ours_isolated"), added("ours_zygote")
        burst_notes = []
        if all(burst_p50.values()):
            burst_notes = [f"back to back ({max(reps // 2, 2)} each, no pause): client p50 in-process "
                           f"{burst_p50['ours']:.1f} ms, fork {burst_p50['ours_isolated']:.1f} ms "
                           f"({burst_p50['ours_isolated'] - burst_p50['ours']:+.1f}), zygote "
                           f"{burst_p50['ours_zygote']:.1f} ms ({burst_p50['ours_zygote'] - burst_p50['ours']:+.1f})"]
        self.record("isolation", columns, f"{reps} reps per column, interleaved, {ISOLATION_GAP_S * 1000:.0f} ms apart; "
                                          "ours_isolated and ours_zygote are stacks with NDIF_DEFAULT_TRUSTED=0 "
                                          "(NDIF_ISOLATION=fork / zygote)",
                    {"isolated_added_p50_ms": fork_added, "zygote_added_p50_ms": zygote_added,
                     "back_to_back_p50_ms": burst_p50, "gap_s": ISOLATION_GAP_S,
                     "isolated_meta": {"isolated_ms_p50": server_p50("ours_isolated"),
                                       "zygote_isolated_ms_p50": server_p50("ours_zygote")}},
                    notes=[f"{label} - in-process, client p50: {value:+.1f} ms" if value is not None else
                           f"{label} - in-process: not measured"
                           for label, value in (("isolated (fork)", fork_added), ("isolated (zygote)", zygote_added))]
                    + burst_notes)

    # -- throughput --

    def throughput_model(self) -> Optional[BenchModel]:
        """The compute-bound model the throughput target is measured on, or None
        (measured on the main model's cells: a GPU run, or ``--smoke``)."""
        choice = self.args.throughput_model
        if choice == "auto":
            choice = "gpt2-medium" if self.args.device == "cpu" and not self.args.smoke else "main"
        return None if choice == "main" else MODELS[choice]

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
        import torch

        from bench import models
        from bench.workloads import Spec, small_trace

        info = self.throughput_model()
        threads = COMPUTE_THREADS
        started = time.perf_counter()
        models.build(info, self.hf_home)
        built_s = time.perf_counter() - started
        for stack_name in ("iso_stack", "zygote_stack", "stack"):  # done with them: free the cores
            stack = getattr(self, stack_name)
            if stack is not None:
                with contextlib.suppress(Exception):
                    stack.stop()
                setattr(self, stack_name, None)
        spec = Spec(gpt2=info.gpt2, gen_tokens=self.plan.gen_tokens, session_traces=self.plan.session_traces,
                    big_bytes=self.plan.big_bytes)
        saved_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
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
        finally:
            torch.set_num_threads(saved_threads)
        self.record_throughput(
            "throughput_compute", cells, second, self.plan.compute_throughput, info,
            {"role": "checked", "model": info.name, "repo_id": info.repo_id, "torch_threads": threads,
             "build_s": round(built_s, 3), "first_request": {"ms": round(first_ms, 3), "meta": first_meta},
             "elapsed_s": round(time.perf_counter() - started, 1)},
            note=(f"{info.name} ({info.repo_id}, random weights), NDIF_TORCH_THREADS={threads} in a stack of its "
                  f"own (the main stack stopped), local column with torch.set_num_threads({threads}); first "
                  f"request (deploys it): {first_ms:.0f} ms"),
        )
        self.compute_stack.stop()
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

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(models))]
        for thread in threads:
            thread.start()
        barrier.wait()
        started = time.perf_counter()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
        merged = Column()
        for column in columns:
            merged.samples += column.samples
            merged.checked += column.checked
            merged.wrong += column.wrong
            merged.first_wrong = merged.first_wrong or column.first_wrong
            merged.errors += column.errors
            for key, values in column.server.items():
                merged.server.setdefault(key, []).extend(values)
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
                              + "; local = the same number of requests one after another in-process",
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

    # -- the targets --

    def checks(self) -> list[dict]:
        w = self.out["workloads"]
        checks = []

        def add(name: str, ok: Optional[bool], detail: str) -> None:
            checks.append({"name": name, "pass": ok, "verdict": "SKIP" if ok is None else ("PASS" if ok else "FAIL"),
                           "detail": detail})

        small = w.get("small_trace", {}).get("columns", {})
        try:
            o, n, loc = small["ours"]["p50_ms"], small["null"]["p50_ms"], small["local"]["p50_ms"]
            add("small trace p50: ours <= null + local + 10 ms", o <= n + loc + 10,
                f"ours {o:.1f} ms vs null {n:.1f} + local {loc:.1f} + 10 = {n + loc + 10:.1f} ms")
        except (KeyError, TypeError):
            add("small trace p50: ours <= null + local + 10 ms", None, "not measured")

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

        iso = w.get("isolation", {})
        added = iso.get("isolated_added_p50_ms")
        add("isolated adds <= 25 ms p50 over in-process", None if added is None else added <= 25,
            "not measured" if added is None else f"{added:+.1f} ms")
        zygote = iso.get("zygote_added_p50_ms")
        add("isolated through the zygote adds <= 25 ms p50 over in-process", None if zygote is None else zygote <= 25,
            "not measured" if zygote is None else f"{zygote:+.1f} ms")
        for check in w.get("capacity", {}).get("checks", []):  # issue #14's, from bench/capacity.py
            add(f"capacity: {check['name']}", check["pass"], check["detail"])
        return checks

    def capacity(self) -> None:
        """``bench/capacity.py`` (N waiting /subscribe sockets on a stack of its
        own: N = 1,000 / 5,000 / 10,000, 200 with --smoke), run as a process of
        its own (it raises its open-files limit and holds thousands of sockets);
        its table is printed here and its targets join this run's."""
        out = self.json_path.with_name(self.json_path.stem + "-capacity.json")
        command = [sys.executable, str(ROOT / "bench" / "capacity.py"), "--out", str(out), "--hf-home", str(self.hf_home)]
        command += ["--smoke"] if self.args.smoke else []
        for item in self.args.stack_env:
            command += ["--stack-env", item]
        self.emit("\n== capacity: waiting /subscribe sockets held on one web host (bench/capacity.py)")
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        self.emit("\n".join(line for line in proc.stdout.splitlines() if not line.startswith(("JSON:", "\x1b", "\r"))))
        if proc.returncode != 0 or not out.exists():
            self.out["workloads"]["capacity"] = {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
            return
        self.out["workloads"]["capacity"] = json.loads(out.read_text())

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

    def values_line(self) -> str:
        """One line: did every remote column get exactly the local values?"""
        groups = []
        for name, entry in self.out["workloads"].items():
            if "columns" in entry:
                groups.append((name, entry["columns"]))
            for label, cell in entry.get("cells", {}).items():
                groups.append((f"{name}/{label}", {c: cell[c] for c in ("null", "ours")}))
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
        return f"every remote column returned exactly the local values ({checked} columns checked)"


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


# -- entry point ---------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="ndif-celery bench: local vs null server vs ours")
    parser.add_argument("--smoke", action="store_true", help="about a minute: few repetitions, a 16 MiB big result")
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

    for path in sorted((ROOT / "bench").glob("*.py")):
        ast.parse(path.read_text(), str(path))
    info, twin = models.dry_run(model, hf_home)
    spec = workloads.Spec(gpt2=twin.gpt2, gen_tokens=plan.gen_tokens, session_traces=plan.session_traces,
                          big_bytes=4 * MiB)
    from tests.tiny_model import client_model

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
