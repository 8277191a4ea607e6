"""What the co-batching engine's in-process tests share: prompts of three
lengths, a block that saves the logits, the request the real client would
POST for a block, and the worst difference between two runs' saved values."""

from __future__ import annotations

import os

import torch

from tests.support.clients.remote import recorded_request
from workers.cobatch import Request

SHORT = "Hello world"
MID = "The Eiffel Tower is in the city of"
LONG = "Madison Square Garden is located in the city of"


def logits(model, prompt):
    with model.trace(prompt, remote=True):
        out = model.lm_head.output.save()


def capture(fn, client, *args, **kwargs) -> Request:
    """What the real client POSTs for this block, as the worker's Request."""
    envelope, blob = recorded_request(fn, client, *args, **kwargs)
    return Request(f"{fn.__name__}-{len(blob)}", blob, envelope.compress, envelope.env or {})


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
                if os.environ.get("COBATCH_MEASURE"):
                    print(f"MEASURE {key} {tuple(x.shape)} {worst:.3e}")
        else:
            assert x == y, key
    return worst
