"""The blocks the bench runs, each as ``fn(model, remote, spec) -> {name: value}``.

The same function runs locally (``remote={}``) and through a server
(``remote={"remote": True}``), exactly as a researcher would write it, so the
values the client gets back can be compared with ``torch.equal`` against the
local run. ``spec`` (a :class:`Spec`) says which model family it is (where
the transformer blocks live) and the sizes to use (smoke or full).

nnsight ships each block's source to the server; keep every block here
self-contained (``torch``, ``nnsight`` and the locals of its function only).
"""

from __future__ import annotations

from dataclasses import dataclass

import nnsight
import torch

from tests.support.cases.tiny_model import PROMPT
from tests.support.cases.tiny_model import PROMPTS as TEST_PROMPTS

PROMPTS = [*TEST_PROMPTS, "It was the best of times, it was the worst of times."]

MiB = 1024 * 1024


@dataclass(frozen=True)
class Spec:
    """What a block needs to know about the model and the run."""

    gpt2: bool = True  # blocks under model.transformer.h; else model.model.layers (Llama)
    gen_tokens: int = 20
    session_traces: int = 5
    big_bytes: int = 256 * MiB  # the big result: a float32 tensor of this many bytes


def blocks(model, spec: Spec):
    """The transformer blocks' envoy list (a client-side envoy, shipped by reference)."""
    return model.transformer.h if spec.gpt2 else model.model.layers


def small_trace(model, remote: dict, spec: Spec) -> dict:
    """One forward pass, one hidden state saved."""
    layers = blocks(model, spec)
    with model.trace(PROMPT, **remote):
        hidden = layers[-1].output.save()
    return {"hidden": hidden}


def every_layer(model, remote: dict, spec: Spec) -> dict:
    """One forward pass, every block's output saved."""
    layers = blocks(model, spec)
    with model.trace(PROMPT, **remote):
        hiddens = nnsight.save([])
        for layer in layers:
            hiddens.append(layer.output)
    return {"hiddens": hiddens}


def generate(model, remote: dict, spec: Spec) -> dict:
    """Greedy generation of ``spec.gen_tokens`` tokens, saving every step's last
    hidden state and logits, and the generated ids."""
    layers = blocks(model, spec)
    n = spec.gen_tokens
    with model.generate(PROMPT, max_new_tokens=n, min_new_tokens=n, do_sample=False, **remote) as tracer:
        hiddens = nnsight.save([])
        logits = nnsight.save([])
        for step in tracer.iter[:n]:
            hiddens.append(layers[-1].output[:, -1])
            logits.append(model.lm_head.output[:, -1])
        ids = tracer.result.save()
    return {"hiddens": hiddens, "logits": logits, "ids": ids}


def session(model, remote: dict, spec: Spec) -> dict:
    """One session of ``spec.session_traces`` traces (one request), each saving
    its last hidden state; the second onwards patches in the previous one's
    last position."""
    layers = blocks(model, spec)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(spec.session_traces)]
    with model.session(**remote):
        hiddens = nnsight.save([])
        for prompt in prompts:
            with model.trace(prompt):
                hiddens.append(layers[-1].output[:, -1].clone())
    return {"hiddens": hiddens}


def big_result(model, remote: dict, spec: Spec) -> dict:
    """A result of ``spec.big_bytes`` bytes: a float32 tensor made inside the
    block, as incompressible as real activations (random normals; 4 MiB drawn
    once and repeated, which zstd's window at level 3 cannot see across), plus
    the hidden state it was made next to."""
    layers = blocks(model, spec)
    numel = spec.big_bytes // 4
    chunk = min(numel, MiB)
    with model.trace(PROMPT, **remote):
        generator = torch.Generator().manual_seed(1234)
        big = nnsight.save(torch.randn(chunk, generator=generator).repeat(numel // chunk))
        hidden = layers[-1].output.save()
    return {"big": big, "hidden": hidden}


def make_big(numel: int) -> torch.Tensor:
    """The same tensor ``big_result`` makes, for the serialization floor."""
    chunk = min(numel, MiB)
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(chunk, generator=generator).repeat(numel // chunk)


WORKLOADS = {
    "small_trace": small_trace,
    "every_layer": every_layer,
    "generate": generate,
    "session": session,
    "big_result": big_result,
}
