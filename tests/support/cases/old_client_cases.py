"""Conformance cases for older nnsight clients (0.5.15, 0.6.3 and 0.7.0).

The farm serves each old client from a runtime with that client's own nnsight.
A user of such a client must get from the farm exactly what the same client
computes locally. So each case is a piece of user code written against that
client's API. The client's interpreter runs it twice in one process, once
locally and once remotely, and compares the two results exactly.

The old client cannot import this project (it has its own nnsight), so the
whole harness is one self-contained script, `SCRIPT`. It runs as
``python -c SCRIPT host repo_id case mode``. nnsight reads a ``-c`` trace's
source from the command line, so the script must stay a plain ``-c`` program.

Modes:

* ``blocking``: the remote run is ``remote=True`` (websocket, results pushed
  into the caller's frame by the client itself);
* ``non-blocking``: the client's non-blocking path (``RemoteBackend`` with
  ``blocking=False``: POST, then ``backend()`` polled until the result comes),
  with the result pushed into the caller's frame the way the blocking path does,
  so one case body serves both modes;
* ``local-only``: two local runs, to show a case is deterministic and that the
  comparison works; no farm is needed;
* ``simulate``: the second run goes through the client's own serialization
  (``LocalSimulationBackend``), to check a case ships, without a farm.

The script prints one JSON line: ``version``, ``case``, ``mode``, then either
``equal``, ``differences`` (the first difference in each saved value that
differs, with the max abs diff for tensors), ``names`` (the saved names) and
``first_changed_later`` (saved values of the first run that changed after it
ended), or ``error``, ``said`` and ``where`` (``local`` or ``remote``), or
``unsupported`` (why this version cannot express the case).

The tiny model runs on CPU, and both runs use the same torch, so results must
be bit-equal: no tolerance anywhere.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

from tests.support.clients import client_envs
from tests.support.cases.tiny_model import PROMPTS

#: Client versions this harness is written for.
VERSIONS = ("0.5.15", "0.6.3", "0.7.0")

#: Modes the script understands (see the module docstring).
MODES = ("blocking", "non-blocking", "local-only", "simulate")

#: Every case, in the order the script defines them.
CASES = [
    "read_outputs",
    "read_inputs",
    "read_logits",
    "zero_output",
    "replace_output",
    "logit_lens",
    "source_read",
    "source_edit",
    "source_skip",
    "module_skip",
    "early_stop",
    "generate_iter",
    "generate_all",
    "gradients",
    "gradients_two",
    "session",
    "cache_all",
    "cache_modules",
    "batched_invokes",
    "invoke_isolation",
    "prompt_list",
    "rename",
    "edit_copy",
    "save_computed",
]

#: Cases a version cannot express, and why. The script reports them as
#: unsupported instead of running them.
UNSUPPORTED = {
    # No version has an operation-level skip: their OperationEnvoy has
    # only .input/.inputs/.output/.source (skip exists on modules only).
    "0.5.15": {"source_skip": "no .skip() on .source operations (OperationEnvoy) in nnsight 0.5.15"},
    "0.6.3": {"source_skip": "no .skip() on .source operations (OperationEnvoy) in nnsight 0.6.3"},
    "0.7.0": {"source_skip": "no .skip() on .source operations (OperationEnvoy) in nnsight 0.7.0"},
}

#: Cases each version supports.
SUPPORTED = {version: [case for case in CASES if case not in UNSUPPORTED[version]] for version in VERSIONS}


SCRIPT = r'''
import linecache, sys
# nnsight finds a trace's source with inspect, which for a ``-c`` program has no
# file to read. Register the program's text the way a file's would be, so traces
# inside functions are found as they are in a script file (nnsight's own ``-c``
# fallback handles module-level traces only).
_SOURCE = sys.orig_argv[sys.orig_argv.index("-c") + 1]
linecache.cache["<string>"] = (len(_SOURCE), None, _SOURCE.splitlines(keepends=True), "<string>")

import collections, dataclasses, json, math, time, traceback

import torch
import nnsight
from nnsight import CONFIG, LanguageModel
from nnsight.modeling import huggingface
from nnsight.intervention.backends.remote import RemoteBackend
try:
    from nnsight.intervention.backends.local_simulation import LocalSimulationBackend
except ImportError:  # 0.5 has no local simulation
    LocalSimulationBackend = None

HOST, REPO, CASE_LIST, MODE = sys.argv[1:5]
CASE = ""
VERSION = nnsight.__version__
PROMPT = __PROMPT__
PROMPT2 = __PROMPT2__
UNSUPPORTED = __UNSUPPORTED__
CASES = __CASES__
GEN = dict(max_new_tokens=3, do_sample=False)
POLL_TIMEOUT_S = 120.0

CONFIG.API.HOST = HOST
import os
if os.environ.get("CLIENT_API_KEY"):  # the farm's key for this run (auth on)
    CONFIG.API.APIKEY = os.environ["CLIENT_API_KEY"]
# These clients ask the hub for the repo's canonical id; the hub is out of reach here, and the id is the repo's.
if hasattr(huggingface, "ID_CACHE"):
    huggingface.ID_CACHE[REPO] = REPO
else:  # 0.5 asks the hub at every request, with no cache to fill
    import types
    huggingface.HfApi.model_info = lambda self, repo_id, *args, **kwargs: types.SimpleNamespace(id=repo_id)


# ---------------------------------------------------------------------------
# How a run reaches its backend
# ---------------------------------------------------------------------------

class PollUntilDone(RemoteBackend):
    """The client's non-blocking path: submit, then call the backend until the result comes.

    Then push the result into the caller's frame, as the blocking path does."""

    def __init__(self, model):
        super().__init__(model.to_model_key(), blocking=False)

    def __call__(self, tracer=None):
        self.job_id = None
        super().__call__(tracer)  # submits; stores job_id
        if not self.job_id:
            raise RuntimeError("the submit returned no job id")
        deadline = time.monotonic() + POLL_TIMEOUT_S
        while True:
            result = super().__call__(tracer)
            if result is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id} did not finish in {POLL_TIMEOUT_S} s")
            time.sleep(0.1)
        tracer.push(result)
        return result


