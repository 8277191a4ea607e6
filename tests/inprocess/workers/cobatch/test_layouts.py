"""Co-batching on models whose activations are not all laid out by row (fast tier).

An OPT-style decoder flattens every row's tokens into one ``[rows x positions,
d]`` tensor before its MLP; a Mixtral-style mixture of experts computes its
router's logits on such a tensor and feeds each expert the tokens routed to it,
from every row. Tiny random models of both, built like the test GPT-2, run on
the worker's own co-batching engine (``workers.cobatch.run_batch``) with the real
client's payloads: each user's saves equal their run alone, hold none of
another user's tokens (a canary prompt among them), and a value whose rows
are every user's in a layout not split by user sends its reader alone.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.cases.cobatch_cases import LONG, MID, SHORT, capture, logits, worst_difference
from tests.support.clients.load import COBATCH_TOLERANCE as TOLERANCE
from tests.support.cases.tiny_model import build_tiny_gpt2, client_model, worker_loaded
from workers.cobatch import run_alone, run_batch

CANARY = "Zyxwvut canary passphrase hunter2 Zyxwvut"


def opt_mlp(model, prompt):
    with model.trace(prompt, remote=True):
        layer = model.model.decoder.layers[0]
        fc1 = layer.fc1.output.save()  # [rows x positions, ffn]: flattened
        fc2 = layer.fc2.output.save()
        out = model.lm_head.output.save()


def opt_mlp_written(model, prompt):
    # The user's own tokens of a flattened value, written through .data: theirs only.
    with model.trace(prompt, remote=True):
        layer = model.model.decoder.layers[0]
        layer.fc1.output.data[:] = 0
        out = model.lm_head.output.save()


def moe_router(model, prompt):
    with model.trace(prompt, remote=True):
        moe = model.model.layers[0].mlp
        logits = moe.gate.output[0].save()  # the router's logits: [rows x positions, experts]
        out = model.lm_head.output.save()


def moe_expert_tokens(model, prompt):
    # The tokens sorted by the expert they were routed to, gathered from every row
    # ([rows x positions x top-k, d], grouped by expert): no layout by user.
    with model.trace(prompt, remote=True):
        grouped = model.model.layers[0].mlp.experts.source.experts_forward_1.source
        routed = grouped.selected_hidden_states_g_0.output.save()
        out = model.lm_head.output.save()


READS = {"opt": opt_mlp, "mixtral": moe_router}  # each model's flattened values, read


def _loaded(hf_home, architecture: str):
    repo = f"ndif-celery/tiny-{architecture}"
    build_tiny_gpt2(hf_home, repo, n_layer=2, architecture=architecture)
    _, model = worker_loaded(repo)
    return client_model(repo), model


@pytest.fixture(scope="module")
def opt(hf_home):
    return _loaded(hf_home, "opt")


@pytest.fixture(scope="module")
def mixtral(hf_home):
    return _loaded(hf_home, "mixtral")


def alone(model, requests):
    return [run_alone(model, r, "alone, for comparison") for r in requests]


def together(model, requests):
    return run_batch(model, requests, max_batch=16, pad=True)


@pytest.mark.parametrize("architecture", sorted(READS))
def test_flattened_values_are_each_users_own_tokens(architecture, request):
    client, model = request.getfixturevalue(architecture)
    requests = [capture(READS[architecture], client, prompt) for prompt in (SHORT, MID, LONG)]
    requests += [capture(logits, client, CANARY), capture(logits, client, MID)]
    solo, merged = alone(model, requests), together(model, requests)
    for s, m in zip(solo, merged):
        assert m.ok and m.meta == {"cobatch": 5}, (m.meta, m.error)
        for name, value in s.saved.items():
            assert m.saved[name].shape == value.shape, (name, m.saved[name].shape, value.shape)
        assert worst_difference(s.saved, m.saved) <= TOLERANCE


def test_a_write_to_ones_own_flattened_tokens_stays_theirs(opt):
    client, model = opt
    requests = [capture(opt_mlp_written, client, MID), capture(logits, client, SHORT), capture(logits, client, LONG)]
    solo, merged = alone(model, requests), together(model, requests)
    for s, m in zip(solo, merged):
        assert m.ok and m.meta == {"cobatch": 3}, (m.meta, m.error)
        assert worst_difference(s.saved, m.saved) <= TOLERANCE
    assert not torch.allclose(merged[0].saved["out"], alone(model, [capture(logits, client, MID)])[0].saved["out"])


def test_an_experts_tokens_from_every_row_send_their_reader_alone(mixtral):
    client, model = mixtral
    requests = [capture(moe_expert_tokens, client, MID), capture(logits, client, CANARY), capture(logits, client, LONG)]
    solo, merged = alone(model, requests), together(model, requests)
    assert "layout not split by user" in merged[0].meta.get("cobatch_solo", ""), merged[0].meta
    assert torch.equal(merged[0].saved["routed"], solo[0].saved["routed"])
    for s, m in zip(solo[1:], merged[1:]):
        assert m.ok and worst_difference(s.saved, m.saved) <= TOLERANCE
