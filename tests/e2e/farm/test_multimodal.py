"""Models beyond text generation, served: a LLaVA-style vision-language model (an
image travels in the payload, the worker's processor is the checkpoint's), a
T5-style encoder-decoder and a Whisper-style speech model
(``tests/support/cases/tiny_multimodal.py``), traced by the real 0.8.1 client,
each equal to the client's own local run (reads, an edit, generate, a gradient) with its weights frozen as the farm
holds them, on the trusted path and in jailed children (fork and zygote).

T5 is served as transformers 5 loads it by repo id: ``feature-extraction``
(``T5Model``, no ``generate``); transformers 5 removed ``text2text-generation``,
and the farm refuses that task naming why.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.cases import tiny_multimodal
from tests.support.cases.tiny_model import PROMPT, REPO_ID


def frozen(model):
    """The client's model dispatched with its weights frozen, as a worker holds them:
    some attention kernels (T5's) differ in the last bits when weights take gradients."""
    model.dispatch()
    model._module.requires_grad_(False)
    return model


def vlm():
    prompt = tiny_multimodal.LLAVA_PROMPT
    return tiny_multimodal.vlm_case, frozen(tiny_multimodal.client_vlm()), (tiny_multimodal.image(), prompt)


def t5():
    model = frozen(tiny_multimodal.client_t5())
    return tiny_multimodal.t5_case, model, (model.tokenizer(tiny_multimodal.T5_PROMPT, return_tensors="pt").input_ids, torch.tensor([[0, 5, 9]]))


def whisper():
    model = frozen(tiny_multimodal.client_whisper())
    return tiny_multimodal.whisper_case, model, (tiny_multimodal.waveform(), torch.tensor([model.tokenizer.prefix_tokens]))


MODELS = {"llava": vlm, "t5": t5, "whisper": whisper}


@pytest.fixture(scope="module", params=[pytest.param(kind, marks=pytest.mark.pools(kind))
                                        for kind in ("fs", "isolated", "zygote")])
def served(request, stack_pool, hf_home):
    """``(kind, stack, {name: (case, model, inputs)})``: a pool stack holding the three models."""
    for build in (tiny_multimodal.build_tiny_llava, tiny_multimodal.build_tiny_t5, tiny_multimodal.build_tiny_whisper):
        build(hf_home)
    models = {name: make() for name, make in MODELS.items()}
    stack = stack_pool.get(request.param)
    keys = [model.to_model_key() for _, model, _ in models.values()]
    for key in keys:
        stack.cli("deploy", key, "--timeout", "180", check=True, timeout=240)
    yield request.param, stack, models
    for key in keys:
        stack.cli("evict", key)


@pytest.mark.parametrize("name", MODELS)
def test_each_model_traces_remotely_as_the_client_does_locally(served, name):
    kind, stack, models = served
    case, model, inputs = models[name]
    remote = case(model, {"remote": stack.url}, *inputs)
    local = case(model, {}, *inputs)
    assert remote.keys() == local.keys()
    for read, value in local.items():
        assert torch.equal(remote[read], value), f"{name}: {read} differs from the local run"


def vlm_gradient(model, remote, image, prompt):
    with model.trace(prompt, images=[image], **remote):
        hidden = model.model.language_model.layers[0].output
        hidden.requires_grad_(True)
        logits = model.lm_head.output
        with logits.sum().backward():
            grad = hidden.grad.save()
    return grad


def t5_gradient(model, remote, input_ids, decoder_input_ids):
    with model.trace(input_ids=input_ids, decoder_input_ids=decoder_input_ids, **remote):
        hidden = model.encoder.block[1].output[0]
        hidden.requires_grad_(True)
        decoded = model.decoder.final_layer_norm.output
        with decoded.sum().backward():
            grad = hidden.grad.save()
    return grad


def whisper_gradient(model, remote, audio, decoder_input_ids):
    with model.trace(audio, decoder_input_ids=decoder_input_ids, **remote):
        hidden = model.model.encoder.layers[0].output
        hidden.requires_grad_(True)
        logits = model.proj_out.output
        with logits.sum().backward():
            grad = hidden.grad.save()
    return grad


GRADIENTS = {"llava": vlm_gradient, "t5": t5_gradient, "whisper": whisper_gradient}


@pytest.mark.parametrize("name", MODELS)
def test_a_gradient_reaches_the_client_as_it_does_locally(served, name):
    _, stack, models = served
    _, model, inputs = models[name]
    remote = GRADIENTS[name](model, {"remote": stack.url}, *inputs)
    local = GRADIENTS[name](model, {}, *inputs)
    assert local.abs().sum() > 0 and torch.equal(remote, local)


@pytest.mark.pools("fs")
def test_a_task_transformers_removed_is_refused_naming_it(fs_stack, model):
    from nnsight.intervention.backends.remote import RemoteBackend

    key = f'nnsight.modeling.transformers.TransformersModel:{{"repo_id": "{REPO_ID}", "revision": null, ' \
          '"task": "text2text-generation"}'
    with pytest.raises(Exception) as caught:
        with model.trace(PROMPT, backend=RemoteBackend(key, host=fs_stack.url)):
            model.output.logits.save()
    said = str(caught.value)
    assert "text2text-generation" in said and "transformers 5" in said, said
