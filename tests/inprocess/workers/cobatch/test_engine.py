"""Co-batching (``workers.cobatch``): shared forwards give each user what alone gives.

In-process, no stack. Every request is a real payload: the real nnsight client
(``tiny_model.client_model``, the meta model users hold) runs a
``with model.trace(..., remote=True)`` block and ``RemoteBackend.request`` is
swapped for a recorder of exactly what it would POST (the envelope's
``compress`` and ``env``, and ``RemoteBackend._serialize``'s blob). The server
side is the tiny GPT-2 as a worker loads it. Each scenario runs its requests
alone (``run_alone``: today's trusted path) and together (``run_batch``), and
compares the results.

Measured tolerance (this 2-core CPU, torch 2.13, the 12-layer tiny GPT-2, fp32;
``COBATCH_MEASURE=1 pytest -s`` prints every comparison):

* one token length, traces: bit-identical to alone (``torch.equal``) where
  the host's plain torch is batch-invariant (the ``batch_invariant`` fixture
  checks it; the feasibility study's CPU was). Where it is not (MKL on an
  AVX-512 AMD EPYC: plain ``model(batch)`` already differs from ``model(one)``
  by ~1e-8 here), within the tolerance: measured here at most 1.8e-7;
* different lengths merged (left padding, the sequence window, the width padded
  off the model's dimensions): at most 1.8e-7 (hidden states, logits,
  ``.source`` values, caches; some scenarios 0.0);
* a shared generate: the prompt's forward and the generated ids are
  bit-identical; its one-token decode steps differ by at most 1.5e-8, because
  plain torch on this CPU computes a one-token row differently in a batch of
  1 and of 2 (``test_one_token_rows_differ_with_batch_size_in_plain_torch``).

The tests allow ``TOLERANCE`` = 1e-5 absolute (values of order 1e-2..1), the
bound the feasibility study measured on larger models (1.3e-6) with room.

Why one file of ~600 lines: a catalogue of independent scenarios (one per
hazard or feature), each read on its own, sharing the capture and compare
helpers at the top; split, the helpers would travel.
"""

from __future__ import annotations


import nnsight
import pytest
import torch

from tests.support.cases.cobatch_cases import LONG, MID, SHORT, capture, leaves, logits, worst_difference
from tests.support.clients.load import COBATCH_TOLERANCE as TOLERANCE
from tests.support.cases.tiny_model import REPO_ID, worker_loaded
from workers.cobatch import Request, run_alone, run_batch

# Token lengths on the tiny tokenizer differ between these (checked in `payloads`).
SAME_A = "The quick brown fox jumps over the lazy dog"
SAME_B = "The lazy dog jumps over the quick brown fox"


# --- the users' blocks (client side), each a trace of its own kind ------------------


def read(model, prompt):
    with model.trace(prompt, remote=True):
        hidden = model.transformer.h[2].output.save()


def edit_everything(model, prompt):
    # Zeroes every layer's output it can reach, then reads the logits.
    with model.trace(prompt, remote=True):
        for layer in model.transformer.h:
            layer.output[:] = 0
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


def out_of_order(model, prompt):
    # Found only after the forward: layer 2 read before layer 1.
    with model.trace(prompt, remote=True):
        late = model.transformer.h[2].output.save()
        early = model.transformer.h[1].output.save()


def stop_one_of_two(model, prompt_a, prompt_b):
    # Alone, the stop ends the forward before the other invoke's read.
    with model.trace(remote=True) as tracer:
        with tracer.invoke(prompt_a):
            a = model.transformer.h[0].output.save()
            tracer.stop()
        with tracer.invoke(prompt_b):
            b = model.transformer.h[2].output.save()


def skips(model, prompt):
    with model.trace(prompt, remote=True):
        model.transformer.h[1].skip(model.transformer.h[0].output)
        after = model.transformer.h[2].output.save()


def backward(model, prompt):
    with model.trace(prompt, remote=True):
        hidden = model.transformer.h[1].output
        hidden.requires_grad_(True)
        loss = model.output.logits[:, -1].logsumexp(dim=-1).sum()
        with loss.backward():
            grad = hidden.grad.save()


def generate(model, prompt, n=3, **kwargs):
    with model.generate(prompt, max_new_tokens=n, remote=True, **kwargs) as tracer:
        steps = nnsight.save(list())
        for step in tracer.iter[:n]:
            steps.append(model.transformer.h[2].output[:, -1])
        ids = tracer.result.save()


