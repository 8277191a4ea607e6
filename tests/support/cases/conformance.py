"""Conformance cases every remote backend must pass.

Each case is a function ``case_<name>(model, remote, tmp_path) -> dict``:

* ``model`` is the shared client model (``tiny_model.client_model()``);
* ``remote(m)`` returns the extra kwargs for the *outermost* ``m.trace(...)`` /
  ``m.generate(...)`` / ``m.session(...)`` of a block (``{}`` locally,
  ``{"remote": True}``, ``{"remote": "local"}`` or ``{"backend": ...}`` otherwise).
  Inner traces of a session and ``model.edit()`` blocks get nothing; a case that
  builds its own model (renames, edited copies) passes ``remote(that_model)``;
* ``tmp_path`` is a fresh folder the case may write to.

It returns ``{name: value}`` of everything its blocks saved, so the same case
run through two backends can be compared with `same` / `assert_same` (an exact,
recursive comparison). Light sanity assertions inside a case catch a backend that
silently ignores an intervention even when there is no reference run to compare
with. Every case is deterministic: two local runs give `same` results.

Written for nnsight 0.8.1 (`with model.trace(..., remote=True)`), modelled on the
feature list of NDIF's remote conformance tests.

Why one file of ~800 lines: it is a catalogue, ~40 independent cases of 10-20
lines each under a heading per feature, read one at a time; and the cases'
helpers reach the farm by value with this module (``_this_module_by_value``).
Split into several modules, each would have to be registered for pickling by
value, and a case whose module was not would be pickled by reference and fail
only remotely.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import sys
import textwrap
import uuid
import warnings
from typing import Any, Callable

import nnsight
import torch
from nnsight.intervention.cache import Cache, CacheView

from tests.support.cases.tiny_model import HIDDEN, N_LAYER, PROMPT, PROMPTS, REPO_ID, VOCAB, client_model

__all__ = [
    "CASES",
    "HIDDEN",
    "N_LAYER",
    "PROMPT",
    "PROMPT2",
    "REPO_ID",
    "VOCAB",
    "assert_same",
    "diff",
    "same",
]

#: A second prompt, of a different token length than PROMPT (batching pads it).
PROMPT2 = PROMPTS[1]

GEN = dict(max_new_tokens=4, do_sample=False)


# --------------------------------------------------------------------------------
# Exact comparison
# --------------------------------------------------------------------------------


def _tensor_diff(a: torch.Tensor, b: torch.Tensor, path: str) -> str | None:
    if a.dtype != b.dtype:
        return f"{path}: dtype {a.dtype} != {b.dtype}"
    if a.shape != b.shape:
        return f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    a = a.detach().cpu()
    b = b.detach().cpu()
    if a.is_floating_point() or a.is_complex():
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        if not torch.equal(nan_a, nan_b):
            return f"{path}: NaN positions differ"
        a, b = a[~nan_a], b[~nan_b]
    if not torch.equal(a, b):
        if a.numel() and (a.is_floating_point() or a.is_complex()):
            worst = (a - b).abs().max().item()
            return f"{path}: tensor values differ (max abs diff {worst!r})"
        return f"{path}: tensor values differ"
    return None


def _plain_object(value: Any) -> bool:
    """An object with identity equality whose state is its ``__dict__``."""
    return type(value).__eq__ is object.__eq__ and hasattr(value, "__dict__")


def diff(a: Any, b: Any, path: str = "result", _seen: set | None = None) -> str | None:
    """The first difference between ``a`` and ``b`` (a readable sentence), or None.

    Exact and recursive:

    * tensors: same dtype, same shape and ``torch.equal`` values (NaNs equal where
      both are NaN; device and ``requires_grad`` are ignored);
    * lists / tuples: same type and length, elementwise; dicts (and ModelOutput,
      an OrderedDict) by the same key set, valuewise;
    * nnsight cache objects (``tracer.cache()`` returns a ``CacheView`` over a
      ``Cache``) by their recorded entries: per module path, per visit, the
      captured output and inputs (the live model a local cache keeps is ignored);
    * dataclasses field by field; other objects with identity equality (e.g. a
      transformers ``DynamicCache``) by their ``__dict__``;
    * anything else by type and ``==`` (floats: NaN equals NaN, no tolerance).
    """
    seen = set() if _seen is None else _seen
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {type(a).__name__} != {type(b).__name__}"
        return _tensor_diff(a, b, path)

    if type(a) is not type(b):
        return f"{path}: type {type(a).__qualname__} != {type(b).__qualname__}"

    if a is b:
        return None
    key = (id(a), id(b))
    if key in seen:  # a cycle already under comparison
        return None

    if isinstance(a, dict):
        seen.add(key)
        missing, extra = [k for k in a if k not in b], [k for k in b if k not in a]
        if missing or extra:
            return f"{path}: keys differ (only left: {missing!r}, only right: {extra!r})"
        for k in a:
            found = diff(a[k], b[k], f"{path}[{k!r}]", seen)
            if found:
                return found
        return None

    if isinstance(a, (list, tuple)):
        seen.add(key)
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = diff(x, y, f"{path}[{i}]", seen)
            if found:
                return found
        return None

    if isinstance(a, CacheView):
        if a._node_path() != b._node_path():
            return f"{path}: cache view of {a._node_path()!r} != {b._node_path()!r}"
        return diff(a._cache, b._cache, f"{path}<cache>", seen)

    if isinstance(a, Cache):
        seen.add(key)
        for attr in ("targets", "include_output", "include_inputs", "dtype", "detach"):
            found = diff(getattr(a, attr), getattr(b, attr), f"{path}.{attr}", seen)
            if found:
                return found
        return diff(a.entries, b.entries, f"{path}.entries", seen)

    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        seen.add(key)
        for field in dataclasses.fields(a):
            found = diff(
                getattr(a, field.name), getattr(b, field.name), f"{path}.{field.name}", seen
            )
            if found:
                return found
        return None

    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return None

    if _plain_object(a):
        seen.add(key)
        return diff(vars(a), vars(b), f"{path}<{type(a).__name__}>", seen)

    try:
        equal = bool(a == b)
    except Exception as error:  # noqa: BLE001 - e.g. an ambiguous truth value
        return f"{path}: cannot compare {type(a).__name__} values ({error})"
    return None if equal else f"{path}: {a!r} != {b!r}"


def same(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are exactly the same results (see `diff`)."""
    return diff(a, b) is None