def rk(model, remote, blocking):
    """Keyword arguments for the outermost trace / generate / session of a block."""
    if not remote:
        return {}
    if remote == "simulate":
        return {"backend": LocalSimulationBackend(model)}
    if blocking:
        return {"remote": True, "blocking": True}
    return {"backend": PollUntilDone(model)}


# ---------------------------------------------------------------------------
# Exact comparison
# ---------------------------------------------------------------------------

def plain_object(value):
    """An object with identity equality whose state is its __dict__ (e.g. a transformers DynamicCache)."""
    return type(value).__eq__ is object.__eq__ and hasattr(value, "__dict__")


def diff(a, b, path, seen=None):
    """The first difference between a and b, as a sentence, or None. Exact and recursive.

    Tensors: dtype, shape and torch.equal (NaN equals NaN; device and requires_grad
    ignored). Lists, tuples, dicts (the caches' CacheDict too), dataclasses (the
    caches' Entry) recursively; objects with identity equality by their __dict__;
    anything else by type and ==."""
    seen = set() if seen is None else seen
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {type(a).__name__} != {type(b).__name__}"
        if a.dtype != b.dtype:
            return f"{path}: dtype {a.dtype} != {b.dtype}"
        if a.shape != b.shape:
            return f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        a, b = a.detach().cpu(), b.detach().cpu()
        if a.is_floating_point():
            if not torch.equal(torch.isnan(a), torch.isnan(b)):
                return f"{path}: NaN positions differ"
            a, b = a[~torch.isnan(a)], b[~torch.isnan(b)]
        if torch.equal(a, b):
            return None
        if a.numel() and a.is_floating_point():
            return f"{path}: tensor values differ (max abs diff {(a - b).abs().max().item()!r})"
        return f"{path}: tensor values differ"
    if type(a) is not type(b):
        return f"{path}: type {type(a).__qualname__} != {type(b).__qualname__}"
    if a is b or (id(a), id(b)) in seen:
        return None
    seen.add((id(a), id(b)))
    if isinstance(a, dict):
        # dict's own views: the caches' CacheDict re-maps keys in __getitem__.
        ka, kb = list(dict.keys(a)), list(dict.keys(b))
        if set(ka) != set(kb):
            left, right = sorted(set(ka) - set(kb), key=str), sorted(set(kb) - set(ka), key=str)
            return f"{path}: keys differ (only left: {left!r}, only right: {right!r})"
        for k in ka:
            found = diff(dict.__getitem__(a, k), dict.__getitem__(b, k), f"{path}[{k!r}]", seen)
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = diff(x, y, f"{path}[{i}]", seen)
            if found:
                return found
        return None
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        for field in dataclasses.fields(a):
            found = diff(getattr(a, field.name), getattr(b, field.name), f"{path}.{field.name}", seen)
            if found:
                return found
        return None
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return None
    if plain_object(a):
        return diff(vars(a), vars(b), f"{path}<{type(a).__name__}>", seen)
    try:
        equal = bool(a == b)
    except Exception as error:
        return f"{path}: cannot compare {type(a).__name__} values ({error})"
    return None if equal else f"{path}: {a!r} != {b!r}"


