"""One nnsight ``Batcher`` over several users' requests: who sees which rows and positions.

nnsight already batches the invokes of *one* trace: each invoke's worker owns a
``batch_group`` (``[start, size]`` rows) and the ``Batcher`` narrows every
activation to those rows on a read and splices an edit back on a write. A
co-batched forward is the same thing one level up: request r owns rows
``[start_r, start_r + rows_r)``, and its own invokes' groups are re-offset into
that range. What nnsight's batcher does not have to care about, and this one
does (the hazards numbered in docs/cobatching.md, "Guards"):

* **Whole-batch workers** (an empty ``invoke()``, a stored ``model.edit()``)
  have ``batch_group=None`` and would see every user's rows: the engine scopes
  them to their request's range before the forward (hazard 1).
* **Sequence window.** Requests of different lengths are left-padded to the
  longest. Alone, request r would be padded only to its own length ``L_r``, so
  its workers are served the *last* ``L_r`` positions of every dimension that
  has the batch's padded width, and their edits are written back into that
  window. Left padding and mask-derived ``position_ids`` make those positions
  hold what r alone computes. The heuristic matches dimensions by size, so the
  merged width is padded further until it equals no dimension of the model
  (:func:`safe_width`); a dimension that happened to equal the width would be
  sliced by mistake.
* **Cache objects** (a transformers ``DynamicCache``) are plain objects nnsight's
  ``apply`` does not descend into: a worker would read every user's keys and
  values. A worker gets a read-only snapshot of its own rows (hazard 3).
* **Flattened values** (``[rows x width, ...]``: the ``x.view(-1, d)`` inside
  GPT-2's ``Conv1D``, reached through ``.source``; OPT's MLP; a router's
  logits) hold each row's tokens one after another: a request is served its
  own tokens where they are one range (one row, or rows without padding), and
  otherwise is marked ``unlaid`` and run again alone (hazard 4c).
* **Shared values** (GPT-2's ``[1, S]`` ``position_ids``, rotary tables, a cache
  object) are not batched on dim 0, so nnsight serves them whole. Replacing
  one would change every user's forward: the swap is refused and recorded
  (``refused``), and that request is run again alone (hazard 4). An in-place
  write to one cannot be intercepted, and one through ``.data`` moves no
  version counter, so every value served whole is kept as a copy and compared
  after the forward; a change re-runs the whole forward alone (4b). A value
  served whole whose first dimension is neither 1 (one value for every row)
  nor a known layout of rows (an expert's tokens, gathered from every user)
  holds other users' data: its reader is marked ``unlaid`` and run again
  alone, so nothing it saw is kept (4c).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

# The fields a text encoding is batched on (nnsight's processing.ROW_FIELDS) and
# the value a left pad of each holds (None: the tokenizer's pad token).
_PAD_VALUES = {"input_ids": None, "attention_mask": 0, "token_type_ids": 0, "position_ids": 0}


class CoBatcherMixin:
    """Mixed over the model's own ``Batcher`` class by :func:`make`.

    ``spans``: one ``(start, rows, own length)`` per request, in row order.
    ``width``: the merged (padded) sequence width. ``refused``: the row groups
    whose worker tried to replace a value shared by the whole batch.
    ``shared``: ``{id: (tensor, a copy when served)}`` for every tensor served
    whole. ``unlaid``: the row groups served a value whose rows are every user's.
    """

    def setup(self, window: bool) -> None:
        self.window = window
        self.own_invokes = 0
        self.spans: list[tuple[int, int, int]] = []
        self.width = 0
        self.target_width = 0  # set by the engine: widen the merged input to this (0: as collated)
        self.refused: list[list] = []
        self.unlaid: list[list] = []
        self.shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add_request(self, encoding: dict, length: int, invokes: int) -> list:
        """Add one request's (alone-assembled) token rows; return its row group."""
        group = self.add(**encoding)
        self.own_invokes += invokes
        self.spans.append((group[0], group[1], length))
        self.width = max(self.width, length)
        return group

    @property
    def batching(self) -> bool:
        # nnsight narrows once a forward has two row-contributing invokes; here
        # they are the requests' own invokes, summed.
        return self.own_invokes > 1

    # -- assembling the merged input ----------------------------------------------

    def assemble(self, fn: Any) -> tuple:
        """nnsight's assembly (``collate`` left-pads, positions from the mask), then
        further left padding up to ``target_width`` (see :func:`safe_width`)."""
        args, kwargs = super().assemble(fn)
        ids = kwargs.get("input_ids")
        if self.target_width and isinstance(ids, torch.Tensor) and ids.shape[1] < self.target_width:
            extra = self.target_width - ids.shape[1]
            pad_id = getattr(self.envoy.tokenizer, "pad_token_id", None) or 0
            for key, value in _PAD_VALUES.items():
                tensor = kwargs.get(key)
                if isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tensor.shape == ids.shape:
                    fill = pad_id if value is None else value
                    left = torch.full((tensor.shape[0], extra), fill, dtype=tensor.dtype, device=tensor.device)
                    kwargs[key] = torch.cat([left, tensor], dim=1)
            self.width = self.target_width
        return args, kwargs

    # -- reads ------------------------------------------------------------------------

    def _own_length(self, group: list) -> int:
        for start, rows, length in self.spans:
            if start <= group[0] < start + rows:
                return length
        return self.width

    def _window_dims(self, tensor: torch.Tensor, length: int) -> list[int]:
        if not self.window or length >= self.width:
            return []
        return [d for d in range(1, tensor.dim()) if tensor.shape[d] == self.width]

    def _narrow_tensor(self, tensor: torch.Tensor, group: list) -> torch.Tensor:
        if tensor.dim() == 0 or tensor.shape[0] != self.total:
            flat = self._narrow_flat(tensor, group)
            if flat is not None:
                return flat
            if self.batching and tensor.dim() and tensor.shape[0] > 1:
                self.unlaid.append(list(group))  # every user's rows, laid out in a way not known here
            # Served whole to every user; an in-place write to it cannot be
            # stopped here, so keep a copy to notice one afterwards.
            if id(tensor) not in self.shared:
                self.shared[id(tensor)] = (tensor, tensor.detach().clone())
            return tensor
        start, size = group
        view = tensor.narrow(0, start, size)
        length = self._own_length(group)
        for d in self._window_dims(view, length):
            view = view.narrow(d, self.width - length, length)
        view._nnsight_batch = True  # as nnsight marks its narrowed views (see intervention/backward.py)
        return view

    def _narrow_flat(self, tensor: torch.Tensor, group: list) -> Any:
        """The group's own tokens of a value flattened over rows and positions
        (``[rows x width, ...]``), where they are one range; else None."""
        if not self.batching or not self.width or tensor.dim() == 0 or tensor.shape[0] != self.total * self.width:
            return None
        start, size = group
        length = self._own_length(group) if self.window else self.width
        if size > 1 and length != self.width:  # several rows, each left-padded: not one range
            return None
        view = tensor.narrow(0, start * self.width + (self.width - length), size * length)
        view._nnsight_batch = True
        return view

    def narrow(self, value: Any, group: Any) -> Any:
        value = super().narrow(value, group)
        if self.batching and group is not None:
            value = _snapshot_caches(self, value, group)
        return value

    # -- writes -----------------------------------------------------------------------

    def _widen_tensor(self, full: torch.Tensor, group: list, edited: torch.Tensor) -> torch.Tensor:
        if full.dim() == 0 or full.shape[0] != self.total:
            if edited is not full:
                self.refused.append(list(group))
            return full
        start, size = group
        length = self._own_length(group)
        dims = self._window_dims(full, length)
        if dims:
            region = full.narrow(0, start, size).clone()
            index = [slice(None)] * full.dim()
            for d in dims:
                index[d] = slice(self.width - length, None)
            region[tuple(index)] = edited
            edited = region
        pre = full.narrow(0, 0, start)
        post = full.narrow(0, start + size, self.total - start - size)
        return torch.cat([pre, edited, post], dim=0)

    def widen(self, full: Any, group: Any, edited: Any) -> Any:
        """nnsight's ``widen``, except that a leaf which is not a batched tensor (a
        cache object, a flag, a shared tensor) is every row's: replacing it is
        refused and recorded, and the batch keeps its own."""
        if not self.batching or group is None:
            return edited

        def merge(f: Any, e: Any) -> Any:
            if isinstance(f, torch.Tensor):
                if not isinstance(e, torch.Tensor):
                    self.refused.append(list(group))
                    return f
                return self._widen_tensor(f, group, e)
            if isinstance(f, (list, tuple)) and isinstance(e, (list, tuple)) and len(f) == len(e):
                merged = [merge(a, b) for a, b in zip(f, e)]
                if isinstance(f, tuple) and hasattr(f, "_fields"):
                    return type(f)(*merged)
                return type(f)(merged)
            if isinstance(f, dict) and isinstance(e, dict) and set(f) == set(e):
                out = f.copy()
                for key in f:
                    out[key] = merge(f[key], e[key])
                return out
            if e is f or getattr(e, "_cobatch_snapshot_of", None) == id(f):
                return f  # unchanged, or the worker's own snapshot handed back
            try:
                same = type(e) is type(f) and bool(e == f)
            except Exception:  # noqa: BLE001 - incomparable means changed
                same = False
            if not same:
                self.refused.append(list(group))
            return f

        return merge(full, edited)

    # -- after the forward ------------------------------------------------------------

    def shared_written(self) -> bool:
        """Whether a tensor served whole to the workers was written since, by any
        road (in place, through ``.data``, through its storage)."""
        return any(not torch.equal(tensor, copy) for tensor, copy in self.shared.values())

    def unlaid_in(self, start: int, rows: int) -> bool:
        return any(start <= g[0] < start + rows for g in self.unlaid)

    def refused_in(self, start: int, rows: int) -> bool:
        return any(start <= g[0] < start + rows for g in self.refused)