def source_op(model, prompt):
    with model.trace(prompt, remote=True):
        mlp = model.transformer.h[0].mlp.source
        fc_out = mlp.self_c_fc_0.output.save()
        mlp.self_act_0.output[:] = 0
        attn = model.transformer.h[1].attn.source.attention_interface_1.output[0].save()
        out = model.lm_head.output.save()


def flat_ops(model, prompt):
    # Inside GPT-2's Conv1D: x.view(-1, d) and addmm on it, [rows x positions, d]: flattened.
    with model.trace(prompt, remote=True):
        c_fc = model.transformer.h[0].mlp.c_fc.source
        flat_in = c_fc.x_view_0.output.save()
        flat_out = c_fc.torch_addmm_0.output.save()


def flat_ops_two_rows(model, prompt_a, prompt_b):
    with model.trace(remote=True) as tracer:
        with tracer.invoke(prompt_a):
            pass
        with tracer.invoke(prompt_b):
            pass
        with tracer.invoke():  # every row of this request
            flat_out = model.transformer.h[0].mlp.c_fc.source.torch_addmm_0.output.save()


def weight_argument(model, prompt):
    # addmm(bias, x, weight) inside GPT-2's Conv1D: its weight, [64, 256], every user's alike.
    with model.trace(prompt, remote=True):
        args, _ = model.transformer.h[0].mlp.c_fc.source.torch_addmm_0.inputs
        weight = nnsight.save(args[2])
        out = model.lm_head.output.save()


def writes_own_rows(model, prompt):
    # Every road to a value's memory, on values served as this user's rows: each
    # write must land in this user's rows of the shared forward, and nowhere else.
    with model.trace(prompt, remote=True):
        model.transformer.h[0].output.data[:, 0] = 1.0  # .data: no version counter moves
        h1 = model.transformer.h[1].output
        h1.set_(h1 * 0.5)  # set_: the tensor takes another storage
        model.transformer.h[2].output.view(-1)[:7] = 3.0  # in place, through a view
        model.transformer.h[3].output.untyped_storage().fill_(0)  # its storage, bytes at once
        model.transformer.h[4].mlp.c_fc.source.torch_addmm_0.output.data.mul_(2)  # a flattened value
        out = model.lm_head.output.save()


def writes_shared(model, prompt, road):
    # position_ids [1, S] is served whole: every row's. A write to it by any road.
    with model.trace(prompt, remote=True):
        ids = model.transformer.wpe.input
        if road == "data":
            ids.data[:] = 0
        elif road == "set_":
            ids.set_(torch.zeros_like(ids))
        elif road == "view":
            ids.view(-1)[:3] = 0
        elif road == "storage":
            ids.untyped_storage().fill_(0)
        out = model.lm_head.output.save()


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
    # The weight reached by a built name: the screen for weight names misses it.
    with model.trace(prompt, remote=True):
        hidden = model.transformer.h[0].output
        getattr(model.transformer.h[2].mlp.c_fc, "wei" + "ght").data[:] = 0
        out = model.lm_head.output.save()


def logit_lens(model, prompt):
    # Names a weight: every user's, so the screen sends it alone.
    with model.trace(prompt, remote=True):
        lens = (model.transformer.ln_f.output @ model.lm_head.weight.T).save()


def weight_write_undone(model, prompt):
    # Layer 1's weight doubled while layer 1 runs for every row, halved again
    # before the forward ends: bit for bit as loaded afterwards.
    with model.trace(prompt, remote=True):
        weight = getattr(model.transformer.h[1].mlp.c_fc, "wei" + "ght")
        hidden = model.transformer.h[0].output
        weight.mul_(2)
        hidden = model.transformer.h[11].output
        weight.div_(2)
        out = model.lm_head.output.save()


def session(model, prompt_a, prompt_b):
    with model.session(remote=True):
        with model.trace(prompt_a):
            h = model.transformer.h[1].output[:, -1]
        with model.trace(prompt_b):
            model.transformer.h[1].output[:, -1] = h
            out = model.lm_head.output.save()


# --- capture and run -----------------------------------------------------------------


@pytest.fixture(scope="module")
def client():
    from tests.support.cases.tiny_model import client_model

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


