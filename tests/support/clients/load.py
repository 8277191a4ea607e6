"""Many real clients at once, each with its own prompt, every answer checked.

``run_load(model, clients, requests_each)`` starts ``clients`` threads; each
runs ``requests_each`` blocking remote traces of the nnsight client with a
prompt of its own and compares every saved value with the same block run
locally (``torch.equal``). A lost job, a duplicated answer or one that went to
the wrong client is counted, never retried.

Exact, except where the answer says (``meta["cobatch"]``) that the request
shared a forward with prompts of other lengths: left padding changes the
arithmetic within :data:`COBATCH_TOLERANCE` (the bound tests/inprocess/workers/cobatch/test_engine.py
states), so such an answer counts as right within it and is listed in
``close``; another client's answer is off by far more. Used by the suite's short load test
and by ``bench/load.py``.
"""

from __future__ import annotations

import builtins
import contextlib
import threading
import time
from dataclasses import dataclass, field

import torch

#: How far a co-batched answer may be from the solo one: the engine's stated tolerance, measured in
#: tests/inprocess/workers/cobatch/test_engine.py (TOLERANCE there) and equal to bench/plan.py's (tests/e2e/bench/test_bench_smoke.py).
COBATCH_TOLERANCE = 1e-5


def prompt_of(client: int, request: int) -> str:
    """Every request has its own prompt, so a mixed-up answer cannot pass."""
    return f"client {client} asks question {request} about the city of"


def block(model, prompt: str, remote: bool):
    """The block every client runs: the last layer's hidden state and the logits."""
    with model.trace(prompt, remote=remote):
        hidden = model.transformer.h[-1].output.save()
        logits = model.lm_head.output.save()
    return hidden, logits


@dataclass
class LoadReport:
    clients: int
    requests_each: int
    latencies_s: list = field(default_factory=list)
    wrong: list = field(default_factory=list)  # (client, request, why)
    close: list = field(default_factory=list)  # (client, request, batch size): co-batched, within the tolerance
    failed: list = field(default_factory=list)  # (client, request, error)
    job_ids: list = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def expected(self) -> int:
        return self.clients * self.requests_each

    @property
    def duplicated(self) -> int:
        return len(self.job_ids) - len(set(self.job_ids))

    def percentile_ms(self, q: float) -> float:
        values = sorted(self.latencies_s)
        return 1000 * values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    def summary(self) -> str:
        return (
            f"{self.clients} clients x {self.requests_each} requests: {len(self.latencies_s)} correct "
            f"({len(self.close)} co-batched within {COBATCH_TOLERANCE:g}), "
            f"{len(self.wrong)} wrong, {len(self.failed)} failed, {self.duplicated} duplicated job ids; "
            f"p50 {self.percentile_ms(0.50):.0f} ms, p95 {self.percentile_ms(0.95):.0f} ms, "
            f"p99 {self.percentile_ms(0.99):.0f} ms; {self.expected / self.wall_s:.1f} requests/s"
        )


def expected_results(model, clients: int, requests_each: int) -> dict:
    """The local answer to every request, computed before the load starts."""
    return {
        (c, r): block(model, prompt_of(c, r), remote=False)
        for c in range(clients) for r in range(requests_each)
    }


@contextlib.contextmanager
def compile_one_at_a_time():
    """``compile`` (and so ``ast.parse``, which the client calls on every
    trace's source) behind a lock in this process while it lasts.

    Why: CPython 3.11 keeps the AST converter's recursion depth in
    interpreter-wide state, so two client threads parsing at once can fail
    with "SystemError: AST constructor recursion depth mismatch" (once in 100
    requests of 50 threads, in CI), before the request is even sent. A
    bug of the client's interpreter, not of the server; the lock spans a few
    milliseconds of each trace, and the requests still overlap on the wire."""
    original, lock = builtins.compile, threading.Lock()

    def locked(*args, **kwargs):
        with lock:
            return original(*args, **kwargs)

    builtins.compile = locked
    try:
        yield
    finally:
        builtins.compile = original


def run_load(model, clients: int, requests_each: int, expected: dict | None = None) -> LoadReport:
    expected = expected or expected_results(model, clients, requests_each)
    report = LoadReport(clients, requests_each)
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def client(c: int) -> None:
        start.wait()
        for r in range(requests_each):
            began = time.perf_counter()
            try:
                with model.trace(prompt_of(c, r), remote=True) as tracer:
                    hidden = model.transformer.h[-1].output.save()
                    logits = model.lm_head.output.save()
            except Exception as error:  # noqa: BLE001 - counted, the run goes on
                with lock:
                    report.failed.append((c, r, f"{type(error).__name__}: {error}"))
                continue
            elapsed = time.perf_counter() - began
            want_hidden, want_logits = expected[(c, r)]
            meta = tracer.backend.meta or {}
            exact = torch.equal(hidden, want_hidden) and torch.equal(logits, want_logits)
            close = meta.get("cobatch", 1) > 1 and all(
                torch.allclose(got, want, rtol=0, atol=COBATCH_TOLERANCE)
                for got, want in ((hidden, want_hidden), (logits, want_logits)))
            with lock:
                report.job_ids.append(meta.get("job_id"))
                if exact or close:
                    report.latencies_s.append(elapsed)
                    if not exact:
                        report.close.append((c, r, meta["cobatch"]))
                else:
                    report.wrong.append((c, r, f"result differs from the local run (meta {meta})"))

    threads = [threading.Thread(target=client, args=(c,), name=f"client-{c}") for c in range(clients)]
    began = time.perf_counter()
    with compile_one_at_a_time():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    report.wall_s = time.perf_counter() - began
    return report
