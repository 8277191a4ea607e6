"""What one table column is made of: its samples (``Column``), the remote
client's ``meta`` per call, and the null server (the protocol floor).

These are the pieces every section measures with, whatever it measures; apart
from the sections so that a section module reads as what it runs, not as how a
sample is taken. nnsight and httpx are imported inside the functions:
``bench/run.py`` sets ``HF_HOME`` and the offline flags before anything
imports transformers (they read them once).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from bench import measure  # no torch at import
from bench.plan import ROOT

# -- the remote client's meta, per thread ----------------------------------------

_last = threading.local()


def hook_meta() -> None:
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
    """The ``meta`` of this thread's last remote call ({} if it had none)."""
    return getattr(_last, "meta", None) or {}


def forget_meta() -> None:
    """Before a call: a call that fails before the client has a meta must not report the previous one's."""
    _last.meta = None


# -- the null server ---------------------------------------------------------------


class NullServer:
    """``bench/null_server.py`` in a process of its own, and the answer it gives every job."""

    def __init__(self) -> None:
        from tests.support.stacks.servers import free_port

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


# -- a request's timeline -----------------------------------------------------------

#: A remote request's hops, in order: the client's clock at both ends, the
#: web's and the worker's in between (``meta["timeline"]``, from workers.job.life).
TIMELINE = ("client_to_web", "web", "broker", "start", "deserialize", "forward", "encode", "handover",
            "relay_and_client")


def timeline(meta: dict) -> dict:
    """A remote call's hops in ms (empty when its meta has no timeline).
    ``client_to_web``: the client's serialization and upload until the web
    has the request; ``relay_and_client``: from the worker sending the result
    to the call's return (the web's relay, the transfer, the client's decoding)."""
    server = meta.get("timeline") if isinstance(meta, dict) else None
    client = meta.get("client_at") if isinstance(meta, dict) else None
    if not isinstance(server, dict) or not client or "sent_at" not in server:
        return {}
    hops = {"client_to_web": (server["received_at"] - client[0]) * 1000}
    for hop in TIMELINE[1:-1]:
        if isinstance(server.get(f"{hop}_ms"), (int, float)):
            hops[hop] = float(server[f"{hop}_ms"])
    hops["relay_and_client"] = (client[1] - server["sent_at"]) * 1000
    return hops


# -- a column ----------------------------------------------------------------------


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
    timeline: dict = field(default_factory=dict)  # hop -> samples (ms), see TIMELINE

    def record_meta(self, meta: dict) -> None:
        self.meta = meta or self.meta
        for key in ("queue_ms", "deserialize_ms", "run_ms", "isolated_ms", "upload_ms"):
            if isinstance(meta.get(key), (int, float)):
                self.server.setdefault(key, []).append(float(meta[key]))
        for hop, ms in timeline(meta).items():
            self.timeline.setdefault(hop, []).append(ms)

    def absorb(self, other: "Column") -> None:
        """Add ``other``'s samples, checks, errors and server timings to this
        column (the client threads of one cell, or the rounds of one column)."""
        self.samples += other.samples
        self.checked += other.checked
        self.wrong += other.wrong
        self.first_wrong = self.first_wrong or other.first_wrong
        self.errors += other.errors
        for key, samples in other.server.items():
            self.server.setdefault(key, []).extend(samples)
        for hop, samples in other.timeline.items():
            self.timeline.setdefault(hop, []).extend(samples)

    def summary(self, check: bool = True) -> dict:
        out = measure.stats(self.samples)
        out["server_p50_ms"] = {k: round(measure.percentile(v, 0.5), 3) for k, v in self.server.items() if v}
        if self.timeline:
            out["timeline_mean_ms"] = {hop: round(sum(v) / len(v), 2) for hop, v in self.timeline.items() if v}
        out["correct"] = (self.wrong == 0 and self.checked > 0) if check else None
        out["checked"] = self.checked
        if self.first_wrong:
            out["first_difference"] = self.first_wrong
        if self.errors:
            out["errors"] = self.errors[:5]
        return out


#: The nice value of the client threads (``run_clients``; ``bench/run.py --client-nice``).
#: On a farm the clients run on the researchers' own machines; here they share
#: the server's two cores, and 16 of them took ~100 ms of CPU per request (half
#: of it the nnsight client's SSL context, built for every request), which the
#: local back-to-back column never pays: measured (py-spy), the worker's forward
#: ran 5-25 % slower while they did. At nice 10 they take the CPU the server
#: leaves instead of time-slicing its forward; 0 measures them as equals.
CLIENT_NICE = 10


def run_clients(client, count: int, barrier: threading.Barrier, nice: int = CLIENT_NICE) -> float:
    """Start ``count`` client threads (``client(i)``) at ``nice`` (:data:`CLIENT_NICE`),
    which wait at ``barrier`` (of ``count + 1``) to start together; the wall time
    from their release to the last one done."""

    def niced(i: int) -> None:
        if nice and sys.platform.startswith("linux"):  # a thread id is a task there; elsewhere it may be a pid
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)  # this thread only
        client(i)

    # Here, not at the top: tests.support.clients.load imports torch, and this module must not (see above).
    from tests.support.clients.load import compile_one_at_a_time  # (CPython 3.11's parser and client threads)

    threads = [threading.Thread(target=niced, args=(i,), daemon=True) for i in range(count)]
    with compile_one_at_a_time():
        for thread in threads:
            thread.start()
        barrier.wait()
        started = time.perf_counter()
        for thread in threads:
            thread.join()
    return time.perf_counter() - started