def assert_bit_identical(a: dict, b: dict):
    assert worst_difference(a, b) == 0.0
    for key, x in dict(leaves(a)).items():
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, dict(leaves(b))[key]), key


@pytest.fixture(scope="module")
def batch_invariant(client, server) -> bool:
    """Whether this host's plain torch gives a prompt's rows the same bits alone
    and in a batch of two equal-length prompts (no nnsight, no padding).

    Whether it does is the BLAS's choice, not ours: MKL picks its matrix
    kernel by the number of rows, and on some CPUs (an AVX-512 AMD EPYC here)
    the kernels sum in different orders, so even plain ``model(batch)`` differs
    from ``model(one)`` by ~1e-8 on this model; on others (the CPU the
    feasibility study ran on) it is bit for bit."""
    hf = server[0]._module
    ids = client.tokenizer([SAME_A, SAME_B], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        alone_out = hf(ids[:1]).logits
        batch_out = hf(ids).logits[:1]
    assert (alone_out - batch_out).abs().max() <= TOLERANCE
    return torch.equal(alone_out, batch_out)


def assert_as_alone(solo, merged, invariant: bool):
    """A request's values as alone: bit for bit when it ran alone, or shared a
    forward on a host whose kernels are batch-invariant (``batch_invariant``);
    within ``TOLERANCE`` when it shared one on a host whose plain torch already
    differs between batch sizes."""
    if merged.meta.get("cobatch", 1) == 1 or invariant:
        assert_bit_identical(solo.saved, merged.saved)
    else:
        assert worst_difference(solo.saved, merged.saved) <= TOLERANCE


# --- the scenarios ---------------------------------------------------------------------


def test_equal_lengths_share_one_forward_bit_identical_where_the_kernels_allow(client, server, batch_invariant):
    requests = [capture(read, client, SAME_A), capture(logits, client, SAME_B), capture(read, client, SAME_B)]
    solo = alone(server, requests)
    merged = together(server, requests)
    for s, m in zip(solo, merged):
        assert m.ok and m.meta == {"cobatch": 3}
        assert_as_alone(s, m, batch_invariant)


def test_different_lengths_share_one_forward_within_the_tolerance(client, server):
    requests = [capture(read, client, SHORT), capture(logits, client, MID), capture(read, client, LONG),
                capture(two_invokes, client, SHORT, LONG)]
    solo = alone(server, requests)
    merged = together(server, requests)
    worst = 0.0
    for s, m in zip(solo, merged):
        assert m.ok and m.meta == {"cobatch": 4}, m.meta
        worst = max(worst, worst_difference(s.saved, m.saved))
    assert worst <= TOLERANCE
    print(f"different lengths, worst |merged - alone| = {worst:.2e}")


def test_saved_values_carry_no_other_users_rows(client, server):
    requests = [capture(read, client, SHORT), capture(read, client, LONG)]
    merged = together(server, requests)
    assert [m.meta for m in merged] == [{"cobatch": 2}] * 2
    for m in merged:
        hidden = m.saved["hidden"]
        # torch.save writes a view's whole storage: it must be this user's rows only.
        assert hidden.untyped_storage().nbytes() == hidden.numel() * hidden.element_size()


def test_edits_stay_in_their_own_rows(client, server):
    model, _ = server
    requests = [capture(edit_everything, client, MID), capture(logits, client, SHORT),
                capture(read, client, LONG), capture(logits, client, MID), capture(read, client, SHORT)]
    solo = alone(server, requests)
    merged = together(server, requests)
    assert all(m.ok and m.meta == {"cobatch": 5} for m in merged)
    for s, m in zip(solo, merged):
        assert worst_difference(s.saved, m.saved) <= TOLERANCE
    # The edit took effect for its user (same prompt, unedited logits differ a lot) ...
    assert (merged[0].saved["out"] - merged[3].saved["out"]).abs().max() > 1e-2
    # ... and only there: the unedited users' values are what they are alone.
    assert worst_difference(solo[3].saved, merged[3].saved) <= TOLERANCE


def test_one_users_error_or_stop_ends_only_theirs(client, server, batch_invariant):
    requests = [capture(error, client, SAME_A), capture(stops, client, SAME_B),
                capture(read, client, SAME_A), capture(logits, client, SAME_B), capture(read, client, SAME_B)]
    solo = alone(server, requests)
    merged = together(server, requests)
    assert not merged[0].ok and not solo[0].ok
    assert str(merged[0].error) == str(solo[0].error) and "IndexError" in str(merged[0].error)
    assert merged[0].meta["cobatch"] == 1 and "failed in a shared forward" in merged[0].meta["cobatch_solo"]
    for s, m in zip(solo[1:], merged[1:]):
        assert m.ok and m.meta == {"cobatch": 5}
        assert_as_alone(s, m, batch_invariant)


def test_errors_found_after_the_forward_are_the_users_own(client, server):
    requests = [capture(out_of_order, client, SHORT), capture(stop_one_of_two, client, MID, LONG),
                capture(read, client, LONG), capture(session, client, SHORT, MID)]
    solo = alone(server, requests)
    merged = together(server, requests)
    for i in (0, 1):
        assert not merged[i].ok and str(merged[i].error) == str(solo[i].error)
        assert "OutOfOrderError" in str(merged[i].error)
    assert "failed in a shared forward" in merged[0].meta["cobatch_solo"]
    assert "stopped (tracer.stop()) one of several invokes" in merged[1].meta["cobatch_solo"]
    # The others shared the first forward (the session its 2nd trace alone, still in the batch).
    assert merged[2].meta == merged[3].meta == {"cobatch": 4}
    for s, m in zip(solo[2:], merged[2:]):
        assert worst_difference(s.saved, m.saved) <= TOLERANCE


def test_what_cannot_share_runs_alone_and_says_why(client, server, batch_invariant):
    requests = [capture(skips, client, SAME_A), capture(backward, client, SAME_B),
                capture(generate, client, SAME_A, 3, do_sample=True),
                capture(shared_positions, client, SAME_A), capture(read, client, SAME_B),
                capture(read, client, SAME_A), capture(logit_lens, client, SAME_B)]
    solo = alone(server, requests)
    merged = together(server, requests)
    reasons = [m.meta.get("cobatch_solo", "") for m in merged]
    assert ".skip()" in reasons[0]
    assert "backward" in reasons[1]
    assert "do_sample" in reasons[2]
    assert "shared by the whole batch" in reasons[3]
    assert "names the model's weights" in reasons[6]
    assert merged[4].meta == merged[5].meta == {"cobatch": 3}
    for i, (s, m) in enumerate(zip(solo, merged)):
        assert m.ok, (i, m.error)
        if i != 2:  # sampling: a fresh random draw each run
            assert_as_alone(s, m, batch_invariant)


def test_a_weight_written_mid_forward_is_restored_and_everyone_runs_alone(client, server, batch_invariant):
    model, _ = server
    before = {k: v.clone() for k, v in model._module.state_dict().items()}
    requests = [capture(weight_write, client, SAME_A), capture(read, client, SAME_B), capture(logits, client, SAME_A)]
    solo = alone(server, requests)
    merged = run_batch(model, requests, restore=server[1])
    for s, m in zip(solo, merged):
        assert m.ok and "weight was written" in m.meta["cobatch_solo"]
        assert_as_alone(s, m, batch_invariant)
    server[1]()
    assert all(torch.equal(before[k], v) for k, v in model._module.state_dict().items())


def test_a_weight_written_and_undone_mid_forward_still_sends_everyone_alone(client, server, batch_invariant):
    """The weights are as loaded before and after the forward, yet the other
    rows ran layer 1 with the doubled weight: the stamps' version counters
    show the writes, so every request runs again alone, each getting what it
    gets alone (a whole fingerprint before and after could not see this)."""
    writer = capture(weight_write_undone, client, SAME_A)
    assert_everyone_alone(server, client, writer, "weight was written", batch_invariant)


def assert_everyone_alone(server, client, writer: Request, reason: str, invariant: bool) -> None:
    """``writer`` shares a forward with two readers; every one of them runs again
    alone, saying ``reason``, and gets what it gets alone."""
    requests = [writer, capture(read, client, SAME_B), capture(logits, client, SAME_A)]
    solo = alone(server, requests)
    merged = together(server, requests)
    for s, m in zip(solo, merged):
        assert m.ok and reason in m.meta["cobatch_solo"], m.meta
        assert_as_alone(s, m, invariant)


def test_generation_with_iter_shares_a_generate(client, server, batch_invariant):
    requests = [capture(generate, client, SAME_A, 3), capture(generate, client, SAME_B, 3),
                capture(generate, client, SAME_B, 5), capture(generate, client, SHORT, 3)]
    solo = alone(server, requests)
    merged = together(server, requests)
    assert merged[0].meta == merged[1].meta == {"cobatch": 2}
    # Different max_new_tokens, different prompt length: nothing to share with.
    assert merged[2].meta["cobatch_solo"] == merged[3].meta["cobatch_solo"] == "no other request in this batch could share its forward"
    for s, m in zip(solo, merged):
        assert len(m.saved["steps"]) == len(s.saved["steps"]) > 1
        assert torch.equal(s.saved["ids"], m.saved["ids"])
        prompt_step = worst_difference({"s": s.saved["steps"][0]}, {"s": m.saved["steps"][0]})
        assert prompt_step == 0.0 if batch_invariant else prompt_step <= TOLERANCE  # the prompt's forward
        assert worst_difference(s.saved, m.saved) <= TOLERANCE  # the one-token decode steps


def test_a_generation_that_ends_early_alone_runs_alone(client, server):
    plain = alone(server, [capture(generate, client, SAME_A, 3), capture(generate, client, SAME_B, 3)])
    new_a = plain[0].saved["ids"][0, -3:].tolist()
    new_b = plain[1].saved["ids"][0, -3:].tolist()
    if new_a[0] in new_b:
        pytest.skip("the tiny model continues both prompts with the same token")
    # A's first new token is its end of sequence: alone it stops there; B goes on.
    requests = [capture(generate, client, SAME_A, 3, eos_token_id=new_a[0]),
                capture(generate, client, SAME_B, 3, eos_token_id=new_a[0])]
    solo = alone(server, requests)
    merged = together(server, requests)
    assert "end-of-sequence" in merged[0].meta["cobatch_solo"]
    assert merged[1].meta == {"cobatch": 2}
    # Alone, A's loop outran its generation: fewer steps, and what follows the loop did not run.
    assert len(solo[0].saved["steps"]) < len(solo[1].saved["steps"]) and "ids" not in solo[0].saved
    for s, m in zip(solo, merged):
        assert worst_difference(s.saved, m.saved) <= TOLERANCE
    assert torch.equal(solo[1].saved["ids"], merged[1].saved["ids"])


def test_one_token_rows_differ_with_batch_size_in_plain_torch(server):
    """Why a shared generate's decode steps are equal to alone within the tolerance
    rather than bit for bit: plain torch on this CPU already computes a
    one-token row differently in a batch of 1 (a matrix-vector kernel) and of 2."""
    mlp = server[0]._module.transformer.h[0].mlp
    one = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(0))
    two = torch.cat([one, torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(1))])
    with torch.no_grad():
        alone_row, batch_row = mlp(one)[0], mlp(two)[0]
    assert (alone_row - batch_row).abs().max() <= TOLERANCE
    if torch.equal(alone_row, batch_row):
        pytest.skip("this machine's kernels give a one-token row the same bits in a batch of 1 and of 2")