def assert_same(a: Any, b: Any, label: str = "result") -> None:
    """Raise AssertionError naming the first difference, if any (see `diff`)."""
    found = diff(a, b, label)
    if found is not None:
        raise AssertionError(found)


# --------------------------------------------------------------------------------
# Helpers used by the cases
# --------------------------------------------------------------------------------

#: Module-level state referenced (indirectly) by a helper shipped by value.
_LOCAL_SCALE = 3.0


def _centre(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(dim=-1, keepdim=True)


def local_norm_score(x: torch.Tensor) -> torch.Tensor:
    """Local helper code (this module is not installed): must ship by value."""
    return _centre(x).norm(dim=-1) * _LOCAL_SCALE


@contextlib.contextmanager
def _pull_env_rearmed():
    """Re-arm nnsight's one-shot local-module scan for the enclosed requests.

    ``pull_env()`` registers every importable non-installed module for pickling
    by value, but only on the first remote request of a process; resetting
    ``nnsight.ndif._PULLED_ENV`` makes the next request rescan (and find modules
    that appeared since). If no remote request ran, the flag is left as it was.
    """
    import nnsight.ndif as ndif

    before = ndif._PULLED_ENV
    ndif._PULLED_ENV = False
    try:
        yield
    finally:
        ndif._PULLED_ENV = ndif._PULLED_ENV or before


@contextlib.contextmanager
def _this_module_by_value():
    """Make sure this module's own functions ship by value.

    ``pull_env()`` finds it when it is imported as the top-level module
    ``conformance`` (``tests/`` on ``sys.path``, as pytest arranges). Imported as
    ``tests.support.cases.conformance`` (a namespace package, which ``pull_env``'s
    ``pkgutil.iter_modules`` scan does not list) it would be pickled by
    reference; register it the way a user would, with ``nnsight.register``.
    """
    from cloudpickle.cloudpickle import _PICKLE_BY_VALUE_MODULES

    added = "." in __name__ and __name__ not in _PICKLE_BY_VALUE_MODULES
    if added:
        nnsight.register(__name__)
    try:
        yield
    finally:
        if added:
            _PICKLE_BY_VALUE_MODULES.discard(__name__)


def _own_model(model, **kwargs):
    """Another client model on the same checkpoint (renames etc.)."""
    kwargs.setdefault("tokenizer", model.tokenizer)
    return client_model(model.repo_id, revision=model.revision, **kwargs)


# --------------------------------------------------------------------------------
# Cases: reading
# --------------------------------------------------------------------------------


def case_read_outputs(model, remote, tmp_path):
    with model.trace(PROMPT, **remote(model)):
        first = model.transformer.h[0].output.save()
        attn = model.transformer.h[1].attn.output[0].save()
        last = model.transformer.h[-1].output.save()
        final = model.transformer.ln_f.output.save()
    assert first.shape[-1] == last.shape[-1] == final.shape[-1]
    return {"first": first, "attn": attn, "last": last, "final": final}


def case_read_inputs(model, remote, tmp_path):
    with model.trace(PROMPT, **remote(model)):
        token_ids = model.transformer.wte.input.save()
        block_in = model.transformer.h[0].input.save()
        inputs = model.transformer.h[2].inputs
        positional = inputs[0][0].save()
        position_ids = inputs[1]["position_ids"].save()
        kwarg_names = nnsight.save(sorted(inputs[1]))
        mlp_in = model.transformer.h[2].mlp.input.save()
    assert token_ids.dtype == torch.long and token_ids.shape[0] == 1
    return {
        "token_ids": token_ids,
        "block_in": block_in,
        "positional": positional,
        "position_ids": position_ids,
        "kwarg_names": kwarg_names,
        "mlp_in": mlp_in,
    }


def case_read_logits(model, remote, tmp_path):
    with model.trace(PROMPT, **remote(model)):
        head = model.lm_head.output.save()
        logits = model.output.logits.save()
        next_token = model.output.logits[0, -1].argmax(dim=-1).save()
    assert torch.equal(head, logits)
    return {"head": head, "logits": logits, "next_token": next_token}


# --------------------------------------------------------------------------------
# Cases: interventions
# --------------------------------------------------------------------------------


def case_zero_output(model, remote, tmp_path):
    with model.trace(PROMPT, **remote(model)):
        model.transformer.h[0].output[:] = 0
        zeroed = model.transformer.h[0].output.save()
        model.transformer.h[1].output = model.transformer.h[1].output * 0
        replaced = model.transformer.h[1].output.save()
        logits = model.output.logits.save()
    assert (zeroed == 0).all() and (replaced == 0).all()
    return {"zeroed": zeroed, "replaced": replaced, "logits": logits}


def case_set_input(model, remote, tmp_path):
    with model.trace(PROMPT, **remote(model)):
        model.transformer.h[1].input = model.transformer.h[1].input * 0.5
        halved = model.transformer.h[1].input.save()
        out1 = model.transformer.h[1].output.save()
        model.transformer.h[3].mlp.input[:, -1] = 0
        mlp_in = model.transformer.h[3].mlp.input.save()
        logits = model.output.logits.save()
    assert (mlp_in[:, -1] == 0).all()
    return {"halved": halved, "out1": out1, "mlp_in": mlp_in, "logits": logits}


def case_partial_slice_edit(model, remote, tmp_path):
    with model.trace(PROMPT, **remote(model)):
        model.transformer.h[0].output[:, :2] = 0
        edited = model.transformer.h[0].output.save()
        downstream = model.transformer.h[3].output.save()
        logits = model.output.logits.save()
    with model.trace(PROMPT, **remote(model)):
        clean_downstream = model.transformer.h[3].output.save()
    assert (edited[:, :2] == 0).all() and (edited[:, 2:] != 0).any()
    assert not torch.equal(downstream, clean_downstream)
    return {
        "edited": edited,
        "downstream": downstream,
        "logits": logits,
        "clean_downstream": clean_downstream,
    }


def case_early_stop(model, remote, tmp_path):
    with model.trace(PROMPT, **remote(model)) as tracer:
        h0 = model.transformer.h[0].output.save()
        h1_mean = model.transformer.h[1].output.mean().save()
        tracer.stop()
    return {"h0": h0, "h1_mean": h1_mean}


def case_logit_lens(model, remote, tmp_path):
    middle = len(model.transformer.h) // 2
    with model.trace(PROMPT, **remote(model)):
        hidden = model.transformer.h[middle].output
        lens_logits = model.lm_head(model.transformer.ln_f(hidden)).save()
        lens_tokens = lens_logits.argmax(dim=-1).save()
        final_tokens = model.output.logits.argmax(dim=-1).save()
    assert lens_tokens.shape == final_tokens.shape
    return {"lens_logits": lens_logits, "lens_tokens": lens_tokens, "final_tokens": final_tokens}


# --------------------------------------------------------------------------------
# Cases: .source (operation level)
# --------------------------------------------------------------------------------


def case_source_read(model, remote, tmp_path):
    with model.trace(PROMPT, **remote(model)):
        mlp = model.transformer.h[0].mlp.source
        fc_out = mlp.self_c_fc_0.output.save()
        act_in = mlp.self_act_0.input.save()
        act_out = mlp.self_act_0.output.save()
        proj_in = mlp.self_c_proj_0.input.save()
        attn_out = model.transformer.h[1].attn.source.attention_interface_1.output[0].save()
    assert torch.equal(fc_out, act_in) and torch.equal(act_out, proj_in)
    return {
        "fc_out": fc_out,
        "act_in": act_in,
        "act_out": act_out,
        "proj_in": proj_in,
        "attn_out": attn_out,
    }


def case_source_edit(model, remote, tmp_path):
    with model.trace(PROMPT, **remote(model)):
        model.transformer.h[0].mlp.source.self_act_0.output[:] = 0
        act = model.transformer.h[0].mlp.source.self_act_0.output.save()
        proj = model.transformer.h[1].mlp.source.self_c_proj_0
        proj.input = proj.input * 2
        proj_in = proj.input.save()
        mlp_out = model.transformer.h[1].mlp.output.save()
        logits = model.output.logits.save()
    assert (act == 0).all()
    return {"act": act, "proj_in": proj_in, "mlp_out": mlp_out, "logits": logits}


def case_source_skip(model, remote, tmp_path):
    with model.trace(PROMPT, **remote(model)):
        mlp = model.transformer.h[0].mlp.source
        linear = mlp.self_c_fc_0.output
        mlp.self_act_0.skip(linear * 0.5)
        act = mlp.self_act_0.output.save()
        block = model.transformer.h[0].output.save()
        logits = model.output.logits.save()
    return {"act": act, "block": block, "logits": logits}


# --------------------------------------------------------------------------------
# Cases: aliases and module skip
# --------------------------------------------------------------------------------


def case_rename_layers(model, remote, tmp_path):
    m = _own_model(model, rename={"transformer.h": "layers"})
    assert m.layers[0] is m.transformer.h[0]
    with m.trace(PROMPT, **remote(m)):
        m.layers[2].output[:, -1] = 0
        edited = m.layers[2].output.save()
        after = m.transformer.h[3].output.save()
        logits = m.output.logits.save()
    assert (edited[:, -1] == 0).all()
    return {"edited": edited, "after": after, "logits": logits}


def case_rename_deep_path(model, remote, tmp_path):
    m = _own_model(model, rename={"transformer.h.3.mlp": "mid_mlp", "transformer.ln_f": "final_norm"})
    assert m.mid_mlp is m.transformer.h[3].mlp
    with m.trace(PROMPT, **remote(m)):
        via_path = m.transformer.h[3].mlp.input.save()
        via_alias = m.mid_mlp.input.save()
        m.mid_mlp.output = m.mid_mlp.output * 2
        block = m.transformer.h[3].output.save()
        norm = m.final_norm.output.save()
    assert torch.equal(via_path, via_alias)
    return {"via_path": via_path, "via_alias": via_alias, "block": block, "norm": norm}


def case_module_skip(model, remote, tmp_path):
    with model.trace(PROMPT, **remote(model)):
        block_in = model.transformer.h[1].input.save()
        model.transformer.h[1].skip(model.transformer.h[1].input)
        block_out = model.transformer.h[1].output.save()
        mlp = model.transformer.h[4].mlp
        mlp.skip(torch.zeros_like(mlp.input))
        mlp_out = mlp.output.save()
        logits = model.output.logits.save()
    assert torch.equal(block_in, block_out) and (mlp_out == 0).all()
    return {"block_in": block_in, "block_out": block_out, "mlp_out": mlp_out, "logits": logits}


# --------------------------------------------------------------------------------
# Cases: sessions
# --------------------------------------------------------------------------------


def case_session(model, remote, tmp_path):
    with model.session(**remote(model)):
        with model.trace(PROMPT):
            donor = model.transformer.h[4].output[:, -1, :]
            donor_logits = model.output.logits[:, -1].save()
        with model.trace(PROMPT2):
            model.transformer.h[4].output[:, -1, :] = donor
            patched = model.transformer.h[4].output[:, -1, :].save()
            patched_logits = model.output.logits[:, -1].save()
        with model.trace(PROMPT2):
            clean_logits = model.output.logits[:, -1].save()
    assert not torch.equal(patched_logits, clean_logits)
    return {
        "donor_logits": donor_logits,
        "patched": patched,
        "patched_logits": patched_logits,
        "clean_logits": clean_logits,
    }


# --------------------------------------------------------------------------------
# Cases: generation
# --------------------------------------------------------------------------------


def case_generate_result(model, remote, tmp_path):
    with model.generate(PROMPT, **GEN, **remote(model)) as tracer:
        ids = tracer.result.save()
    assert ids.shape[0] == 1 and ids.shape[1] > GEN["max_new_tokens"]
    return {"ids": ids}


def case_generate_iter(model, remote, tmp_path):
    with model.generate(PROMPT, **GEN, **remote(model)) as tracer:
        hiddens = nnsight.save([])
        tokens = nnsight.save([])
        for step in tracer.iter[:3]:
            hiddens.append(model.transformer.h[0].output[:, -1])
            tokens.append(model.lm_head.output[:, -1].argmax(dim=-1))
        ids = tracer.result.save()
    assert len(hiddens) == len(tokens) == 3
    return {"hiddens": hiddens, "tokens": tokens, "ids": ids}


def case_generator_output(model, remote, tmp_path):
    with warnings.catch_warnings():
        # model.generator.output is deprecated in favour of tracer.result.
        warnings.simplefilter("ignore", nnsight.NNsightDeprecationWarning)
        with model.generate(PROMPT, **GEN, **remote(model)) as tracer:
            through_generator = model.generator.output.save()
            ids = tracer.result.save()
    assert torch.equal(through_generator, ids)
    return {"through_generator": through_generator, "ids": ids}


def case_generate_streamer(model, remote, tmp_path):
    with model.generate(PROMPT, **GEN, **remote(model)) as tracer:
        streamed = nnsight.save([])
        for step in tracer.iter[:4]:
            streamed.append(model.generator.streamer.output)
        ids = tracer.result.save()
    assert len(streamed) == 4 and streamed[0].shape[-1] > 1 and streamed[1].shape[-1] == 1
    return {"streamed": streamed, "ids": ids}


# --------------------------------------------------------------------------------
# Cases: gradients
# --------------------------------------------------------------------------------


def case_grad_single(model, remote, tmp_path):
    with model.trace(PROMPT, **remote(model)):
        activation = model.transformer.h[2].output
        activation.requires_grad_(True)
        loss = model.output.logits[:, -1].logsumexp(dim=-1).sum()
        loss_value = loss.detach().save()
        with loss.backward():
            grad = activation.grad.save()
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    return {"loss_value": loss_value, "grad": grad}


def case_grad_two_backward_order(model, remote, tmp_path):
    with model.trace(PROMPT, **remote(model)):
        early = model.transformer.h[1].output
        early.requires_grad_(True)
        late = model.transformer.h[4].output
        late.requires_grad_(True)
        loss = model.output.logits.sum()
        with loss.backward():
            late_grad = late.grad.save()
            early_grad = early.grad.save()
    assert late_grad.shape == early_grad.shape
    return {"late_grad": late_grad, "early_grad": early_grad}


# --------------------------------------------------------------------------------
# Cases: tracer.cache()
# --------------------------------------------------------------------------------


def case_cache_all(model, remote, tmp_path):
    with model.trace(PROMPT, **remote(model)) as tracer:
        cache = tracer.cache()
    n = len(model.transformer.h)
    for layer in range(n):
        assert cache[f"model.transformer.h.{layer}"].output is not None
    return {"cache": cache}


def case_cache_modules(model, remote, tmp_path):
    with model.trace(PROMPT, **remote(model)) as tracer:
        blocks = tracer.cache(modules=[model.transformer.h[3], "model.transformer.h.7"])
        mlps = tracer.cache(
            modules=[model.transformer.h[5].mlp, "model.transformer.ln_f"],
            include_inputs=True,
        )
        model.transformer.h[3].output[:, 0] = 0  # caches record post-intervention values
    assert sorted(blocks.keys()) == ["model.transformer.h.3", "model.transformer.h.7"]
    assert "model.transformer.h.0" not in blocks
    assert (blocks["model.transformer.h.3"].output[:, 0] == 0).all()
    assert mlps["model.transformer.ln_f"].input is not None
    return {"blocks": blocks, "mlps": mlps}


# --------------------------------------------------------------------------------
# Cases: local code shipped by value
# --------------------------------------------------------------------------------


def case_local_function(model, remote, tmp_path):
    with _pull_env_rearmed(), _this_module_by_value():
        with model.trace(PROMPT, **remote(model)):
            score = local_norm_score(model.transformer.h[2].output).save()
    return {"score": score}


_HELPER_SOURCE = '''
"""Helper module written at test time: not installed, so it must ship by value."""
import torch

OFFSET = 0.25


def shifted_max(x):
    return x.max(dim=-1).values + OFFSET


class Scaler:
    def __init__(self, factor):
        self.factor = factor

    def scale(self, x):
        return x * self.factor

    def score(self, x):
        return torch.tanh(self.scale(x)).sum(dim=-1)
'''


def case_local_module(model, remote, tmp_path):
    # A unique, public name: sys.modules caches by name, and pull_env() skips
    # modules whose names start with an underscore.
    name = f"ndifc_shipped_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(_HELPER_SOURCE))
    sys.path.insert(0, str(tmp_path))
    try:
        helper = importlib.import_module(name)
        Scaler = helper.Scaler
        made_outside = Scaler(3)

        with _pull_env_rearmed():
            with model.trace(PROMPT, **remote(model)):
                hidden = model.transformer.h[1].output
                peak = helper.shifted_max(hidden).save()
                scaled = Scaler(5).scale(hidden.sum(dim=-1)).save()
                scored = made_outside.score(hidden).save()
    finally:
        if str(tmp_path) in sys.path:
            sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)
        from cloudpickle.cloudpickle import _PICKLE_BY_VALUE_MODULES

        _PICKLE_BY_VALUE_MODULES.discard(name)
    return {"peak": peak, "scaled": scaled, "scored": scored}


