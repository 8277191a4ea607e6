"""What may share a forward, and why not: each refusal is a sentence for ``meta``.

Two kinds of check. **Source screens** look at the text of a request's blocks
before anything runs: a ``.skip(`` (a batched skip must cover every row, and
skips of different lengths do not concatenate), a ``.backward(`` (a second
backward through the shared graph fails; ``.grad`` of shared weights would
accumulate across users) or a name that reaches the weights (``.weight``,
``parameters()``: the weights are every user's) sends the request straight
to a run of its own.
**Inspection** looks at a request parked at its forward: which call it makes
(``_call`` / ``generate``), its inputs tokenized alone, its forward kwargs, its
env. Requests merge only when all of these agree (:func:`merge_key`); a
generate only with the same prompt length, greedy, one beam and one sequence
(the padded width shifts every decode step, and sampling shares one random
stream across the batch, so a user's samples would depend on who else ran).

A screen is a shortcut, not the guard: what it misses trips a guard during
the shared forward (the forward fails, a value shared by all is written, an
error) and the request is run again alone.
"""

from __future__ import annotations

import linecache
from typing import Any, Optional

import torch
from nnsight.modeling import processing
from nnsight.modeling.diffusion import DiffusionModel

from workers import quantized

# Source text -> why a block containing it runs alone.
SOLO_MARKERS = {
    ".skip(": "it skips a module (.skip()), which cannot cover only its own rows of a shared forward",
    ".backward(": "it runs a backward pass, which cannot share a forward's graph with other users",
}
# Names that reach the weights, which every user of a shared forward shares (a
# write through ``.data`` to a few words could escape the stamps' samples).
WEIGHT_MARKERS = (".weight", ".bias", "parameters(", "buffers(", "state_dict", "_parameters", "_buffers")
WEIGHTS = "it names the model's weights, which every user of a shared forward shares"

ROW_FIELDS = set(processing.ROW_FIELDS)
_CALLS = ("__call__", "_call", "generate")
_PLAIN = (int, float, str, bool, type(None))

# Reasons that are not about the request's own code.
ALONE_IN_BATCH = "no other request in this batch could share its forward"
COBATCH_OFF = "co-batching is off (NDIF_COBATCH_MAX=1)"
NO_LAYOUT = ("its batch's rows, or rows x positions, would equal a dimension of the model's own, "
             "so its values could not be told apart from the model's")  # batcher.layout found none


def source_reason(sources: list[str]) -> str:
    """Why these block sources must run alone, or ''."""
    text = "\n".join(sources)
    found = [why for marker, why in SOLO_MARKERS.items() if marker in text]
    if any(marker in text for marker in WEIGHT_MARKERS):
        found.append(WEIGHTS)
    return "; ".join(found)


def block_sources(filename: str, edits: list) -> list[str]:
    """The source of a request's traced block and of its stored edits."""
    sources = ["".join(linecache.getlines(filename))]
    for mediator in edits:
        code = getattr(mediator, "code", None)
        if code is not None:
            sources.append("".join(linecache.getlines(code.co_filename)))
    return sources


def call_name(fn: Any) -> str:
    return fn if isinstance(fn, str) else getattr(fn, "__name__", "") or ""


def inspect(model: Any, park: Any, env: dict) -> tuple[Optional[tuple], str]:
    """``(merge key, '')`` for a request parked at its forward, or ``(None, why)``.

    Fills ``park.encoding`` (its token rows, assembled alone by nnsight's own
    ``_batch``), ``park.forward`` (the call's other kwargs), ``park.rows`` and
    ``park.length``.
    """
    name = park.fn_name = call_name(park.fn)
    if isinstance(model, DiffusionModel):
        # A pipeline draws the whole batch's starting noise from one generator:
        # your latents would depend on who shares the call, and where.
        return None, "diffusion pipelines run alone: a shared call would change each request's starting noise"
    if quantized.is_quantized(model._module):
        # LLM.int8() picks its outlier columns from the whole batch, and the 4-bit
        # kernels differ for one row and many: a neighbour's rows would change yours.
        return None, "the model is quantized, and its kernels compute a row differently beside other rows"
    if name not in _CALLS:
        return None, f"it calls {name!r}, not the model's forward or generate"
    if not park.batcher.invokes:
        return None, "it has no input rows"
    try:
        _, assembled = model._batch(park.batcher.invokes, park.fn)
    except Exception as error:  # noqa: BLE001 - it runs alone, and fails there if it must
        return None, f"its inputs do not assemble ({type(error).__name__})"
    encoding = {k: v for k, v in assembled.items() if k in ROW_FIELDS}
    forward = {k: v for k, v in assembled.items() if k not in ROW_FIELDS}
    forward.update(park.batcher.extra_kwargs)
    forward.update(park.kwargs)
    ids = encoding.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or "inputs_embeds" in encoding:
        return None, "its inputs are not token ids"
    if any(not isinstance(v, torch.Tensor) or v.shape != ids.shape for v in encoding.values() if v is not None):
        return None, "its inputs carry fields of another shape than its token ids"
    if not all(_plain(v) for v in forward.values()):
        return None, "its call has arguments other than plain values"
    park.encoding, park.forward = encoding, forward
    park.rows, park.length = ids.shape
    if park.rows != park.batcher.total:
        return None, "its task splits inputs into extra rows"
    if name == "generate":
        why = _generate_reason(model, forward)
        if why:
            return None, why
    key = (name, repr(sorted(forward.items())), repr(sorted((env or {}).items())))
    return key, ""


def length_bound(model: Any, name: str, window: bool) -> bool:
    """Whether only requests of one token length may share this call: a generate
    (the padded width shifts every decode step), merging of unequal lengths
    turned off (NDIF_COBATCH_PAD=0), or a tokenizer that pads on the right (the
    sequence window assumes left padding)."""
    if name == "generate" or not window:
        return True
    return getattr(getattr(model, "tokenizer", None), "padding_side", None) != "left"


def _generate_reason(model: Any, forward: dict) -> str:
    config = getattr(model._module, "generation_config", None)

    def setting(name: str, default: Any) -> Any:
        return forward[name] if name in forward else getattr(config, name, default)

    if setting("do_sample", False):
        return "it samples (do_sample=True): one random stream would be shared by everyone in the batch"
    if (setting("num_beams", 1) or 1) > 1:
        return "it uses beam search, which reorders the batch's rows"
    if (setting("num_return_sequences", 1) or 1) > 1:
        return "it asks for several sequences per prompt"
    return ""


def _plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False