def test_source_ops_cache_and_kv_cache_objects(client, server):
    requests = [capture(source_op, client, SHORT), capture(cached, client, MID),
                capture(kv, client, LONG), capture(read, client, SHORT), capture(logits, client, MID)]
    solo = alone(server, requests)
    merged = together(server, requests)
    for s, m in zip(solo, merged):
        assert m.ok and m.meta == {"cobatch": 5}, (m.meta, m.error)
        assert worst_difference(s.saved, m.saved) <= TOLERANCE
    # The KV cache object holds this user's row only (batch 1), not the batch's 5.
    assert merged[2].saved["kv"].layers[0].keys.shape[0] == 1


def test_flattened_values_are_each_users_own_tokens(client, server):
    """A value flattened over rows and positions ([rows x width, d]) is served
    as the user's own tokens, as alone (a canary prompt's tokens reach no one
    else's saves); a request of several left-padded rows, whose tokens are not
    one range, runs alone and says why."""
    canary = "Zyxwvut canary passphrase hunter2 Zyxwvut"
    requests = [capture(flat_ops, client, SHORT), capture(read, client, canary), capture(flat_ops, client, LONG),
                capture(flat_ops_two_rows, client, SHORT, LONG)]
    solo = alone(server, requests)
    merged = together(server, requests)
    for i in (0, 2):
        assert merged[i].ok and merged[i].meta == {"cobatch": 4}, merged[i].meta  # the fourth shared it too
        for name in ("flat_in", "flat_out"):
            saved = merged[i].saved[name]
            assert saved.shape == solo[i].saved[name].shape, (name, saved.shape, solo[i].saved[name].shape)
            assert saved.untyped_storage().nbytes() == saved.numel() * saved.element_size()
        assert worst_difference(solo[i].saved, merged[i].saved) <= TOLERANCE
    assert merged[3].ok and "layout not split by user" in merged[3].meta["cobatch_solo"], merged[3].meta
    assert torch.equal(merged[3].saved["flat_out"], solo[3].saved["flat_out"])


