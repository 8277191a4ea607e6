"""Capacity: N waiting clients' ``/subscribe`` sockets held open against one web host.

    .venv/bin/python bench/capacity.py                     # N = 1,000 / 5,000 / 10,000
    .venv/bin/python bench/capacity.py --smoke             # N = 200 (CI's bench smoke)
    .venv/bin/python bench/capacity.py --sizes 300 --stack-env NDIF_WEB_WORKER_CLASS=gthread

A blocking nnsight client holds one ``/subscribe`` websocket for its job's whole
life, so a busy farm's web is mostly *waiting*. This starts a real stack with
the default settings (``tests.support.stacks.stack.Stack``: embedded Redis, gunicorn web, a
Celery worker) and, for each N, opens N websockets from one asyncio process
(raw streams doing the RFC 6455 handshake: a socket costs the client a few KiB,
so the client is not what is measured), and reports:

- **held**: sockets that got their session id and still answer a ping after
  everything else was measured;
- **handshake p50/p99**: TCP connect to session id, per socket, with at most
  ``--in-flight`` handshakes under way at once (a crowd arriving, not one
  synchronized burst of 10,000 SYNs, which only measures the listen backlog);
- **web RSS per waiting socket**: the RSS of every web process (gunicorn's
  master and workers, from /proc) while the N are held, minus the RSS before
  the first size was opened, over N (conservative: what earlier sizes left
  behind counts against the later ones);
- **Redis connections**: ``INFO clients`` ``connected_clients`` before and
  while held (the web shares one pub/sub connection per process, so this must
  not grow with N);
- **trace while held vs idle**: p50 of one ordinary remote trace by the real
  nnsight client (a new websocket, POST, inline result) with no sockets held,
  and the same while the N are held, measured side by side in one run.

Targets are printed as PASS/FAIL lines (a FAIL does not fail the run): N held
of N at the largest size; handshake p99 < 1 s; trace while held within +50 ms
of idle; < 64 KiB web memory per waiting socket; Redis connections
independent of N. ``--stack-env`` passes settings to the stack (compare
``NDIF_WEB_WORKER_CLASS=gthread``). The machine's load average is printed
with every table: these are timings on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import resource
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
OUT_DIR = ROOT / "bench" / "_out"
KiB = 1024

FULL_SIZES = (1000, 5000, 10000)
SMOKE_SIZES = (200,)


# -- the websocket client: a handshake, one text frame, pings -----------------

def _frame(opcode: int, payload: bytes = b"") -> bytes:
    """A masked client frame (RFC 6455 requires clients to mask)."""
    mask = os.urandom(4)
    head = bytes([0x80 | opcode])
    n = len(payload)
    head += bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big")
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    b0, b1 = await reader.readexactly(2)
    n = b1 & 0x7F
    if n == 126:
        n = int.from_bytes(await reader.readexactly(2), "big")
    elif n == 127:
        n = int.from_bytes(await reader.readexactly(8), "big")
    if b1 & 0x80:
        await reader.readexactly(4)  # servers do not mask; tolerate it anyway
    return b0 & 0x0F, await reader.readexactly(n)


class Held:
    __slots__ = ("reader", "writer", "handshake_s", "session_id", "error")

    def __init__(self):
        self.reader = self.writer = self.session_id = self.error = None
        self.handshake_s: Optional[float] = None


async def _open(host: str, port: int, gate: asyncio.Semaphore, timeout_s: float, headers: str) -> Held:
    held = Held()
    async with gate:
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                held.reader, held.writer = await asyncio.open_connection(host, port, limit=16 * KiB)
                key = base64.b64encode(os.urandom(16)).decode()
                held.writer.write((
                    f"GET /subscribe HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                    f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{headers}\r\n"
                ).encode())
                head = await held.reader.readuntil(b"\r\n\r\n")
                if b" 101 " not in head.split(b"\r\n", 1)[0]:
                    raise ConnectionError(head.split(b"\r\n", 1)[0].decode(errors="replace"))
                opcode, payload = await _read_frame(held.reader)
                held.session_id = json.loads(payload)["session_id"]
                held.handshake_s = time.perf_counter() - started
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError, KeyError) as error:
            held.error = f"{type(error).__name__}: {error}"[:200]
    return held


async def _alive(held: Held, gate: asyncio.Semaphore, timeout_s: float) -> bool:
    """Whether the server still answers a ping on this socket."""
    if held.session_id is None:
        return False
    async with gate:
        try:
            async with asyncio.timeout(timeout_s):
                held.writer.write(_frame(0x9, b"alive?"))
                while True:
                    opcode, payload = await _read_frame(held.reader)
                    if opcode == 0xA:
                        return True
                    if opcode == 0x8:
                        return False
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            return False


async def _close(held: Held) -> None:
    if held.writer is None:
        return
    try:
        held.writer.write(_frame(0x8, (1000).to_bytes(2, "big")))
        held.writer.close()
    except OSError:
        pass


# -- what the web and Redis hold ------------------------------------------------

def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def web_rss_bytes(master: int) -> int:
    """RSS of gunicorn's master and its workers."""
    total = 0
    for pid in [master, *_children(master)]:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * KiB
        except OSError:
            pass
    return total


