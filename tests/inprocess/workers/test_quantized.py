"""A quantized model's bitsandbytes layers (``workers/quantized.py``) on the tiny model,
loaded at nf4 and int8 as a worker loads them (bitsandbytes runs both on this CPU).

Settled, a model takes requests without changing: no weight moves, nothing
for the baseline to put back, the same values request after request. Shared
with a skeleton as the zygote builds one, it computes the worker's values.
The whole path through real jailed children is tests/e2e/farm/test_quantized.py.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from tests.support.cases.tiny_model import PROMPT, client_model
from workers import baseline, quantized
from workers.models import integrity

HELD = ("nf4", "int8")


def loaded(name: str):
    """``(key, model)``: the tiny model's quantized deployment as a worker loads it."""
    from nnsight.modeling.mixins.remotable import Remotable

    key = client_model().to_model_key()[:-1] + f', "dtype": "{name}"}}'
    model = Remotable.from_model_key(key, dispatch=True)
    model._module.requires_grad_(False)
    return key, model


def request(model):
    """A request as researchers send them: an edit, a read, a gradient, a generation."""
    with model.trace(PROMPT):
        model.transformer.h[0].output[:, -1] = 0
        hidden = model.transformer.h[1].output
        hidden.requires_grad_(True)
        logits = model.output.logits.save()
        with logits.sum().backward():
            grad = hidden.grad.save()
    with model.generate(PROMPT, max_new_tokens=3, do_sample=False) as tracer:
        tokens = tracer.result.save()
    return logits, grad, tokens


@pytest.mark.parametrize("name", HELD)
def test_a_settled_model_takes_requests_without_changing(name):
    _, model = loaded(name)
    assert quantized.is_quantized(model._module) and quantized.settle(model._module) == 48
    stamps, whole = integrity.Stamps(model._module), integrity.PlainFingerprint(model._module)
    kept = baseline.take(model)
    first = request(model)
    assert stamps.changed(model._module) == "" and whole.changed(model._module) == []
    kept.restore()
    second = request(model)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("name", HELD)
def test_unsettled_bitsandbytes_changes_its_layers_on_a_forward(name):
    """Why settle exists: what a request would otherwise leave, or break."""
    _, model = loaded(name)
    if name == "int8":  # the first forward moves the int8 weights into each layer's state...
        kept = baseline.take(model)
        first = request(model)
        assert any(".state: CB" in where for where in kept.restore())
        # ...and once that is put back for the next user, the next request computes something else.
        assert not all(torch.equal(a, b) for a, b in zip(request(model), first))
        return
    layer = model._module.transformer.h[0].mlp.c_fc
    if not getattr(layer, "support_avx512bf16_for_cpu", False):
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes does not repack here")
    with model.generate(PROMPT, max_new_tokens=1):  # a forward without gradients repacks in place
        pass
    with pytest.raises(Exception):
        request(model)  # and then no gradient flows through the layer


@pytest.mark.parametrize("name", HELD)
def test_a_skeleton_rebuilt_over_the_shared_weights_computes_the_workers_values(name):
    from nnsight.modeling.mixins.remotable import Remotable

    from workers.isolation import shared_weights

    key, model = loaded(name)
    quantized.settle(model._module)
    before = request(model)
    shared = shared_weights.share(model._module)
    assert shared.quantized and {spec["class"] for spec in shared.quantized} == {
        "nf4": {"Linear4bit"}, "int8": {"Linear8bitLt"}}[name]
    assert all(torch.equal(a, b) for a, b in zip(request(model), before)), "sharing changed the worker's values"

    # What the zygote does (workers.isolation.zygote._build): a skeleton on meta, then the shared weights.
    kwargs = pickle.loads(pickle.dumps({"tokenizer": model.tokenizer, "config": model._module.config,
                                        "dtype": name}))
    skeleton = Remotable.from_model_key(key, dispatch=False, **kwargs)
    header = pickle.loads(pickle.dumps(shared.header()))  # plain data only, as it travels
    shared_weights.attach(skeleton._module, header, shared.cpu_fd, "cpu")
    skeleton._update(skeleton._module)
    skeleton.dispatched = True
    skeleton._module.eval()
    assert not [n for n, t in integrity.named_tensors(skeleton._module) if t.device.type == "meta"]
    assert all(torch.equal(a, b) for a, b in zip(request(skeleton), before))
    os.close(shared.cpu_fd)


def test_a_model_without_bitsandbytes_layers_has_nothing_to_settle_or_share(resident_model):
    _, model = resident_model
    assert not quantized.is_quantized(model._module)
    assert quantized.settle(model._module) == 0
    assert quantized.describe(model._module) == [] and list(quantized.extra_tensors(model._module)) == []


@pytest.fixture(scope="module")
def resident_model():
    from tests.support.cases.tiny_model import worker_loaded

    return worker_loaded()


@pytest.mark.parametrize("name", HELD)
def test_requests_on_a_quantized_model_never_share_a_forward(name):
    """LLM.int8() picks outlier columns from the whole batch, and the 4-bit
    kernels differ for one row and many: each request runs alone, as alone."""
    from tests.support.cases.cobatch_cases import capture
    from workers.cobatch import run_alone, run_batch

    _, model = loaded(name)
    quantized.settle(model._module)
    client = client_model(dtype=name)

    def read(model, prompt):
        with model.trace(prompt, remote=True):  # recorded, not sent (cobatch_cases.capture)
            hidden = model.transformer.h[3].output.save()  # noqa: F841 - the saved name is the result's

    requests = [capture(read, client, prompt) for prompt in (PROMPT, "Hello world")]
    outcomes = run_batch(model, requests, restore=lambda: model)
    for request, outcome in zip(requests, outcomes):
        assert outcome.ok and "the model is quantized" in outcome.meta["cobatch_solo"], outcome.meta
        assert torch.equal(outcome.saved["hidden"], run_alone(model, request, "reference").saved["hidden"])