# ---------------------------------------------------------------------------
# Cases: each returns {name: value} of what the user saved
# ---------------------------------------------------------------------------

def local_norm_score(x):
    """A user's helper defined in the script (__main__): ships by value."""
    return (x - x.mean(dim=-1, keepdim=True)).norm(dim=-1) * 3.0


def case_read_outputs(model, remote, blocking):
    prompt = PROMPT
    with model.trace(prompt, **rk(model, remote, blocking)):
        first = model.transformer.h[0].output.save()
        attn = model.transformer.h[1].attn.output[0].save()
        last = model.transformer.h[-1].output.save()
        final = model.transformer.ln_f.output.save()
    return {"first": first, "attn": attn, "last": last, "final": final}


def case_read_inputs(model, remote, blocking):
    prompt = PROMPT
    with model.trace(prompt, **rk(model, remote, blocking)):
        token_ids = model.transformer.wte.input.save()
        block_in = model.transformer.h[0].input.save()
        inputs = model.transformer.h[2].inputs
        positional = inputs[0][0].save()
        kwarg_names = nnsight.save(sorted(inputs[1]))
        mlp_in = model.transformer.h[2].mlp.input.save()
    return {"token_ids": token_ids, "block_in": block_in, "positional": positional,
            "kwarg_names": kwarg_names, "mlp_in": mlp_in}


def case_read_logits(model, remote, blocking):
    prompt = PROMPT
    with model.trace(prompt, **rk(model, remote, blocking)):
        head = model.lm_head.output.save()
        logits = model.output.logits.save()
        next_token = model.output.logits[0, -1].argmax(dim=-1).save()
    assert torch.equal(head, logits)
    return {"head": head, "logits": logits, "next_token": next_token}


def case_zero_output(model, remote, blocking):
    # In-place edits on slices of two outputs; read downstream. (Not a whole output:
    # the random init has zero biases, so an all-zero hidden state stays zero and
    # the downstream reads would show nothing.)
    prompt = PROMPT
    with model.trace(prompt, **rk(model, remote, blocking)):
        model.transformer.h[0].output[:, -1] = 0
        zeroed = model.transformer.h[0].output.save()
        model.transformer.h[2].output[:, :2] = 0
        sliced = model.transformer.h[2].output.save()
        downstream = model.transformer.h[3].output.save()
        logits = model.output.logits.save()
    assert (zeroed[:, -1] == 0).all() and (zeroed[:, :-1] != 0).any()
    assert (sliced[:, :2] == 0).all() and (sliced[:, 2:] != 0).any()
    return {"zeroed": zeroed, "sliced": sliced, "downstream": downstream, "logits": logits}