def make(model: Any, window: bool) -> Any:
    """A co-batcher over ``model``'s own ``Batcher`` class (a diffusion model's
    doubling batcher, say, keeps its own layout underneath)."""
    base = model._batcher_class
    cls = type(f"Co{base.__name__}", (CoBatcherMixin, base), {})
    batcher = cls(model, {})
    batcher.setup(window)
    return batcher


def _snapshot_caches(batcher: Any, value: Any, group: list) -> Any:
    """Replace each transformers ``Cache`` in ``value`` by a copy holding only this
    group's rows (and sequence window), cloned: reading it shows nothing of the
    other users; writing it changes nothing (handing it back is ignored, see
    ``widen``)."""
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover - transformers is a dependency
        return value

    def snapshot(cache: Any) -> Any:
        clone = copy.copy(cache)
        clone._cobatch_snapshot_of = id(cache)
        clone.layers = []
        for layer in getattr(cache, "layers", []):
            mine = copy.copy(layer)
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batcher.total:
                    setattr(mine, name, batcher._narrow_tensor(t, group).clone())
            clone.layers.append(mine)
        return clone

    if isinstance(value, Cache):
        return snapshot(value)
    if isinstance(value, dict):
        if not any(isinstance(v, Cache) for v in value.values()):
            return value
        new = value.copy()
        for k, v in value.items():
            new[k] = _snapshot_caches(batcher, v, group)
        return new
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_snapshot_caches(batcher, v, group) for v in value)
    return value


