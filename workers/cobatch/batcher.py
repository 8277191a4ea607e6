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
  hold what r alone computes. Layouts are told by size, so the batch's sizes
  (rows, width, rows x width) are kept off every dimension of the model's own
  (:func:`layout`: a filler row, a wider padding); a dimension that happened to
  equal one would be sliced by mistake.
* **Cache objects** (a transformers ``DynamicCache``) are plain objects nnsight's
  ``apply`` does not descend into: a worker would read every user's keys and
  values. A worker gets a read-only snapshot of its own rows (hazard 3).
* **Flattened values** (``[rows x width, ...]``: the ``x.view(-1, d)`` inside
  GPT-2's ``Conv1D``, reached through ``.source``; OPT's MLP; a router's
  logits) hold each row's tokens one after another: a request is served its
  own tokens where they are one range (one row, or rows without padding), and
  otherwise is marked ``unlaid`` and run again alone (hazard 4c).
* **Own storage.** Every value a worker is served is a copy of its part
  (its rows, its window, its tokens), never a view of the batch: whatever the
  worker does to it (in place, through ``.data``, ``set_``, a view, its
  storage) reaches no other user's rows. Before the model goes on (the next
  read or write of the visit, and the visit's end) each copy the worker
  changed is written back into its own part of the batch, as a write to the
  view would have been (:meth:`CoBatcherMixin.write_back`).