# --------------------------------------------------------------------------------
# Cases: edits
# --------------------------------------------------------------------------------


def case_edit_copy(model, remote, tmp_path):
    with model.edit() as (editor, edited):
        edited.transformer.h[0].output[:, -1] = 0
    with edited.trace(PROMPT, **remote(edited)):
        edited_h0 = edited.transformer.h[0].output.save()
        edited_logits = edited.output.logits.save()
    with model.trace(PROMPT, **remote(model)):
        h0 = model.transformer.h[0].output.save()
        logits = model.output.logits.save()
    assert not model._edits
    assert (edited_h0[:, -1] == 0).all() and (h0[:, -1] != 0).any()
    return {"edited_h0": edited_h0, "edited_logits": edited_logits, "h0": h0, "logits": logits}


# --------------------------------------------------------------------------------
# Cases: batching
# --------------------------------------------------------------------------------


def case_batched_invokes(model, remote, tmp_path):
    with model.trace(**remote(model)) as tracer:
        with tracer.invoke(PROMPT):
            a_hidden = model.transformer.h[2].output.save()
            a_last = model.output.logits[:, -1].save()
        with tracer.invoke(PROMPT2):
            b_hidden = model.transformer.h[2].output.save()
            b_last = model.output.logits[:, -1].save()
    with model.trace(PROMPT, **remote(model)):
        a_solo = model.output.logits[:, -1].save()
    with model.trace(PROMPT2, **remote(model)):
        b_solo = model.output.logits[:, -1].save()
    # Batched rows equal solo runs up to float reassociation (left padding).
    assert a_last.shape == a_solo.shape == b_last.shape == (1, a_last.shape[-1])
    assert torch.allclose(a_last, a_solo, atol=1e-5, rtol=1e-4)
    assert torch.allclose(b_last, b_solo, atol=1e-5, rtol=1e-4)
    assert torch.equal(a_last.argmax(-1), a_solo.argmax(-1))
    assert torch.equal(b_last.argmax(-1), b_solo.argmax(-1))
    return {
        "a_hidden": a_hidden,
        "a_last": a_last,
        "b_hidden": b_hidden,
        "b_last": b_last,
        "a_solo": a_solo,
        "b_solo": b_solo,
    }


