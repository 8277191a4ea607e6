"""The ``Bench`` object: one run's state and the plumbing every section uses.

It holds what the sections share (the arguments and plan, the local client
model, the null server, the stacks, the references, the JSON being written)
and does the steps they are all made of: start a stack, make a client model,
time one call (``call``, ``measure_into``), take the local reference, record a
three-column table and save the JSON. ``run`` walks the sections in order;
each section is a mixin in ``bench/sections/`` (see its ``__init__``).
torch, nnsight and ``bench.workloads`` are imported inside the methods:
``bench/run.py`` sets ``HF_HOME`` and the offline flags before anything
imports transformers (they read them once).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

from bench import measure  # no torch at import
from bench.columns import Column, NullServer, forget_meta, hook_meta, last_meta
from bench.models import BenchModel
from bench.plan import ALL, COMPUTE_THREADS, OUT_DIR, TIME_WORKLOADS, TITLES, MiB, Plan
from bench.sections.capacity import CapacitySection
from bench.sections.checks import TargetChecks
from bench.sections.cobatch import CobatchSection
from bench.sections.cpu import CpuSection
from bench.sections.fairness import FairnessSection
from bench.sections.isolation import IsolationSection
from bench.sections.throughput import ThroughputSection
from bench.sections.timed import TimedSections


class Bench(TimedSections, IsolationSection, ThroughputSection, CobatchSection, FairnessSection, CpuSection,
            CapacitySection, TargetChecks):
    """One bench run: ``Bench(args, plan, model, hf_home).run()``, then ``close()``."""

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

        self.client_nice = args.client_nice  # of every client thread (run_clients)
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
                     "throughput": plan.throughput, "compute_throughput": plan.compute_throughput,
                     "cobatch": plan.cobatch, "compute_cobatch": plan.compute_cobatch,
                     "cobatch_rounds": plan.cobatch_rounds, "fairness": plan.fairness, "cpu": plan.cpu,
                     "client_nice": self.client_nice},
            "workloads": {},
            "checks": [],
        }
        self.refs: dict = {}
        self.null: Optional[NullServer] = None
        self.stack = None
        self.iso_stack = None
        self.zygote_stack = None
        self.compute_stack = None
        self.cobatch_stack = None  # the main model's co-batching-off stack (bench/sections/cobatch.py)
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
        from tests.support.stacks.stack import Stack

        home = Path(tempfile.mkdtemp(prefix="ndif-bench-"))
        self.homes.append(home)
        return Stack(home, env=self.stack_env(**extra))

    @staticmethod
    def at_once(step: Callable, stacks) -> None:
        """``step(stack)`` for every stack at once, each in a thread of its own;
        every one ends, then the first failure (in ``stacks``' order) is raised.

        Only where nothing is being measured meanwhile: a stack's start or its
        first deployment is mostly waiting (imports, readiness, the model's
        load), so two side by side take little more than one."""
        with ThreadPoolExecutor(max_workers=len(stacks), thread_name_prefix="stack-step") as pool:
            for future in [pool.submit(step, stack) for stack in stacks]:
                future.result()

    def client(self, repo_id: str, local: bool = False):
        """A client model; ``local`` ones carry the device/dtype of the local column."""
        import torch

        from tests.support.cases.tiny_model import client_model

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
        forget_meta()
        sync = self.args.device == "cuda" and host is None
        started, called_at = time.perf_counter(), time.time()
        saves = fn(model, remote, spec or self.spec)
        if sync:
            import torch

            torch.cuda.synchronize()
        ms = (time.perf_counter() - started) * 1000
        meta = last_meta()
        if meta:  # the client's clock around the call: the timeline's first and last hops
            meta = dict(meta, client_at=(called_at, time.time()))
        return ms, saves, meta

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

        hook_meta()
        nnsight.CONFIG.APP.REMOTE_LOGGING = False
        self.compress = bool(nnsight.CONFIG.API.COMPRESS)
        started = time.monotonic()
        self.emit(f"bench: commit {self.commit}, model {self.model_info.name} ({self.model_info.repo_id}), "
                  f"{'smoke' if self.args.smoke else 'full'}, {os.cpu_count()} CPUs")
        self.model = self.client(self.model_info.repo_id, local=True)
        self.null = NullServer().start()
        self.stack = self.new_stack()
        started_stack = time.perf_counter()
        if "cobatch" in self.only:  # its off stack starts alongside (idle until the cobatch section)
            self.start_cobatch_off()
        self.stack.start()
        self.first_request()
        self.out["stack_start_s"] = round(time.perf_counter() - started_stack, 3)
        for name in TIME_WORKLOADS:
            if name in self.only:
                self.timed(name, self.time_workload, name)
        if "cold_start" in self.only:
            self.timed("cold_start", self.cold_start)
        if "isolation" in self.only:
            self.timed("isolation", self.isolation)
        # The main model's cells first: the compute-bound sections stop the main stack.
        if "throughput" in self.only:
            self.timed("throughput", self.throughput)
        if "cobatch" in self.only:
            self.timed("cobatch", self.cobatch)
        if self.throughput_model() is not None:
            if "throughput" in self.only:
                self.timed("throughput_compute", self.compute_throughput)
            if "cobatch" in self.only:
                self.timed("cobatch_compute", self.compute_cobatch)
        if "fairness" in self.only:
            self.timed("fairness", self.fairness)
        if "cpu_per_request" in self.only:
            self.timed("cpu_per_request", self.cpu_per_request)
        if "capacity" in self.only:
            self.timed("capacity", self.capacity)
        self.out["checks"] = self.checks()
        self.out["elapsed_s"] = round(time.monotonic() - started, 1)
        self.save_json()
        self.emit(f"\n== targets, commit {self.commit}")
        for check in self.out["checks"]:
            self.emit(f"{check['verdict']:<4}  {check['name']}: {check['detail']}")
        self.emit(f"\nvalues: {self.values_line()}")
        sections = ", ".join(f"{name} {took:.0f}" for name, took in self.out.get("section_s", {}).items())
        self.emit(f"elapsed {self.out['elapsed_s']} s (stack start {self.out.get('stack_start_s', 0):.0f}; {sections}); "
                  f"JSON: {self.json_path}")
        return self.out

    def timed(self, name: str, section: Callable, *args) -> None:
        """Run one section and record its wall time (``section_s`` in the JSON):
        where a run's minutes go (stack starts, model loads) is not in the tables."""
        started = time.monotonic()
        section(*args)
        self.out.setdefault("section_s", {})[name] = round(time.monotonic() - started, 1)

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
        self.follow_worker_threads(self.stack)

    def follow_worker_threads(self, stack) -> None:
        """The local column runs on the torch threads the worker chose for the
        model (``workers.models.threads``): the same compute, the same bits."""
        import redis
        import torch

        from ndif_celery.state import registry

        client = redis.Redis.from_url(stack.redis_url)
        try:
            chosen = [entry.get("torch_threads") for entry in registry.live_deployments(client)
                      if self.model_info.repo_id in entry["model_key"]]
        finally:
            client.close()
        self.default_threads = torch.get_num_threads()  # a base commit's workers use it (bench/sections/cpu.py)
        if chosen and chosen[0]:
            torch.set_num_threads(int(chosen[0]))
            self.out["torch_threads"] = int(chosen[0])
            self.emit(f"the worker runs {self.model_info.repo_id} on {chosen[0]} torch thread(s); "
                      f"so does the local column")

    def close(self) -> None:
        import shutil

        starter = getattr(self, "_cobatch_starter", None)
        if starter is not None:
            starter.join(timeout=200)
        for stack in (self.compute_stack, self.cobatch_stack, self.iso_stack, self.zygote_stack, self.stack):
            if stack is not None:
                with contextlib.suppress(Exception):
                    stack.discard()
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

    # -- the local reference and the three-column table --

    def reference(self, name: str, fn: Callable, model, spec=None) -> Any:
        """The local run's saves (run twice: the two must agree, so the block is deterministic)."""
        _, first, _ = self.call(fn, model, None, spec=spec)
        _, second, _ = self.call(fn, model, None, spec=spec)
        found = measure.difference(second, first)
        if found:
            raise RuntimeError(f"{name} is not deterministic locally: {found}")
        return first

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
        hops = summary.get("ours", {}).get("timeline_mean_ms")
        if hops:
            self.emit("   ours timeline, mean ms: " + ", ".join(f"{hop} {ms:.1f}" for hop, ms in hops.items())
                      + f" (sum {sum(hops.values()):.1f})")
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