def redis_clients(redis_url: str) -> int:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.info("clients")["connected_clients"]) - 1  # not this one
    finally:
        client.close()


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def raise_open_files_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _pct(values: list, q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# -- the run ---------------------------------------------------------------------

class Capacity:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.sizes = tuple(int(x) for x in args.sizes.split(",")) if args.sizes else (
            SMOKE_SIZES if args.smoke else FULL_SIZES)
        self.trace_reps = args.trace_reps or (5 if args.smoke else 15)
        self.out: dict = {"sizes": list(self.sizes), "smoke": bool(args.smoke), "stack_env": args.stack_env,
                          "results": [], "checks": []}

    def trace_ms(self) -> list[float]:
        """Wall times of one ordinary remote trace by the real client, each with a new websocket."""
        from tests.support.cases.tiny_model import PROMPT

        times = []
        for _ in range(self.trace_reps):
            started = time.perf_counter()
            try:
                with self.model.trace(PROMPT, remote=True):
                    hidden = self.model.transformer.h[-1].output.save()
            except Exception as error:  # noqa: BLE001 - a web with no thread left times out: recorded, not fatal
                self.emit(f"  trace failed after {time.perf_counter() - started:.1f} s: {type(error).__name__}: {error}"[:300])
                times.append(float("inf"))
                continue
            times.append((time.perf_counter() - started) * 1000)
            if not (hasattr(hidden, "shape") or isinstance(hidden, tuple)):
                raise RuntimeError(f"the trace returned {type(hidden)}")
        return times

    def run(self) -> dict:
        import nnsight
        import websocket

        from tests.support.stacks.stack import Stack
        from tests.support.cases.tiny_model import REPO_ID, build_tiny_gpt2, client_model

        fds = raise_open_files_limit()
        need = max(self.sizes) + 512
        if fds < need:
            raise SystemExit(f"this process may open {fds} files; {need} are needed (raise ulimit -Hn)")
        build_tiny_gpt2(Path(os.environ["HF_HOME"]), REPO_ID)
        env = {"HF_HOME": os.environ["HF_HOME"], "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        for item in self.args.stack_env:
            key, _, value = item.partition("=")
            env[key] = value
        home = Path(tempfile.mkdtemp(prefix="ndif-capacity-"))
        stack = Stack(home, env=env)
        stack.start()
        try:
            nnsight.CONFIG.API.HOST = stack.url
            nnsight.CONFIG.APP.REMOTE_LOGGING = False
            # A trace that finds no free web thread (gthread) fails after this, instead of hanging the run.
            websocket.setdefaulttimeout(self.args.trace_timeout_s)
            self.model = client_model(REPO_ID)
            self.trace_ms()  # deploys the model, warms every web process
            master = stack.pids()["web"]
            host, port = stack.url.split("//", 1)[1].rsplit(":", 1)
            self.out.update(host={"cpus": os.cpu_count()}, web_worker_class=env.get("NDIF_WEB_WORKER_CLASS", "gevent (default)"))
            base_rss = web_rss_bytes(master)
            base_redis = redis_clients(stack.redis_url)
            self.emit(f"capacity: sizes {list(self.sizes)}, {os.cpu_count()} CPUs, web {self.out['web_worker_class']}, "
                      f"web RSS idle {base_rss / 2**20:.0f} MiB, Redis clients idle {base_redis}, load {load_average()}")
            for n in self.sizes:
                self.out["results"].append(self.size(n, host, int(port), master, stack.redis_url, base_rss, base_redis))
        finally:
            stack.discard()
        self.out["checks"] = self.checks()
        self.emit("\n== targets (waiting clients)")
        for check in self.out["checks"]:
            self.emit(f"{check['verdict']:<4}  {check['name']}: {check['detail']}")
        return self.out

    def size(self, n: int, host: str, port: int, master: int, redis_url: str, base_rss: int, base_redis: int) -> dict:
        idle = self.trace_ms()
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        in_flight, timeout_s = self.args.in_flight, self.args.handshake_timeout_s

        async def open_all() -> list:
            gate = asyncio.Semaphore(in_flight)
            return await asyncio.gather(*(_open(host, port, gate, timeout_s, "") for _ in range(n)))

        async def alive_all() -> list:
            gate = asyncio.Semaphore(in_flight)
            return await asyncio.gather(*(_alive(s, gate, 30.0) for s in sockets))

        async def close_all() -> None:
            await asyncio.gather(*(_close(s) for s in sockets))
            await asyncio.sleep(0.5)

        started = time.perf_counter()
        sockets = loop.run_until_complete(open_all())
        opened_s = time.perf_counter() - started
        got = [s for s in sockets if s.session_id is not None]
        time.sleep(1.0)  # let the web settle before reading its memory
        held_rss = web_rss_bytes(master)
        held_redis = redis_clients(redis_url)
        busy = self.trace_ms()
        alive = sum(loop.run_until_complete(alive_all()))
        loop.run_until_complete(close_all())
        loop.close()
        shakes = [s.handshake_s * 1000 for s in got]
        errors: dict = {}
        for s in sockets:
            if s.error:
                errors[s.error.split(":")[0]] = errors.get(s.error.split(":")[0], 0) + 1
        result = {
            "n": n, "session_ids": len(got), "held": alive, "open_all_s": round(opened_s, 2),
            "handshake_p50_ms": _round(_pct(shakes, 0.5)), "handshake_p99_ms": _round(_pct(shakes, 0.99)),
            "web_rss_idle_bytes": base_rss, "web_rss_held_bytes": held_rss,
            "web_bytes_per_socket": round((held_rss - base_rss) / max(len(got), 1)),
            "redis_clients_idle": base_redis, "redis_clients_held": held_redis,
            "trace_idle_p50_ms": _round(statistics.median(idle)), "trace_held_p50_ms": _round(statistics.median(busy)),
            "errors": errors, "load": load_average(),
        }
        self.emit(
            f"\nN={n}: session ids {len(got)}/{n}, still held at the end {alive}/{n} (opened in {opened_s:.1f} s, "
            f"{self.args.in_flight} in flight)\n"
            f"  handshake p50 {result['handshake_p50_ms']} ms, p99 {result['handshake_p99_ms']} ms\n"
            f"  web RSS {base_rss / 2**20:.0f} -> {held_rss / 2**20:.0f} MiB: "
            f"{result['web_bytes_per_socket'] / KiB:.1f} KiB per waiting socket\n"
            f"  Redis clients {base_redis} idle, {held_redis} held\n"
            f"  trace p50 idle {result['trace_idle_p50_ms']} ms, held {result['trace_held_p50_ms']} ms "
            f"({self.trace_reps} each)\n"
            f"  errors {errors or 'none'}; load {result['load']}"
        )
        return result

    def checks(self) -> list[dict]:
        results = self.out["results"]
        checks = []

        def add(name: str, ok: Optional[bool], detail: str) -> None:
            checks.append({"name": name, "pass": ok, "verdict": "SKIP" if ok is None else ("PASS" if ok else "FAIL"),
                           "detail": detail})

        if not results:
            return checks
        big = results[-1]
        add(f"{big['n']}/{big['n']} held", big["held"] == big["n"] and big["session_ids"] == big["n"],
            f"{big['session_ids']} got a session id, {big['held']} still held at the end")
        worst = max((r["handshake_p99_ms"] or 1e9) for r in results)
        add("handshake p99 < 1 s", worst < 1000, ", ".join(f"N={r['n']}: {r['handshake_p99_ms']} ms" for r in results))
        add("trace while held within +50 ms of idle",
            all(r["trace_held_p50_ms"] <= r["trace_idle_p50_ms"] + 50 for r in results),
            ", ".join(f"N={r['n']}: {r['trace_idle_p50_ms']} -> {r['trace_held_p50_ms']} ms" for r in results))
        add("< 64 KiB web memory per waiting socket", all(r["web_bytes_per_socket"] < 64 * KiB for r in results),
            ", ".join(f"N={r['n']}: {r['web_bytes_per_socket'] / KiB:.1f} KiB" for r in results))
        held = [r["redis_clients_held"] for r in results]
        # Independent of N: the spread over sizes stays within a few (request pool churn), far below N.
        add("Redis connections independent of N", max(held) - min(held) <= 8 and max(held) - results[0]["redis_clients_idle"] <= 64,
            ", ".join(f"N={r['n']}: {r['redis_clients_held']}" for r in results) + f" (idle {results[0]['redis_clients_idle']})")
        return checks

    def emit(self, text: str) -> None:
        print(text, flush=True)


def _round(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 1)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="ndif-celery capacity bench: N waiting /subscribe sockets")
    parser.add_argument("--smoke", action="store_true", help=f"N = {SMOKE_SIZES[0]} only")
    parser.add_argument("--sizes", help="comma-separated N (default 1000,5000,10000)")
    parser.add_argument("--in-flight", type=int, default=100, help="handshakes under way at once")
    parser.add_argument("--handshake-timeout-s", type=float, default=10.0)
    parser.add_argument("--trace-reps", type=int, help="traces idle and held, per size (default 15; 5 with --smoke)")
    parser.add_argument("--trace-timeout-s", type=float, default=30.0, help="a trace's websocket timeout")
    parser.add_argument("--stack-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--hf-home", help="offline HF cache (default $HF_HOME, else tests/_out/hf)")
    parser.add_argument("--out", help="JSON path (default bench/_out/capacity.json, capacity-smoke.json with --smoke)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")  # so the stack is stopped on the way out

    signal.signal(signal.SIGTERM, stop)
    hf_home = Path(args.hf_home or os.environ.get("HF_HOME") or ROOT / "tests" / "_out" / "hf").resolve()
    os.environ["HF_HOME"] = str(hf_home)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    sys.path.insert(0, str(ROOT / "tests"))
    out = Capacity(args).run()
    path = Path(args.out) if args.out else OUT_DIR / ("capacity-smoke.json" if args.smoke else "capacity.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