def case_invoke_isolation(model, remote, tmp_path):
    with model.trace(**remote(model)) as tracer:
        with tracer.invoke(PROMPT):
            model.transformer.h[0].output[:] = 0
            edited = model.transformer.h[0].output.save()
            edited_logits = model.output.logits[:, -1].save()
        with tracer.invoke(PROMPT):
            clean = model.transformer.h[0].output.save()
            clean_logits = model.output.logits[:, -1].save()
        with tracer.invoke():
            whole_batch = model.output.logits[:, -1].save()
    assert (edited == 0).all() and (clean != 0).any()
    assert whole_batch.shape[0] == 2
    return {
        "edited": edited,
        "edited_logits": edited_logits,
        "clean": clean,
        "clean_logits": clean_logits,
        "whole_batch": whole_batch,
    }


def case_batched_generate(model, remote, tmp_path):
    with model.generate(**GEN, **remote(model)) as tracer:
        with tracer.invoke(PROMPT):
            a_hidden = model.transformer.h[0].output.save()
            a_ids = tracer.result.save()
        with tracer.invoke(PROMPT2):
            b_hidden = model.transformer.h[0].output.save()
            b_ids = tracer.result.save()
    assert a_ids.shape[0] == b_ids.shape[0] == 1
    return {"a_hidden": a_hidden, "a_ids": a_ids, "b_hidden": b_hidden, "b_ids": b_ids}