def case_replace_output(model, remote, blocking):
    # Replacing (setter) edits: an output, an input, and a setitem on an input.
    prompt = PROMPT
    with model.trace(prompt, **rk(model, remote, blocking)):
        model.transformer.h[1].output = model.transformer.h[1].output * 0.5
        replaced = model.transformer.h[1].output.save()
        model.transformer.h[2].input = model.transformer.h[2].input * 2
        doubled = model.transformer.h[2].input.save()
        model.transformer.h[3].mlp.input[:, -1] = 0
        mlp_in = model.transformer.h[3].mlp.input.save()
        logits = model.output.logits.save()
    assert (mlp_in[:, -1] == 0).all()
    return {"replaced": replaced, "doubled": doubled, "mlp_in": mlp_in, "logits": logits}


def case_logit_lens(model, remote, blocking):
    # Calling modules inside a trace, and a user's own function (shipped by value).
    prompt = PROMPT
    with model.trace(prompt, **rk(model, remote, blocking)):
        hidden = model.transformer.h[6].output
        lens_logits = model.lm_head(model.transformer.ln_f(hidden)).save()
        lens_tokens = lens_logits.argmax(dim=-1).save()
        score = local_norm_score(hidden).save()
    return {"lens_logits": lens_logits, "lens_tokens": lens_tokens, "score": score}


def case_source_read(model, remote, blocking):
    prompt = PROMPT
    with model.trace(prompt, **rk(model, remote, blocking)):
        mlp = model.transformer.h[0].mlp.source
        fc_out = mlp.self_c_fc_0.output.save()
        act_in = mlp.self_act_0.input.save()
        act_out = mlp.self_act_0.output.save()
        proj_in = mlp.self_c_proj_0.input.save()
        # 0.6/0.7 number the attention call attention_interface_0 (0.8 counts differently).
        attn_out = model.transformer.h[1].attn.source.attention_interface_0.output[0].save()
    assert torch.equal(fc_out, act_in) and torch.equal(act_out, proj_in)
    return {"fc_out": fc_out, "act_in": act_in, "act_out": act_out, "proj_in": proj_in, "attn_out": attn_out}


def case_source_edit(model, remote, blocking):
    prompt = PROMPT
    with model.trace(prompt, **rk(model, remote, blocking)):
        model.transformer.h[0].mlp.source.self_act_0.output[:] = 0
        act = model.transformer.h[0].mlp.source.self_act_0.output.save()
        proj = model.transformer.h[1].mlp.source.self_c_proj_0
        proj.input = proj.input * 2
        proj_in = proj.input.save()
        mlp_out = model.transformer.h[1].mlp.output.save()
        logits = model.output.logits.save()
    assert (act == 0).all()
    return {"act": act, "proj_in": proj_in, "mlp_out": mlp_out, "logits": logits}


def case_source_skip(model, remote, blocking):
    # Unsupported by 0.6.3 and 0.7.0 (see UNSUPPORTED): kept for the day a later client has it.
    prompt = PROMPT
    with model.trace(prompt, **rk(model, remote, blocking)):
        mlp = model.transformer.h[0].mlp.source
        mlp.self_act_0.skip(mlp.self_c_fc_0.output * 0.5)
        act = mlp.self_act_0.output.save()
        logits = model.output.logits.save()
    return {"act": act, "logits": logits}


def case_module_skip(model, remote, blocking):
    prompt = PROMPT
    with model.trace(prompt, **rk(model, remote, blocking)):
        block_in = model.transformer.h[1].input.save()
        model.transformer.h[1].skip(model.transformer.h[1].input)
        block_out = model.transformer.h[1].output.save()
        mlp = model.transformer.h[4].mlp
        mlp.skip(torch.zeros_like(mlp.input))
        mlp_out = mlp.output.save()
        logits = model.output.logits.save()
    assert torch.equal(block_in, block_out) and (mlp_out == 0).all()
    return {"block_in": block_in, "block_out": block_out, "mlp_out": mlp_out, "logits": logits}