def model_dims(model: Any) -> set[int]:
    """Every size a dimension of an activation can take because of the model
    (not the input): each dimension of each weight and buffer, and the
    config's sizes (heads, head width, positions, ...)."""
    dims: set[int] = set()
    for tensor in list(model._module.parameters()) + list(model._module.buffers()):
        dims.update(int(d) for d in tensor.shape)
    config = getattr(model._module, "config", None)
    if config is not None:
        for value in vars(config).values():
            if isinstance(value, int) and not isinstance(value, bool):
                dims.add(value)
        heads = getattr(config, "num_attention_heads", None)
        hidden = getattr(config, "hidden_size", None)
        if isinstance(heads, int) and isinstance(hidden, int) and heads:
            dims.add(hidden // heads)
    return dims


def safe_width(width: int, dims: set[int], limit: int) -> int:
    """The smallest width >= ``width`` that is no model dimension, or 0 when
    none fits under ``limit`` (the model's positions): then lengths are bucketed."""
    for candidate in range(width, limit + 1):
        if candidate not in dims:
            return candidate
    return 0


def max_positions(model: Any) -> int:
    config = getattr(model._module, "config", None)
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1 << 20


def compact(value: Any, _depth: int = 4, _seen: set | None = None) -> Any:
    """``value`` with every tensor that views a larger storage copied out.

    ``torch.save`` writes a view's *whole* storage: a saved activation narrowed
    out of the merged batch would carry every other user's rows in this user's
    result (hazard 2; nnsight's vLLM runner does the same with
    ``dumps_compact``). Containers are rebuilt; nnsight caches
    (``tracer.cache()``) and plain user objects are descended into, a bounded
    number of levels, and changed in place (they are this request's own);
    modules and envoys are never touched.
    """
    seen = set() if _seen is None else _seen
    if isinstance(value, torch.Tensor):
        if value.untyped_storage().nbytes() > value.numel() * value.element_size():
            return value.clone()
        return value
    if isinstance(value, list):
        return type(value)(compact(v, _depth, seen) for v in value)
    if isinstance(value, tuple):
        items = [compact(v, _depth, seen) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        new = value.copy()
        for key, item in value.items():
            new[key] = compact(item, _depth, seen)
        return new
    if _depth <= 0 or id(value) in seen or not hasattr(value, "__dict__") or _untouchable(value):
        return value
    seen.add(id(value))
    for name, item in list(vars(value).items()):
        new = compact(item, _depth - 1, seen)
        if new is not item:
            object.__setattr__(value, name, new)
    return value


def _untouchable(value: Any) -> bool:
    from nnsight.intervention.envoy import Envoy
    from nnsight.intervention.interleaver import Interleaver

    return isinstance(value, (torch.nn.Module, Envoy, Interleaver, type)) or callable(value)