def test_sizes_that_are_the_models_own_are_never_taken_for_users_rows(client, server, batch_invariant):
    """Values are told to be the users' by their first dimension: the rows, or
    rows x width. Eight prompts of 8 tokens would make rows x width 64, the
    model's hidden size, and a weight [64, 256] read inside a ``.source`` op
    would be cut as if it held the users' tokens: a filler row (nobody's)
    makes them nine. Four rows (the model's head count) are never a batch's
    either: a filler makes them five. Rows of two lengths are padded to a
    width whose sizes are free."""
    from workers.cobatch import batcher

    dims = batcher.model_dims(server[0])
    assert len(client.tokenizer(MID)["input_ids"]) == 8 and 8 * 8 in dims and 4 in dims
    requests = [capture(weight_argument, client, MID) for _ in range(8)]
    solo, merged = alone(server, requests), together(server, requests)
    for s, m in zip(solo, merged):
        assert m.ok and m.meta == {"cobatch": 8}, (m.meta, m.error)
        assert torch.equal(m.saved["weight"], server[0]._module.transformer.h[0].mlp.c_fc.weight)
        assert worst_difference(s.saved, m.saved) <= TOLERANCE
    four = [capture(read, client, prompt) for prompt in (MID, SHORT, LONG, SAME_A)]
    solo, merged = alone(server, four), together(server, four)
    for s, m in zip(solo, merged):
        assert m.meta == {"cobatch": 4}, m.meta  # and a filler row: five in the forward
        assert worst_difference(s.saved, m.saved) <= TOLERANCE
    assert batcher.layout({8}, 8, dims, 128, pad=True) == (1, 0)  # 8 x 8 = 64: nine rows, no padding
    assert batcher.layout({9}, 8, dims, 128, pad=True) == (0, 0)  # 72: no dimension
    assert batcher.layout({9}, 4, dims, 128, pad=True) == (1, 0)  # 4 heads: five rows
    assert batcher.layout({16}, 8, dims, 128, pad=False) == (1, 0)  # 8 x 16 = 128 positions: nine rows
    assert batcher.layout({7, 8}, 8, dims, 128, pad=True) == (0, 9)  # two lengths: padded to 9 (8 x 8 = 64)
    assert batcher.layout({9}, 16, dims, 128, pad=True) == (1, 0)  # 16 rows (head width): seventeen