def case_early_stop(model, remote, blocking):
    prompt = PROMPT
    with model.trace(prompt, **rk(model, remote, blocking)) as tracer:
        h0 = model.transformer.h[0].output.save()
        h1_mean = model.transformer.h[1].output.mean().save()
        tracer.stop()
    return {"h0": h0, "h1_mean": h1_mean}


# 0.5 steps through a generation in a with block (``with tracer.iter[:]:``), 0.6 and later in a for loop.
STEPS_IN_WITH_BLOCK = VERSION.startswith("0.5.")


def case_generate_iter(model, remote, blocking):
    if STEPS_IN_WITH_BLOCK:
        return generate_iter_in_with_block(model, remote, blocking)
    prompt = PROMPT
    with model.generate(prompt, **GEN, **rk(model, remote, blocking)) as tracer:
        hiddens = nnsight.save([])
        tokens = nnsight.save([])
        for step in tracer.iter[:]:  # bounded by max_new_tokens in 0.6/0.7
            hiddens.append(model.transformer.h[0].output[:, -1])
            tokens.append(model.lm_head.output[:, -1].argmax(dim=-1))
        ids = tracer.result.save()
    assert len(hiddens) == len(tokens) == GEN["max_new_tokens"], (len(hiddens), len(tokens))
    return {"hiddens": hiddens, "tokens": tokens, "ids": ids}


def generate_iter_in_with_block(model, remote, blocking):
    prompt = PROMPT
    with model.generate(prompt, **GEN, **rk(model, remote, blocking)) as tracer:
        hiddens = nnsight.save([])
        tokens = nnsight.save([])
        with tracer.iter[:]:
            hiddens.append(model.transformer.h[0].output[:, -1])
            tokens.append(model.lm_head.output[:, -1].argmax(dim=-1))
        ids = tracer.result.save()
    assert len(hiddens) == len(tokens) == GEN["max_new_tokens"], (len(hiddens), len(tokens))
    return {"hiddens": hiddens, "tokens": tokens, "ids": ids}


def case_generate_all(model, remote, blocking):
    if STEPS_IN_WITH_BLOCK:
        return generate_all_in_with_block(model, remote, blocking)
    prompt = PROMPT
    with model.generate(prompt, **GEN, **rk(model, remote, blocking)) as tracer:
        steps = nnsight.save([])
        for step in tracer.all():
            model.transformer.h[2].output[:, -1] = 0  # an edit at every step
            steps.append(model.lm_head.output[:, -1].max(dim=-1).values)
        ids = tracer.result.save()
    assert len(steps) == GEN["max_new_tokens"], len(steps)
    return {"steps": steps, "ids": ids}


def generate_all_in_with_block(model, remote, blocking):
    prompt = PROMPT
    with model.generate(prompt, **GEN, **rk(model, remote, blocking)) as tracer:
        steps = nnsight.save([])
        with tracer.all():
            model.transformer.h[2].output[:, -1] = 0  # an edit at every step
            steps.append(model.lm_head.output[:, -1].max(dim=-1).values)
        ids = tracer.result.save()
    assert len(steps) == GEN["max_new_tokens"], len(steps)
    return {"steps": steps, "ids": ids}


def case_gradients(model, remote, blocking):
    prompt = PROMPT
    with model.trace(prompt, **rk(model, remote, blocking)):
        activation = model.transformer.h[2].output
        activation.requires_grad_(True)
        loss = model.output.logits[:, -1].logsumexp(dim=-1).sum()
        loss_value = loss.detach().save()
        with loss.backward():
            grad = activation.grad.save()
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    return {"loss_value": loss_value, "grad": grad}


def case_gradients_two(model, remote, blocking):
    # Two gradients read in reverse order of the forward pass (the order backward reaches them).
    prompt = PROMPT
    with model.trace(prompt, **rk(model, remote, blocking)):
        early = model.transformer.h[1].output
        early.requires_grad_(True)
        late = model.transformer.h[4].output
        late.requires_grad_(True)
        loss = model.output.logits.sum()
        with loss.backward():
            late_grad = late.grad.save()
            early_grad = early.grad.save()
    return {"late_grad": late_grad, "early_grad": early_grad}