def case_generate_prompt_list(model, remote, tmp_path):
    with model.generate([PROMPT, PROMPT2], **GEN, **remote(model)) as tracer:
        first_step = model.transformer.h[0].output.save()
        ids = tracer.result.save()
    assert ids.shape[0] == 2
    return {"first_step": first_step, "ids": ids}


# --------------------------------------------------------------------------------
# Cases: saving
# --------------------------------------------------------------------------------


def case_save_function_form(model, remote, tmp_path):
    with model.trace(PROMPT, **remote(model)):
        hidden = nnsight.save(model.transformer.h[-1].output)
        shape = nnsight.save(tuple(model.transformer.h[-1].output.shape))
        summary = nnsight.save({"layers": len(model.transformer.h), "prompt": PROMPT})
    return {"hidden": hidden, "shape": shape, "summary": summary}


def case_save_computed(model, remote, tmp_path):
    with model.trace(PROMPT, **remote(model)):
        mean = model.transformer.h[-1].output.mean().save()
        peak = nnsight.save(model.output.logits[0, -1].max().item())
        top3 = nnsight.save(model.output.logits[0, -1].topk(3).indices.tolist())
    assert isinstance(peak, float) and isinstance(top3, list) and mean.ndim == 0
    return {"mean": mean, "peak": peak, "top3": top3}


CASES: list = [
    case_read_outputs,
    case_read_inputs,
    case_read_logits,
    case_zero_output,
    case_set_input,
    case_partial_slice_edit,
    case_early_stop,
    case_logit_lens,
    case_source_read,
    case_source_edit,
    case_source_skip,
    case_rename_layers,
    case_rename_deep_path,
    case_module_skip,
    case_session,
    case_generate_result,
    case_generate_iter,
    case_generator_output,
    case_generate_streamer,
    case_grad_single,
    case_grad_two_backward_order,
    case_cache_all,
    case_cache_modules,
    case_local_function,
    case_local_module,
    case_edit_copy,
    case_batched_invokes,
    case_invoke_isolation,
    case_batched_generate,
    case_generate_prompt_list,
    case_save_function_form,
    case_save_computed,
]


def case_id(case: Callable) -> str:
    """The pytest id of a case: its name without the ``case_`` prefix."""
    return case.__name__.removeprefix("case_")
