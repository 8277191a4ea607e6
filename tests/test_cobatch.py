"""Co-batching (``workers.cobatch``, issue #15): shared forwards give each user what alone gives.

In-process, no stack. Every request is a real payload: the real nnsight client
(``tiny_model.client_model``, the meta model users hold) runs a
``with model.trace(..., remote=True)`` block and ``RemoteBackend.request`` is
swapped for a recorder of exactly what it would POST (the envelope's
``compress`` and ``env``, and ``RemoteBackend._serialize``'s blob). The server
side is the tiny GPT-2 as a worker loads it. Each scenario runs its requests
alone (``run_alone``: today's trusted path) and together (``run_batch``), and
compares the results.

Measured tolerance (this CPU, torch 2.13, the 12-layer tiny GPT-2, fp32):
requests of one token length merged are bit-identical to alone
(``torch.equal``); merging different lengths (left padding, the sequence
window, the width padded off the model's dimensions) differed by at most
~5e-7 on hidden states and logits here; the tests allow ``TOLERANCE`` = 1e-5
(absolute, on values of order 1).
"""

from __future__ import annotations

import pytest
import torch

import nnsight
from nnsight.intervention.backends.remote import RemoteBackend
from nnsight.schema.request import RequestModel

from tiny_model import REPO_ID, worker_loaded
from workers.cobatch import Request, run_alone, run_batch

TOLERANCE = 1e-5

# Token lengths on the tiny tokenizer differ between these (checked in `payloads`).
SHORT = "Hello world"
MID = "The Eiffel Tower is in the city of"
LONG = "Madison Square Garden is located in the city of"
SAME_A = "The quick brown fox jumps over the lazy dog"
SAME_B = "The lazy dog jumps over the quick brown fox"


# --- the users' blocks (client side), each a trace of its own kind ------------------


def read(model, prompt):
    with model.trace(prompt, remote=True):
        hidden = model.transformer.h[2].output.save()


def logits(model, prompt):
    with model.trace(prompt, remote=True):
        out = model.lm_head.output.save()


def edit_everything(model, prompt):
    # Zeroes every layer's output it can reach, then reads the logits.
    with model.trace(prompt, remote=True):
        for layer in model.transformer.h:
            layer.output[0][:] = 0
        out = model.lm_head.output.save()


def two_invokes(model, prompt_a, prompt_b):
    with model.trace(remote=True) as tracer:
        with tracer.invoke(prompt_a):
            model.transformer.h[0].mlp.output[:] = 0
            a = model.transformer.h[2].output.save()
        with tracer.invoke(prompt_b):
            b = model.lm_head.output.save()
        with tracer.invoke():
            both = model.transformer.h[1].output.save()


def prints(model, prompt):
    with model.trace(prompt, remote=True):
        hidden = model.transformer.h[1].output
        print("mine", prompt, tuple(hidden.shape))
        norm = hidden.norm().save()


def error(model, prompt):
    with model.trace(prompt, remote=True):
        bad = model.transformer.h[1].output[:, 999].save()


def stops(model, prompt):
    with model.trace(prompt, remote=True) as tracer:
        early = model.transformer.h[1].output.save()
        tracer.stop()


def skips(model, prompt):
    with model.trace(prompt, remote=True):
        model.transformer.h[1].skip(model.transformer.h[0].output)
        after = model.transformer.h[2].output.save()


def backward(model, prompt):
    with model.trace(prompt, remote=True):
        hidden = model.transformer.h[1].output[0]
        hidden.requires_grad_(True)
        with model.lm_head.output[:, -1].sum().backward():
            grad = hidden.grad.save()


def generate(model, prompt, n=3, **kwargs):
    with model.generate(prompt, max_new_tokens=n, remote=True, **kwargs) as tracer:
        steps = nnsight.save(list())
        for step in tracer.iter[:n]:
            steps.append(model.transformer.h[2].output[0][:, -1])
        ids = tracer.result.save()


def source_op(model, prompt):
    with model.trace(prompt, remote=True):
        attn = model.transformer.h[0].attn.source.attention_interface_0.output[0].save()


def cached(model, prompt):
    with model.trace(prompt, remote=True) as tracer:
        cache = tracer.cache(modules=[model.transformer.h[0], model.transformer.h[3]])


def kv(model, prompt):
    with model.trace(prompt, remote=True):
        kv = model.output.past_key_values.save()