def case_session(model, remote, blocking):
    prompt, prompt2 = PROMPT, PROMPT2
    with model.session(**rk(model, remote, blocking)):
        with model.trace(prompt):
            donor = model.transformer.h[4].output[:, -1, :]
            donor_logits = model.output.logits[:, -1].save()
        with model.trace(prompt2):
            model.transformer.h[4].output[:, -1, :] = donor
            patched = model.transformer.h[4].output[:, -1, :].save()
            patched_logits = model.output.logits[:, -1].save()
        with model.trace(prompt2):
            clean_logits = model.output.logits[:, -1].save()
    assert not torch.equal(patched_logits, clean_logits)
    return {"donor_logits": donor_logits, "patched": patched, "patched_logits": patched_logits,
            "clean_logits": clean_logits}


def case_cache_all(model, remote, blocking):
    prompt = PROMPT
    with model.trace(prompt, **rk(model, remote, blocking)) as tracer:
        cache = tracer.cache()
    for layer in range(len(model.transformer.h)):
        assert cache[f"model.transformer.h.{layer}"].output is not None
    return {"cache": cache}


def case_cache_modules(model, remote, blocking):
    prompt = PROMPT
    with model.trace(prompt, **rk(model, remote, blocking)) as tracer:
        blocks = tracer.cache(modules=[model.transformer.h[3], "model.transformer.h.7"])
        mlps = tracer.cache(modules=[model.transformer.h[5].mlp, "model.transformer.ln_f"], include_inputs=True)
        model.transformer.h[3].output[:, 0] = 0  # caches record post-intervention values
    assert sorted(dict.keys(blocks)) == ["model.transformer.h.3", "model.transformer.h.7"], list(dict.keys(blocks))
    assert (blocks["model.transformer.h.3"].output[:, 0] == 0).all()
    assert mlps["model.transformer.ln_f"].inputs is not None
    return {"blocks": blocks, "mlps": mlps}


def case_batched_invokes(model, remote, blocking):
    prompt, prompt2 = PROMPT, PROMPT2
    with model.trace(**rk(model, remote, blocking)) as tracer:
        with tracer.invoke(prompt):
            a_hidden = model.transformer.h[2].output.save()
            a_last = model.lm_head.output[:, -1].save()
            a_logits = model.output.logits.save()
        with tracer.invoke(prompt2):
            b_hidden = model.transformer.h[2].output.save()
            b_last = model.lm_head.output[:, -1].save()
    # Submodule values are the invoke's own row; in 0.6/0.7 the root model's
    # output is not narrowed to the invoke: it is the whole batch (0.8 narrows it).
    assert a_last.shape == b_last.shape == (1, a_last.shape[-1]) and a_logits.shape[0] == 2
    return {"a_hidden": a_hidden, "a_last": a_last, "a_logits": a_logits, "b_hidden": b_hidden, "b_last": b_last}


def case_invoke_isolation(model, remote, blocking):
    prompt = PROMPT
    with model.trace(**rk(model, remote, blocking)) as tracer:
        with tracer.invoke(prompt):
            model.transformer.h[0].output[:] = 0
            edited = model.transformer.h[0].output.save()
            edited_logits = model.output.logits[:, -1].save()
        with tracer.invoke(prompt):
            clean = model.transformer.h[0].output.save()
            clean_logits = model.output.logits[:, -1].save()
        with tracer.invoke():
            whole_batch = model.output.logits[:, -1].save()
    assert (edited == 0).all() and (clean != 0).any() and whole_batch.shape[0] == 2
    return {"edited": edited, "edited_logits": edited_logits, "clean": clean, "clean_logits": clean_logits,
            "whole_batch": whole_batch}


def case_prompt_list(model, remote, blocking):
    prompts = [PROMPT, PROMPT2]
    with model.trace(prompts, **rk(model, remote, blocking)):
        hidden = model.transformer.h[5].output.save()
        logits = model.output.logits.save()
    assert logits.shape[0] == 2
    return {"hidden": hidden, "logits": logits}