def test_writes_by_every_road_land_in_the_writers_own_rows(client, server, batch_invariant):
    """Each worker is served copies of its own part: a write through ``.data``,
    ``set_``, a view or the storage changes its rows of the shared forward as
    it changes the run alone, and nothing of the readers beside it."""
    requests = [capture(writes_own_rows, client, SAME_A), capture(read, client, SAME_B), capture(logits, client, SAME_A)]
    solo, merged = alone(server, requests), together(server, requests)
    for s, m in zip(solo, merged):
        assert m.ok and m.meta == {"cobatch": 3}, (m.meta, m.error)
        assert_as_alone(s, m, batch_invariant)
    untouched = alone(server, [capture(logits, client, SAME_A)])[0].saved["out"]
    assert (merged[0].saved["out"] - untouched).abs().max() > 1e-2  # the writes did change the writer's run


@pytest.mark.parametrize("road", ["data", "set_", "view", "storage"])
def test_a_write_to_a_shared_value_sends_only_its_writer_alone(client, server, batch_invariant, road):
    """A value every row shares (``position_ids``), written by any road: the
    writer's copy shows it (its content is compared, not a version counter),
    nothing is written back, the writer runs again alone; the readers keep
    their shared forward, untouched."""
    requests = [capture(writes_shared, client, SAME_A, road), capture(read, client, SAME_B),
                capture(logits, client, SAME_A)]
    solo, merged = alone(server, requests), together(server, requests)
    assert merged[0].ok and "shared by the whole batch" in merged[0].meta["cobatch_solo"], merged[0].meta
    for s, m in zip(solo, merged):
        assert_as_alone(s, m, batch_invariant)
    assert merged[1].meta == merged[2].meta == {"cobatch": 3}, [m.meta for m in merged]