* **Shared values** (GPT-2's ``[1, S]`` ``position_ids``, rotary tables, a cache
  object) are not batched on dim 0, so nnsight serves them whole, as a copy
  here. Replacing one, or changing the copy by any road, would change every
  user's forward: nothing is written back, the change is recorded
  (``refused``) and that request is run again alone (hazards 4, 4b). A value
  served whole whose first dimension is neither 1 (one value for every row)
  nor a known layout of rows (an expert's tokens, gathered from every user)
  holds other users' data: its reader is marked ``unlaid`` and run again
  alone, so nothing it saw is kept (4c).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from nnsight.modeling import processing

# The fields a text encoding is batched on (nnsight's processing.ROW_FIELDS) and
# the value a left pad of each holds (None: the tokenizer's pad token).
_PAD_VALUES = {"input_ids": None, "attention_mask": 0, "token_type_ids": 0, "position_ids": 0}


class CoBatcherMixin:
    """Mixed over the model's own ``Batcher`` class by :func:`make`.

    ``spans``: one ``(start, rows, own length)`` per request, in row order.
    ``width``: the merged (padded) sequence width. ``refused``: the row groups
    whose worker tried to change a value shared by the whole batch.
    ``unlaid``: the row groups served a value whose rows are every user's.
    ``served``: the copies handed out since the last :meth:`write_back`, each
    ``(part of the batch, its version then, the copy, row group, per row)``.
    """

    def setup(self, window: bool) -> None:
        self.window = window
        self.own_invokes = 0
        self.spans: list[tuple[int, int, int]] = []
        self.width = 0
        self.target_width = 0  # set by the engine: widen the merged input to this (0: as collated)
        self.refused: list[list] = []
        self.unlaid: list[list] = []
        self.served: list[tuple[torch.Tensor, int, torch.Tensor, list, bool]] = []
        self.weights: frozenset[int] = frozenset()  # set by the engine: model_storages()

    def add_request(self, encoding: dict, length: int, invokes: int) -> list:
        """Add one request's (alone-assembled) token rows; return its row group."""
        group = self.add(**encoding)
        self.own_invokes += invokes
        self.spans.append((group[0], group[1], length))
        self.width = max(self.width, length)
        return group

    def add_filler(self, encoding: dict) -> None:
        """A row of nobody's (see :func:`layout`): in the forward, served to no one."""
        self.add(**encoding)

    @property
    def batching(self) -> bool:
        # nnsight narrows once a forward has two row-contributing invokes; here
        # they are the requests' own invokes, summed.
        return self.own_invokes > 1

    # -- assembling the merged input ----------------------------------------------

    def assemble(self, fn: Any) -> tuple:
        """nnsight's assembly (``collate`` left-pads, positions from the mask), then
        further left padding up to ``target_width`` (see :func:`layout`)."""
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
            mask = kwargs.get("attention_mask")
            if "position_ids" not in kwargs and isinstance(mask, torch.Tensor):
                # Rows of one length were not padded by collate, so it gave no
                # positions: counted from each row's first token, as it would.
                kwargs["position_ids"] = processing.positions(mask)
            self.width = self.target_width
        return args, kwargs

    # -- reads ------------------------------------------------------------------------

    def _span(self, group: list) -> tuple[int, int, int]:
        """(first row, rows, own length) of the request ``group`` belongs to."""
        for span in self.spans:
            if span[0] <= group[0] < span[0] + span[1]:
                return span
        return (group[0], group[1], self.width)

    def _own_length(self, group: list) -> int:
        return self._span(group)[2]

    def _window_dims(self, tensor: torch.Tensor, length: int) -> list[int]:
        if not self.window or length >= self.width:
            return []
        return [d for d in range(1, tensor.dim()) if tensor.shape[d] == self.width]

    def _part(self, tensor: torch.Tensor, group: list) -> tuple[torch.Tensor, bool]:
        """The group's part of ``tensor`` as a view, and whether it is per row
        (False: the tensor is every row's, served whole)."""
        if tensor.dim() == 0 or tensor.shape[0] != self.total:
            flat = self._narrow_flat(tensor, group)
            if flat is not None:
                return flat, True
            if self.batching and tensor.dim() and tensor.shape[0] > 1 and not self._weight(tensor):
                self.unlaid.append(list(group))  # every user's rows, laid out in a way not known here
            return tensor, False
        start, size = group
        view = tensor.narrow(0, start, size)
        length = self._own_length(group)
        for d in self._window_dims(view, length):
            view = view.narrow(d, self.width - length, length)
        return view, True

    def _weight(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is (a view of) one of the model's weights or buffers:
        the same for every user, whatever its size."""
        try:
            return tensor.untyped_storage().data_ptr() in self.weights
        except RuntimeError:  # a tensor without storage (meta, sparse): not known
            return False

    def _narrow_tensor(self, tensor: torch.Tensor, group: list) -> torch.Tensor:
        """A copy of the group's part, in storage of its own (see "Own storage")."""
        self.write_back()  # the worker's earlier writes first: a second read sees them
        part, per_row = self._part(tensor, group)
        mine = part.clone()
        self.served.append((part, part._version, mine, list(group), per_row))
        return mine

    def _narrow_flat(self, tensor: torch.Tensor, group: list) -> Any:
        """The request's own tokens of a value flattened over rows and positions
        (``[rows x width, ...]``), where they are one range; else None. Every
        invoke of the request is served all of them, as alone (nnsight's own
        batcher serves such a value whole to each invoke)."""
        if not self.batching or not self.width or tensor.dim() == 0 or tensor.shape[0] != self.total * self.width:
            return None
        start, size, length = self._span(group)
        if not self.window:
            length = self.width
        if size > 1 and length != self.width:  # several rows, each left-padded: not one range
            return None
        return tensor.narrow(0, start * self.width + (self.width - length), size * length)

    def narrow(self, value: Any, group: Any) -> Any:
        value = super().narrow(value, group)
        if self.batching and group is not None:
            value = _snapshot_caches(self, value, group)
        return value

    # -- writes -----------------------------------------------------------------------

    def _widen_tensor(self, full: torch.Tensor, group: list, edited: torch.Tensor) -> torch.Tensor:
        if full.dim() == 0 or full.shape[0] != self.total:
            if edited is not full and not _same(edited, full):
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
        self.write_back()  # what the worker wrote to its copies lands before the splice

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

    def assemble_skip(self, running: Any) -> Any:
        # Called once per visit, after every worker parked there was served:
        # the model is about to go on with the value.
        self.write_back()
        return super().assemble_skip(running)

    # -- the workers' copies ----------------------------------------------------------

    def write_back(self) -> None:
        """Each copy served since the last call that its worker changed, by any
        road (its content is compared, not a version counter), is written into
        its own part of the batch; a changed copy of a value shared by every
        row is not, and its group is ``refused``. Called while the model waits,
        so a part nobody else wrote since it was served (its version unmoved)
        still holds what the copy was made from."""
        served, self.served = self.served, []
        for part, version, mine, group, per_row in served:
            if _same(mine, part):
                continue
            if not per_row or mine.shape != part.shape or mine.dtype != part.dtype or mine.device != part.device:
                self.refused.append(group)
            elif part._version == version:
                with torch.no_grad():
                    part.copy_(mine)

    # -- after the forward ------------------------------------------------------------

    def unlaid_in(self, start: int, rows: int) -> bool:
        return any(start <= g[0] < start + rows for g in self.unlaid)

    def refused_in(self, start: int, rows: int) -> bool:
        return any(start <= g[0] < start + rows for g in self.refused)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal in shape, type, device and every element, NaN equal to NaN
    (``torch.equal`` alone finds an untouched copy of a NaN changed)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


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
                    setattr(mine, name, batcher._part(t, group)[0].clone())
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


def model_storages(model: Any) -> frozenset[int]:
    """The storage address of every weight and buffer: a value on one of them is
    the model's own, not a user's (see ``CoBatcherMixin._weight``)."""
    tensors = list(model._module.parameters()) + list(model._module.buffers())
    return frozenset(t.untyped_storage().data_ptr() for t in tensors)


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


def safe_width(width: int, dims: set[int], limit: int, rows: int = 1) -> int:
    """The smallest width >= ``width`` that is no model dimension and whose
    flattened size (``rows x width``) is none either, or 0 when none fits
    under ``limit`` (the model's positions): then lengths are bucketed."""
    for candidate in range(width, limit + 1):
        if candidate not in dims and candidate != rows and rows * candidate not in dims:
            return candidate
    return 0


def layout(lengths: set[int], rows: int, dims: set[int], limit: int, pad: bool) -> tuple[int, int] | None:
    """``(filler rows, width)`` at which a forward's values are told apart by
    size alone, or None when there is none. Width 0: as collated (no padding
    added); else the width to left-pad to. ``pad`` False: never padded (a
    generate).

    A value is taken to be every row's by its first dimension: the rows (by
    row) or rows x width (flattened), and a dimension of the width is the
    positions. None of these may be a size the model gives a dimension by
    itself, or a value made from the weights alone would be cut as if it
    held users' rows. Rows of one length take filler rows (copies of a
    user's row, nobody's) until their sizes are free: positions and bits stay
    as alone, and a row costs far less than a second forward, which reads
    every weight again. Otherwise the width is padded past the model's sizes."""
    length = max(lengths)
    if len(lengths) == 1:
        for fill in range(4):
            total = rows + fill
            if total not in dims and total != length and total * length not in dims:
                return fill, 0
    if pad:
        for fill in range(4):
            total = rows + fill
            width = safe_width(length, dims, limit, total) if total not in dims else 0
            if width:
                return fill, width
    return None


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