def case_rename(model, remote, blocking):
    prompt = PROMPT
    rename = {"transformer.h": "layers", "transformer.ln_f": "final_norm"}
    m = LanguageModel(REPO, tokenizer=model.tokenizer, rename=rename)
    with m.trace(prompt, **rk(m, remote, blocking)):
        m.layers[2].output[:, -1] = 0
        edited = m.layers[2].output.save()
        after = m.transformer.h[3].output.save()
        norm = m.final_norm.output.save()
    assert (edited[:, -1] == 0).all()
    return {"edited": edited, "after": after, "norm": norm}


def case_edit_copy(model, remote, blocking):
    prompt = PROMPT
    with model.edit() as edited:
        edited.transformer.h[0].output[:, -1] = 0
    with edited.trace(prompt, **rk(edited, remote, blocking)):
        edited_h0 = edited.transformer.h[0].output.save()
        edited_logits = edited.output.logits.save()
    with model.trace(prompt, **rk(model, remote, blocking)):
        h0 = model.transformer.h[0].output.save()
    assert (edited_h0[:, -1] == 0).all() and (h0[:, -1] != 0).any()
    return {"edited_h0": edited_h0, "edited_logits": edited_logits, "h0": h0}


def case_save_computed(model, remote, blocking):
    # Plain Python values saved from a trace.
    prompt = PROMPT
    with model.trace(prompt, **rk(model, remote, blocking)):
        mean = model.transformer.h[-1].output.mean().save()
        shape = nnsight.save(tuple(model.transformer.h[-1].output.shape))
        peak = nnsight.save(model.output.logits[0, -1].max().item())
        top3 = nnsight.save(model.output.logits[0, -1].topk(3).indices.tolist())
    assert isinstance(peak, float) and isinstance(top3, list) and mean.ndim == 0
    return {"mean": mean, "peak": peak, "top3": top3, "shape": shape}


# ---------------------------------------------------------------------------
# Run the named case twice and report
# ---------------------------------------------------------------------------

def report(**fields):
    print(json.dumps({"version": VERSION, "case": CASE, "mode": MODE, **fields}, default=str), flush=True)
    print("", flush=True)  # ends the status line the client draws without an end


def clone(value, memo):
    """A deep copy of a saved value that owns its tensors (detached clones).

    Not copy.deepcopy: it refuses tensors that are not graph leaves (the keys and
    values in a cached DynamicCache), and 0.6.3's CacheDict recurses forever in
    it (its __getattr__ reads attributes a bare copy does not have yet). Dicts
    (of any class), lists, tuples and objects with a __dict__ are rebuilt
    without calling their __init__; anything else (str, int, torch.Size, ...) is
    kept as it is."""
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, torch.Tensor):
        out = memo[id(value)] = value.detach().clone()
        return out
    if isinstance(value, tuple):
        items = [clone(item, memo) for item in value]
        if type(value) is tuple:
            out = tuple(items)
        elif hasattr(value, "_fields"):  # a namedtuple
            out = type(value)(*items)
        else:  # torch.Size and other immutable tuples
            out = value
        memo[id(value)] = out
        return out
    if isinstance(value, list):
        out = memo[id(value)] = type(value)()
        out.extend(clone(item, memo) for item in value)
        return out
    if isinstance(value, (type, torch.nn.Module)) or not (isinstance(value, dict) or hasattr(value, "__dict__")):
        return value
    try:
        out = type(value).__new__(type(value))
    except Exception:
        return value
    memo[id(value)] = out
    if hasattr(value, "__dict__"):
        out.__dict__.update({key: clone(item, memo) for key, item in value.__dict__.items()})
    if isinstance(value, dict):
        # OrderedDict (a transformers ModelOutput) keeps its own order: set items through it.
        ordered = isinstance(value, collections.OrderedDict)
        setitem = collections.OrderedDict.__setitem__ if ordered else dict.__setitem__
        for key in dict.keys(value):
            setitem(out, key, clone(dict.__getitem__(value, key), memo))
    return out


