"""Where the time goes during the small-trace workload: py-spy on the web
(every gunicorn process), the worker and the client, at once.

    .venv/bin/pip install -e '.[profile]'      # once: py-spy
    .venv/bin/python bench/hotspots.py [--seconds 20] [--rate 250]

Starts a stack (the real CLI), warms it up, then sends small traces one after
another for ``--seconds`` while ``py-spy record`` samples every process
(non-blocking, idle threads left out). Prints, per process group, the top
functions by own time (the leaf of the sampled stack) and by total time
(anywhere on the stack), as a share of that group's samples, and keeps the
raw collapsed stacks (flame-graph input) in ``bench/_out/profile/``.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench import measure  # noqa: E402
from bench.models import MODELS  # noqa: E402

OUT = ROOT / "bench" / "_out" / "profile"


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("py-spy is not installed: .venv/bin/pip install -e '.[profile]'")
    return found


def top(raw_files: list[Path], limit: int) -> tuple[int, list, list]:
    """(samples, [(own share, function)], [(total share, function)]) over collapsed stacks."""
    own: collections.Counter = collections.Counter()
    total: collections.Counter = collections.Counter()
    samples = 0
    for path in raw_files:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = [f for f in stack.split(";") if f and not f.startswith("process ") and not f.startswith("thread ")]
            if not frames:
                continue
            samples += n
            own[frames[-1]] += n
            for frame in set(frames):
                total[frame] += n
    def share(counter):
        return [(count / samples, frame) for frame, count in counter.most_common(limit)] if samples else []
    return samples, share(own), share(total)


# Where a sample falls, by a frame anywhere on its stack (a sample can count for several).
MARKERS = {
    "web": ["submit (web/routes", "send_job", "Celery.send_task", "_announce", "check_and_count", "identify",
            "subscribe (web/subscribe", "get_message", "download (web/results", "ledger", "metrics"],
    "worker": ["run_job (workers/tasks", "run (workers/job", "InProcess.run", "deserialize (workers/execute", "run (workers/execute",
               "Meta.interleave", "encode (workers/results", "completed_frame", "StatusChannel.send",
               "restore_if_changed", "request_scope", "Controller.run", "WorkerState._beat", "ledger", "metrics",
               "kombu/", "redis/"],
    "client": ["RemoteBackend._serialize", "RemoteBackend._post", "create_ssl_context", "create_connection (websocket",
               "RemoteBackend.finalize", "ResponseModel.unpickle"],
}


def breakdown(raw_files: list[Path], markers: list[str]) -> list[tuple[float, str]]:
    samples, hits = 0, collections.Counter()
    for path in raw_files:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            samples += int(count)
            for marker in markers:
                if marker in stack:
                    hits[marker] += int(count)
    return [(hits[m] / samples, m) for m in markers] if samples else []


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=int, default=250, help="samples per second per process")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--model", default="tiny", choices=sorted(MODELS))
    parser.add_argument("--clients", type=int, default=1, help="client threads sending at once (each its own model)")
    parser.add_argument("--warmup", type=int, default=20, help="requests before sampling (every gunicorn process "
                                                               "imports Celery's and kombu's lazy modules on its first)")
    parser.add_argument("--gil", action="store_true", help="only samples holding the GIL: Python CPU, no waits "
                                                           "(torch kernels release it and drop out too)")
    args = parser.parse_args(argv)
    hf_home = Path(os.environ.get("HF_HOME") or ROOT / "tests" / "_out" / "hf").resolve()
    os.environ.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    spy = py_spy()

    import nnsight

    from bench import models, workloads
    from tests.support.stacks.stack import Stack
    from tests.support.cases.tiny_model import client_model

    model_info = MODELS[args.model]
    models.build(model_info, hf_home)
    spec = workloads.Spec(gpt2=model_info.gpt2)
    model = client_model(model_info.repo_id)
    nnsight.CONFIG.APP.REMOTE_LOGGING = False
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.txt"):
        old.unlink()
    home = Path(tempfile.mkdtemp(prefix="ndif-bench-profile-"))
    stack = Stack(home, env={"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    spies: list[subprocess.Popen] = []
    try:
        stack.start()
        nnsight.CONFIG.API.HOST = stack.url
        for _ in range(args.warmup):
            workloads.small_trace(model, {"remote": True}, spec)
        # Every client model's first (slower) request before sampling starts: sent one after
        # another, each found the queue empty and was followed by the whole weight check.
        clients = [model] + [client_model(model_info.repo_id) for _ in range(args.clients - 1)]
        for extra in clients[1:]:
            workloads.small_trace(extra, {"remote": True}, spec)
        pids = stack.pids()
        groups = {
            "web": [p for p in measure.process_tree(pids["web"]) if p != pids["web"]] or [pids["web"]],
            "worker": measure.process_tree(pids["worker"]),
            "client": [os.getpid()],
        }
        files: dict[str, list[Path]] = {g: [] for g in groups}
        for group, procs in groups.items():
            for pid in procs:
                path = OUT / f"{group}-{pid}.txt"
                files[group].append(path)
                spies.append(subprocess.Popen(
                    [spy, "record", "--pid", str(pid), "--rate", str(args.rate), "--duration", str(int(args.seconds)),
                     "--format", "raw", "--nonblocking", "--output", str(path), *(["--gil"] if args.gil else [])],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                ))
        time.sleep(1.0)  # let py-spy attach
        latencies: list[float] = []
        deadline = time.monotonic() + args.seconds - 1.5

        def send(client) -> None:
            while time.monotonic() < deadline:
                started = time.perf_counter()
                workloads.small_trace(client, {"remote": True}, spec)
                latencies.append((time.perf_counter() - started) * 1000)

        threads = [threading.Thread(target=send, args=(c,), daemon=True) for c in clients]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for proc in spies:
            try:
                proc.wait(timeout=args.seconds + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
        print(f"profile of the small trace, commit {measure.git_commit()}, {args.clients} client thread(s): "
              f"{len(latencies)} requests, "
              f"p50 {measure.percentile(latencies, .5):.1f} ms, p95 {measure.percentile(latencies, .95):.1f} ms; "
              f"py-spy {args.rate} Hz, non-blocking, idle threads excluded"
              + (", GIL holders only" if args.gil else ""))
        for group, paths in files.items():
            samples, own, total = top(paths, args.top)
            print(f"\n== {group} ({len(paths)} process{'es' if len(paths) > 1 else ''}, {samples} busy samples "
                  f"= {samples / args.rate / max(len(latencies), 1) * 1000:.1f} ms CPU-ish per request)")
            print("   own time")
            for fraction, frame in own:
                print(f"   {fraction * 100:5.1f}%  {frame}")
            print("   total time")
            for fraction, frame in total:
                print(f"   {fraction * 100:5.1f}%  {frame}")
            print("   by component (a frame anywhere on the stack)")
            for fraction, marker in breakdown(paths, MARKERS.get(group, [])):
                print(f"   {fraction * 100:5.1f}%  {marker}")
        print(f"\nraw collapsed stacks: {OUT}")
    finally:
        for proc in spies:
            if proc.poll() is None:
                proc.kill()
        stack.discard()
        shutil.rmtree(home, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
