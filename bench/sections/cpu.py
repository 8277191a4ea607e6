"""The CPU one small trace costs each process, the farm's code of a base
commit against this checkout's, side by side in one run.

Two stacks, each started from its own checkout (``tests/support/stacks/stack.py``
runs the CLI with the checkout as its working directory): ``base`` from
``Plan.cpu_base`` (``git archive`` of that commit into a temporary folder;
``--cpu-base`` names another commit or a folder), ``new`` from this one. In
rounds, each stack answers a run of small traces from one client, one after
another; the CPU time every process used meanwhile is read from ``/proc``
(user + system, of each service's whole process tree) before and after, and
the client's is this process's own (``getrusage``: the bench thread is the
only one working meanwhile). Per request: the totals over the rounds divided
by the requests. The farm's share is web + worker + Redis; the beat and
Flower (``other``) run on timers and are shown apart.

``bench.workloads`` (torch) is imported inside: see ``bench/run.py``.
"""

from __future__ import annotations

import importlib
import resource
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from bench import measure
from bench.plan import ROOT

KINDS = ("client", "web", "worker", "redis", "other")
# Both stacks start cold, each process its own tree: the test suite's warm start
# (tests/support/stacks/launcher.py, which the bench's smoke run inherits) forks workers
# from a launcher outside the stack's process trees, where their CPU is not seen.
COLD = {"NDIF_TEST_LAUNCHER": ""}
FARM = ("web", "worker", "redis")


def checkout(base: str) -> Path:
    """A folder holding ``base``: itself when it is one, else that commit's
    files (``git archive``)."""
    if Path(base).is_dir():
        return Path(base)
    folder = Path(tempfile.mkdtemp(prefix="ndif-bench-base-"))
    archive = folder / "base.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "archive", base], cwd=ROOT, stdout=out, check=True, timeout=120)
    with tarfile.open(archive) as tar:
        tar.extractall(folder / "tree", filter="data")
    return folder / "tree"


def base_module(base_root: Path, name: str):
    """Module ``name`` of the checkout at ``base_root``, with the helpers it imports.

    The two checkouts' ``tests`` packages may be laid out differently, so the
    base's module imports the base's own: its tree goes first on ``sys.path``
    and this checkout's ``tests`` modules are set aside meanwhile, then put back.
    Its ``ROOT`` is the base's folder, so its CLI and services run the base's code.
    """
    def ours() -> list:
        return [module for module in sys.modules if module == "tests" or module.startswith("tests.")]

    kept = {module: sys.modules.pop(module) for module in ours()}
    sys.path.insert(0, str(base_root))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(base_root))
        for module in ours():
            del sys.modules[module]
        sys.modules.update(kept)


def service_cpu_s(pids: dict) -> dict:
    """CPU seconds used so far by each kind of service (its whole process tree)."""
    import psutil

    out = dict.fromkeys(KINDS[1:], 0.0)
    for service, pid in pids.items():
        kind = service if service in out else "other"
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                times = proc.cpu_times()
                out[kind] += times.user + times.system
        except psutil.Error:
            continue
    return out


def client_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class CpuSection:
    """Mixin of ``bench.core.Bench``: ``cpu_per_request()``."""

    def base_reference(self, fn):
        """The local values on the threads a base worker uses (the setting, else
        torch's default; this checkout's workers choose per model): the same bits."""
        import os

        import torch

        setting = int(self.stack_env().get("NDIF_TORCH_THREADS") or os.environ.get("NDIF_TORCH_THREADS") or 0)
        threads = setting or getattr(self, "default_threads", 0) or torch.get_num_threads()
        kept = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return self.reference("small_trace", fn, self.model)
        finally:
            torch.set_num_threads(kept)

    def cpu_per_request(self) -> None:
        from bench import workloads

        base = self.args.cpu_base or self.plan.cpu_base
        try:
            base_root = checkout(base)
        except (OSError, subprocess.SubprocessError, tarfile.TarError) as error:
            self.out["workloads"]["cpu_per_request"] = {"skipped": f"no checkout of {base}: {error}"}
            self.emit(f"\n== cpu_per_request: skipped, no checkout of {base}: {error}")
            return
        base_stack = base_module(base_root, "tests.support.stack")
        stacks = {"base": base_stack.Stack(Path(tempfile.mkdtemp(prefix="ndif-bench-")), env=self.stack_env(**COLD)),
                  "new": self.new_stack(**COLD)}
        self.homes.append(stacks["base"].home)
        self.at_once(lambda stack: stack.start(), list(stacks.values()))
        fn = workloads.WORKLOADS["small_trace"]
        refs = {"new": self.refs.get("small_trace") or self.reference("small_trace", fn, self.model),
                "base": self.base_reference(fn)}
        rounds, per_round = self.plan.cpu
        used = {name: dict.fromkeys(KINDS, 0.0) for name in stacks}
        wrong: dict = {name: 0 for name in stacks}
        try:
            for stack in stacks.values():  # deploy, and the first (slower) requests
                for _ in range(3):
                    self.call(fn, self.model, stack.url)
            for r in range(rounds):
                order = list(stacks) if r % 2 == 0 else list(stacks)[::-1]
                for name in order:
                    stack = stacks[name]
                    pids = stack.pids()
                    before, client_before = service_cpu_s(pids), client_cpu_s()
                    for _ in range(per_round):
                        _, saves, _ = self.call(fn, self.model, stack.url)
                        wrong[name] += bool(measure.difference(saves, refs[name]))
                    client, after = client_cpu_s() - client_before, service_cpu_s(pids)
                    used[name]["client"] += client
                    for kind in KINDS[1:]:
                        used[name][kind] += after[kind] - before[kind]
        finally:
            for stack in stacks.values():
                stack.discard()
        requests = rounds * per_round
        per_request = {name: {kind: round(seconds * 1000 / requests, 2) for kind, seconds in kinds.items()}
                       for name, kinds in used.items()}
        for kinds in per_request.values():
            kinds["farm"] = round(sum(kinds[kind] for kind in FARM), 2)
        self.out["workloads"]["cpu_per_request"] = {"base": base, "requests": requests, "cpu_ms": per_request,
                                                   "wrong": wrong}
        self.emit(f"\n== cpu_per_request: CPU-ms of each process kind per small trace, base {base} vs this checkout"
                  f"\n   commit {self.commit}, model {self.model_info.name}, {rounds} rounds x {per_round} "
                  f"requests per stack, one client, alternating; farm = web + worker + redis")
        rows = []
        for kind in (*KINDS, "farm"):
            b, n = per_request["base"][kind], per_request["new"][kind]
            rows.append((kind, [f"{b:.2f}", f"{n:.2f}", measure.fmt(round(n / b, 3) if b else None, "x")]))
        rows.append(("correct", [f"{requests - wrong[name]}/{requests}" for name in stacks] + [""]))
        self.emit(measure.render_table("", ["base", "new", "new/base"], rows).lstrip("\n"))