def test_sessions_share_one_forward_per_trace(client, server):
    requests = [capture(session, client, SHORT, MID), capture(session, client, LONG, SHORT)]
    solo = alone(server, requests)
    merged = together(server, requests)
    for s, m in zip(solo, merged):
        assert m.ok and m.meta == {"cobatch": 2}, (m.meta, m.error)
        assert worst_difference(s.saved, m.saved) <= TOLERANCE


def test_each_user_gets_their_own_log_lines(client, server, lengths):
    requests = [capture(prints, client, SAME_A), capture(prints, client, SHORT)]
    solo_logs, merged_logs = [[], []], [[], []]
    for i, request in enumerate(requests):
        request.log = solo_logs[i].append
    alone(server, requests)
    for i, request in enumerate(requests):
        request.log = merged_logs[i].append
    merged = together(server, requests)
    assert [m.meta for m in merged] == [{"cobatch": 2}] * 2
    assert merged_logs == solo_logs
    assert solo_logs[0] == [f"mine {SAME_A} (1, {lengths[SAME_A]}, 64)"]
    assert solo_logs[1] == [f"mine {SHORT} (1, {lengths[SHORT]}, 64)"]


def test_settings_off_and_unequal_lengths_off(client, server, batch_invariant):
    requests = [capture(read, client, SAME_A), capture(logits, client, SAME_B), capture(read, client, SHORT)]
    off = together(server, requests, max_batch=1)
    assert all(m.meta == {"cobatch": 1, "cobatch_solo": "co-batching is off (NDIF_COBATCH_MAX=1)"} for m in off)
    no_pad = together(server, requests, pad=False)
    assert no_pad[0].meta == no_pad[1].meta == {"cobatch": 2}
    assert no_pad[2].meta["cobatch"] == 1
    solo = alone(server, requests)
    for s, m in zip(solo, no_pad):
        assert_as_alone(s, m, batch_invariant)


def test_untrusted_requests_are_refused(client, server):
    request = capture(read, client, SAME_A)
    request.trusted = False
    with pytest.raises(ValueError, match="untrusted"):
        run_batch(server[0], [request, capture(read, client, SAME_B)])


def test_the_merged_width_avoids_the_models_dimensions(server):
    from workers.cobatch import batcher

    dims = batcher.model_dims(server[0])
    assert {64, 16, 4, 512, 128, 256} <= dims  # hidden, head width, heads, vocab, positions, MLP
    assert batcher.safe_width(16, dims, 128) not in dims and batcher.safe_width(16, dims, 128) > 16
    assert batcher.safe_width(127, {127, 128}, 128) == 0  # none fits: bucket by length


def test_a_width_equal_to_a_model_dimension_is_padded_past_it(client, server, monkeypatch):
    from workers.cobatch import batcher

    dims = batcher.model_dims(server[0])
    words = "The quick brown fox jumps over the lazy dog again and again in the city of Paris".split()
    prompts = [" ".join(words[:n]) for n in range(2, len(words) + 1)]
    colliding = next((p for p in prompts if len(client.tokenizer(p)["input_ids"]) in dims), None)
    if colliding is None:
        pytest.skip("no prompt here is as long as a model dimension")
    widths = []
    assemble = batcher.CoBatcherMixin.assemble

    def spy(self, fn):
        out = assemble(self, fn)
        widths.append(out[1]["input_ids"].shape[1])
        return out

    monkeypatch.setattr(batcher.CoBatcherMixin, "assemble", spy)
    requests = [capture(read, client, colliding), capture(logits, client, SHORT)]
    solo = alone(server, requests)
    merged = together(server, requests)
    assert widths and widths[0] > len(client.tokenizer(colliding)["input_ids"]) and widths[0] not in dims
    for s, m in zip(solo, merged):
        assert m.meta == {"cobatch": 2}
        assert worst_difference(s.saved, m.saved) <= TOLERANCE