def snapshot(saved):
    """The saved values as they are now, unaffected by what happens to the originals later."""
    memo = {}
    return {name: clone(value, memo) for name, value in saved.items()}


def attempt(fn, model, remote, where):
    try:
        return fn(model, remote, MODE == "blocking"), None
    except BaseException as error:
        traceback.print_exc(file=sys.stderr)
        return None, {"error": type(error).__name__, "said": str(error)[:4000], "where": where,
                      "trace": traceback.format_exc()[-4000:]}


def main(CASE):
    if CASE not in CASES:
        report(error="KeyError", said=f"no case {CASE!r}; known: {CASES}", where="harness")
        return
    reason = UNSUPPORTED.get(VERSION, {}).get(CASE)
    if reason:
        report(unsupported=reason)
        return
    fn = globals()["case_" + CASE]
    model = LanguageModel(REPO)
    first, failed = attempt(fn, model, False, "local")
    if failed:
        report(**failed)
        return
    # Compare what the user had when the first run ended: a value may change
    # afterwards (0.7.0's tracer.cache() hooks outlive their trace and keep
    # appending to the cache on every later local forward pass).
    kept = snapshot(first)
    second_remote = {"local-only": False, "simulate": "simulate"}.get(MODE, True)
    second, failed = attempt(fn, model, second_remote, "remote" if second_remote else "local")
    if failed:
        report(**failed)
        return
    differences = []
    for name in kept:
        if name not in second:
            differences.append(f"{name}: missing from the second run")
            continue
        found = diff(kept[name], second[name], name)
        if found:
            differences.append(found)
    differences += [f"{name}: only in the second run" for name in second if name not in kept]
    changed_later = [found for name in kept for found in [diff(kept[name], first[name], name)] if found]
    report(equal=not differences, differences=differences, names=list(first), first_changed_later=changed_later)


for CASE in CASE_LIST.split(","):  # each case with a model of its own: what one leaves on it stays there
    main(CASE)
'''

_STRUCTURE = {
    "__PROMPT__": repr(PROMPTS[0]),
    "__PROMPT2__": repr(PROMPTS[1]),
    "__UNSUPPORTED__": repr(UNSUPPORTED),
    "__CASES__": repr(CASES),
}
for _key, _value in _STRUCTURE.items():
    SCRIPT = SCRIPT.replace(_key, _value)


def run_case(python: Path | str, host: str, case: str, mode: str, env: dict | None = None,
             repo_id: str | None = None, timeout_s: float = 300) -> dict:
    """Run ``case`` under the client interpreter ``python``; its JSON report.

    ``host`` is the farm's URL (unused in ``local-only`` and ``simulate``).
    ``env`` adds to (or overrides) this process's environment for the run, e.g.
    ``HF_HOME`` and ``HF_HUB_OFFLINE`` for the tests' offline model cache.
    """
    from tests.support.cases.tiny_model import REPO_ID

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {MODES}")
    with mock.patch.dict(os.environ, env or {}):
        return client_envs.run(Path(python), SCRIPT, host, repo_id or REPO_ID, case, mode, timeout_s=timeout_s)


def run_cases(python: Path | str, host: str, cases: list, mode: str, env: dict | None = None,
              repo_id: str | None = None, timeout_s: float = 600) -> list[dict]:
    """Every case of ``cases`` in one process of the client interpreter; a report each."""
    from tests.support.cases.tiny_model import REPO_ID

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {MODES}")
    with mock.patch.dict(os.environ, env or {}):
        return client_envs.run_all(Path(python), SCRIPT, host, repo_id or REPO_ID, ",".join(cases), mode,
                                   timeout_s=timeout_s)


if __name__ == "__main__":  # python -m tests.support.cases.old_client_cases PYTHON MODE [CASE...]
    import sys

    python, mode, *names = sys.argv[1:]
    for name in names or CASES:
        print(json.dumps(run_case(python, "http://127.0.0.1:9", name, mode)), flush=True)
