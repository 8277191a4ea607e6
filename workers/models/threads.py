"""How many intra-op threads a model's forward gets, chosen when it loads.

Why: torch's default is every core. A small model's operations are too small
to split, so its forward is no faster on more threads, and the threads left
waiting spin (OpenMP's busy wait) on every core meanwhile. On the tiny test
GPT-2, two threads made the forward slower and tripled its CPU. A big
model's forward is faster on more threads.

So ``NDIF_TORCH_THREADS=0`` (the default) times a short forward of the
loaded model on one thread and on every core, and keeps one thread unless
every core is clearly faster (``FASTER``). A first forward slower than
``LONGEST_S`` is compute-bound: it keeps every core without timing more.
A model whose forward cannot be sampled (no token input) keeps every core.
A number other than 0 is used as it is, for every model.

Thread counts can change the last bits of a result (summation order), as
different machines do: a local run with other threads is equal within
tolerance, not always to the bit (docs/performance.md).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

log = logging.getLogger(__name__)

#: Every core is kept when it takes at most this share of one thread's time.
FASTER = 0.8
#: A first forward slower than this (seconds) keeps every core, unmeasured.
LONGEST_S = 2.0
#: The sample forward's prompt: one row of this many tokens.
SAMPLE_TOKENS = 16
#: Timed forwards per thread count (the fastest counts).
TIMINGS = 3


def choose(module: torch.nn.Module, most: int) -> tuple[int, str]:
    """``(threads, why)`` for ``module``'s forward: 1 or ``most``."""
    if most <= 1:
        return 1, "one core"
    sample = _sample(module)
    if sample is None:
        return most, "no token input to time"
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(most)
        first = _time(module, sample)
        if first is None:
            return most, "the sample forward failed"
        if first > LONGEST_S:
            return most, f"a forward takes {first:.1f} s"
        times = {}
        for _ in range(TIMINGS):  # alternating, so a busy moment weighs on both
            for threads in (1, most):
                torch.set_num_threads(threads)
                seconds = _time(module, sample)
                if seconds is None:
                    return most, "the sample forward failed"
                times[threads] = min(times.get(threads, seconds), seconds)
    finally:
        torch.set_num_threads(previous)
    return decide(times[1], times[most], most)


def decide(one: float, every: float, most: int) -> tuple[int, str]:
    """``(threads, why)`` from the fastest forward on one thread and on ``most``."""
    why = f"forward {one * 1000:.1f} ms on 1 thread, {every * 1000:.1f} ms on {most}"
    return (most if every <= FASTER * one else 1), why


def _sample(module: torch.nn.Module) -> Any:
    """A prompt of token ids on the model's first device, or None."""
    config = getattr(module, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 2:
        return None
    try:
        device = next(module.parameters()).device
    except StopIteration:
        return None
    if device.type == "meta":
        return None
    return torch.arange(SAMPLE_TOKENS, device=device).remainder(vocab).unsqueeze(0)


def _time(module: torch.nn.Module, ids: torch.Tensor) -> "float | None":
    started = time.perf_counter()
    try:
        with torch.no_grad():
            module(input_ids=ids, attention_mask=torch.ones_like(ids))
        if ids.device.type == "cuda":
            torch.cuda.synchronize(ids.device)
    except Exception:  # noqa: BLE001 - a model that cannot take the sample keeps the default
        log.debug("sample forward failed", exc_info=True)
        return None
    return time.perf_counter() - started


class Threads:
    """A worker's thread counts: ``setting`` (``NDIF_TORCH_THREADS``) and the
    count in force, changed only when a job's model needs another."""

    def __init__(self, setting: int) -> None:
        self.setting = setting
        self.current = 0  # unknown until first set: torch's own default
        self.most = 0  # torch's default, read before any job changes it

    def for_model(self, module: torch.nn.Module) -> tuple[int, str]:
        """A freshly loaded model's count: the setting, or measured against
        torch's default (every core)."""
        if self.setting > 0:
            return self.setting, "NDIF_TORCH_THREADS"
        self.most = self.most or torch.get_num_threads()
        return choose(module, self.most)

    def use(self, threads: int) -> None:
        if threads and threads != self.current:
            torch.set_num_threads(threads)
            self.current = threads