def shared_positions(model, prompt):
    # GPT-2's position_ids are [1, S] without padding: one value for every row.
    with model.trace(prompt, remote=True):
        model.transformer.wpe.input = model.transformer.wpe.input + 1
        out = model.lm_head.output.save()


def weight_write(model, prompt):
    with model.trace(prompt, remote=True):
        hidden = model.transformer.h[0].output
        model.transformer.h[2].mlp.c_fc.weight.data[:] = 0
        out = model.lm_head.output.save()


def session(model, prompt_a, prompt_b):
    with model.session(remote=True):
        with model.trace(prompt_a):
            h = model.transformer.h[1].output[0][:, -1]
        with model.trace(prompt_b):
            model.transformer.h[1].output[0][:, -1] = h
            out = model.lm_head.output.save()


# --- capture and run -----------------------------------------------------------------


def capture(fn, client, *args, **kwargs) -> Request:
    """What the real client POSTs for this block, as the worker's Request."""
    sent = []

    def record(self, request, tracer):
        sent.append((request.metadata(), self._serialize(tracer)))
        return {}

    original = RemoteBackend.request
    RemoteBackend.request = record
    try:
        fn(client, *args, **kwargs)
    finally:
        RemoteBackend.request = original
    (metadata, blob), = sent
    envelope = RequestModel.model_validate_json(metadata)
    return Request(f"{fn.__name__}-{len(blob)}", blob, envelope.compress, envelope.env or {})


@pytest.fixture(scope="module")
def client():
    from tiny_model import client_model

    return client_model(REPO_ID)


@pytest.fixture(scope="module")
def server():
    _, model = worker_loaded(REPO_ID)
    pristine = {k: v.clone() for k, v in model._module.state_dict().items()}

    def restore():
        model._module.load_state_dict(pristine)
        return model

    return model, restore


@pytest.fixture(scope="module")
def lengths(client):
    return {p: len(client.tokenizer(p)["input_ids"]) for p in (SHORT, MID, LONG, SAME_A, SAME_B)}


def test_prompts_have_the_lengths_the_scenarios_need(lengths):
    assert len({lengths[SHORT], lengths[MID], lengths[LONG]}) == 3
    assert lengths[SAME_A] == lengths[SAME_B]


def alone(server, requests):
    model, restore = server
    out = []
    for request in requests:
        out.append(run_alone(model, request, "reference"))
        restore()
    return out


def together(server, requests, **kwargs):
    model, restore = server
    outcomes = run_batch(model, requests, restore=restore, **kwargs)
    restore()
    return outcomes


def leaves(value, path="v"):
    """(path, tensor-or-plain) pairs of a saved value, caches included."""
    from nnsight.intervention.cache import CacheView

    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, CacheView):
        for key in value.keys():
            yield from leaves(value[key].output, f"{path}[{key}]")
    elif isinstance(value, dict):
        for key in value:
            yield from leaves(value[key], f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        yield f"{path}#len", len(value)
        for i, item in enumerate(value):
            yield from leaves(item, f"{path}[{i}]")
    elif type(value).__name__.endswith("Cache") and hasattr(value, "layers"):
        for i, layer in enumerate(value.layers):
            yield from leaves(layer.keys, f"{path}.layers[{i}].keys")
            yield from leaves(layer.values, f"{path}.layers[{i}].values")
    else:
        yield path, value


def worst_difference(a: dict, b: dict) -> float:
    """Max |a - b| over every saved tensor; asserts same names, shapes, structure."""
    assert set(a) == set(b)
    la, lb = dict(leaves(a)), dict(leaves(b))
    assert set(la) == set(lb)
    worst = 0.0
    for key, x in la.items():
        y = lb[key]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype, key
            if x.numel():
                worst = max(worst, (x.double() - y.double()).abs().max().item())
        else:
            assert x == y, key
    return worst


def assert_bit_identical(a: dict, b: dict):
    assert worst_difference(a, b) == 0.0
    for key, x in dict(leaves(a)).items():
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, dict(leaves(b))[key]), key


# --- the scenarios ---------------------------------------------------------------------


def test_equal_lengths_share_one_forward_and_are_bit_identical(client, server):
    requests = [capture(read, client, SAME_A), capture(logits, client, SAME_B), capture(read, client, SAME_B)]
    solo = alone(server, requests)
    merged = together(server, requests)
    for s, m in zip(solo, merged):
        assert m.ok and m.meta == {"cobatch": 3}
        assert_bit_identical(s.saved, m.saved)
