"""What a request could leave on a resident model for the next user, and its undoing.

A trusted request runs in the worker's own process, against the shared model.
Its block can change what every later request reads: the HF config, the
generation config, the tokenizer and its native backend, a processor, the
pipeline, a module's attributes, an envoy's. A :class:`Baseline` is all of
that as loaded: every mutable object reachable from the model (the envoys,
the module tree and the objects they hold), each with a shallow copy of its
contents. After each request the live objects are compared with their copies
in a few list comparisons run in C, and those that differ are put back in
place: the same objects, so every holder sees the restore.

Not here: tensor values (``workers.models.integrity`` checks the weights) and
nnsight's process-global caches (each adapter's ``caches``). nnsight's own
runtime objects (the interleaver, a module's source state) are its to reset;
only the slots that hold them are kept.
"""

from __future__ import annotations

import collections
import enum
import types
import weakref
from typing import Any, Callable, Iterator

import torch

#: Where a model's baseline is kept: on its envoy, so it lives and dies with the model.
ATTRIBUTE = "_ndif_baseline"

# Values that cannot change in place: kept as they are, never walked.
_ATOMS = (type(None), bool, int, float, complex, str, bytes, range, slice, type, types.ModuleType,
          types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.CodeType, weakref.ref,
          enum.Enum, torch.dtype, torch.device, torch.Size, torch.Tensor)
# Containers kept item by item (an exact type: a subclass may override what restoring calls).
_DICTS = (dict, collections.OrderedDict, collections.defaultdict)


class Baseline:
    """The user-changeable state of one loaded model, as it was when taken."""

    def __init__(self, model: Any) -> None:
        self._mappings: list[dict] = []  # objects' __dict__s and dicts, live
        self._mapping_copies: list[dict] = []
        self._lists: list[list] = []
        self._list_copies: list[list] = []
        self._sets: list[set] = []
        self._set_copies: list[set] = []
        self._natives: list[Native] = []
        self._names: dict[int, str] = {}  # id of every object walked -> where it was found
        self.dirty = False  # a request is under way, or its restore did not finish
        model.__dict__[ATTRIBUTE] = self  # kept on the model, so the slot is part of what is kept
        for name, obj, shallow in _roots(model):
            self._walk(name, obj, shallow)

    def __len__(self) -> int:
        return len(self._mappings) + len(self._lists) + len(self._sets) + len(self._natives)

    # -- taking ------------------------------------------------------------------------

    def _walk(self, name: str, root: Any, shallow: bool) -> None:
        stack = [(name, root, shallow)]
        while stack:
            where, obj, shallow = stack.pop()
            if id(obj) in self._names or isinstance(obj, (_ATOMS, Baseline)):
                continue
            kind = type(obj)
            if kind is tuple or kind is frozenset:
                self._names[id(obj)] = where
                stack.extend((f"{where}[{i}]", item, False) for i, item in enumerate(obj))
            elif kind in _DICTS:
                self._keep_mapping(where, obj, collections.OrderedDict(obj) if isinstance(obj, collections.OrderedDict)
                                   else dict(obj))
                parent = where[: -len("._modules")] if where.endswith("._modules") else ""
                stack.extend((f"{parent}.{key}" if parent else f"{where}[{key!r}]", value, False)
                             for key, value in obj.items() if not isinstance(value, _ATOMS))
            elif kind is list:
                self._names[id(obj)] = where
                self._lists.append(obj)
                self._list_copies.append(list(obj))
                stack.extend((f"{where}[{i}]", item, False) for i, item in enumerate(obj)
                             if not isinstance(item, _ATOMS))
            elif kind is set:
                self._names[id(obj)] = where
                self._sets.append(obj)
                self._set_copies.append(set(obj))
            elif kind in _NATIVE_KINDS:
                self._names[id(obj)] = where
                self._natives.append(_NATIVE_KINDS[kind](where, obj))
            elif isinstance(getattr(obj, "__dict__", None), dict) and (shallow or not _nnsights(obj)):
                state = obj.__dict__
                self._keep_mapping(where, state, dict(state))
                self._names[id(obj)] = where
                if not shallow:
                    stack.extend((f"{where}.{key}", value, False) for key, value in state.items())
                else:
                    stack.extend((f"{where}.{key}", value, False) for key, value in state.items()
                                 if not _nnsights(value))

    def _keep_mapping(self, where: str, live: dict, copy: dict) -> None:
        self._names[id(live)] = where
        self._mappings.append(live)
        self._mapping_copies.append(copy)

    # -- checking and putting back -------------------------------------------------------

    def changed(self) -> list[str]:
        """Where the live state differs from the baseline (nothing put back)."""
        return [name for name, _ in self._differences()]

    def restore(self) -> list[str]:
        """Put back everything that differs from the baseline; where it differed."""
        differences = list(self._differences())
        for _, put_back in differences:
            put_back()
        self.dirty = False
        return [name for name, _ in differences]

    def _differences(self) -> Iterator[tuple[str, Callable[[], None]]]:
        if not _equal(self._mappings, self._mapping_copies):
            for live, copy in zip(self._mappings, self._mapping_copies):
                if not _equal(live, copy):
                    keys = sorted((str(k) for k in set(live) ^ set(copy)
                                   | {k for k in live.keys() & copy.keys() if not _same(live[k], copy[k])}))
                    yield f"{self._names[id(live)]}: {', '.join(keys) or 'order'}", _put_mapping(live, copy)
        if not _equal(self._lists, self._list_copies):
            for live, copy in zip(self._lists, self._list_copies):
                if not _equal(live, copy):
                    yield self._names[id(live)], _put_list(live, copy)
        if not _equal(self._sets, self._set_copies):
            for live, copy in zip(self._sets, self._set_copies):
                if live != copy:
                    yield self._names[id(live)], _put_set(live, copy)
        for native in self._natives:
            what = native.changed()
            if what:
                yield f"{native.where}: {what}", native.restore


def _roots(model: Any) -> Iterator[tuple[str, Any, bool]]:
    """(name, object, shallow) to walk from: the module tree, then each envoy
    (its own slots, and the objects they hold that are not nnsight's)."""
    module = getattr(model, "_module", None)
    if module is not None:
        yield "model._module", module, False
    envoys = list(model.modules()) if hasattr(model, "modules") else [model]
    for envoy in envoys:
        yield getattr(envoy, "path", "") or "model", envoy, True


def _nnsights(obj: Any) -> bool:
    """nnsight's own runtime objects: their slots are kept, never their insides.
    A module is a module whoever wrote it (0.7 puts its generator's in the tree)."""
    return type(obj).__module__.startswith("nnsight.") and not isinstance(obj, torch.nn.Module)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value whose == raises (a tensor swapped in) differs
        return False


def _same(a: Any, b: Any) -> bool:
    return a is b or _equal(a, b)


def _put_mapping(live: dict, copy: dict) -> Callable[[], None]:
    def put_back() -> None:
        live.clear()
        live.update(copy)
    return put_back


def _put_list(live: list, copy: list) -> Callable[[], None]:
    def put_back() -> None:
        live[:] = copy
    return put_back


def _put_set(live: set, copy: set) -> Callable[[], None]:
    def put_back() -> None:
        live.clear()
        live.update(copy)
    return put_back


# -- native objects: state held outside any __dict__ ---------------------------------------


class Native:
    """A native object whose state its attributes show (``tokenizers.AddedToken``)."""

    def __init__(self, where: str, obj: Any) -> None:
        self.where = where
        self.obj = obj
        self.names = [name for name in dir(type(obj)) if _is_property(type(obj), name)]
        self.state = self._read()

    def _read(self) -> dict:
        return {name: getattr(self.obj, name) for name in self.names}

    def changed(self) -> str:
        now = self._read()
        return ", ".join(name for name in self.names if not _same(now[name], self.state[name]))

    def restore(self) -> None:
        for name, value in self.state.items():
            try:
                setattr(self.obj, name, value)
            except AttributeError:
                pass  # read-only: it cannot have changed either


class Backend(Native):
    """A ``tokenizers.Tokenizer`` (a fast tokenizer's backend): its padding and
    truncation, its added tokens, its pipeline's parts and its model's settings.

    Read per request in microseconds (the parts' own JSON, never the vocabulary).
    Padding and truncation are put back in place; anything else, by loading
    the whole tokenizer as it was into the same object."""

    def __init__(self, where: str, obj: Any) -> None:
        self.where = where
        self.obj = obj
        self.whole = obj.__getstate__()
        self.state = self._read()

    def _read(self) -> dict:
        tokenizer = self.obj
        model = tokenizer.model
        state = {
            "truncation": tokenizer.truncation,
            "padding": tokenizer.padding,
            "added tokens": tokenizer.get_vocab_size(with_added_tokens=True),
            "model": {name: getattr(model, name) for name in dir(type(model)) if _is_property(type(model), name)},
        }
        for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
            value = getattr(tokenizer, part)
            state[part] = None if value is None else value.__getstate__()
        if hasattr(type(tokenizer), "encode_special_tokens"):
            state["encode_special_tokens"] = tokenizer.encode_special_tokens
        return state

    def changed(self) -> str:
        now = self._read()
        return ", ".join(name for name in self.state if now[name] != self.state[name])

    def restore(self) -> None:
        now = self._read()
        if any(now[name] != self.state[name] for name in self.state if name not in ("truncation", "padding")):
            self.obj.__setstate__(self.whole)
            return
        tokenizer, truncation, padding = self.obj, self.state["truncation"], self.state["padding"]
        if now["truncation"] != truncation and truncation is None:
            tokenizer.no_truncation()
        elif now["truncation"] != truncation:
            tokenizer.enable_truncation(**truncation)
        if now["padding"] != padding and padding is None:
            tokenizer.no_padding()
        elif now["padding"] != padding:
            tokenizer.enable_padding(**padding)


def _is_property(kind: type, name: str) -> bool:
    return not name.startswith("_") and type(getattr(kind, name, None)).__name__ == "getset_descriptor"


def _native_kinds() -> dict:
    try:
        import tokenizers
    except ImportError:  # pragma: no cover - transformers brings it
        return {}
    return {tokenizers.Tokenizer: Backend, tokenizers.AddedToken: Native}


_NATIVE_KINDS = _native_kinds()


# -- a model's baseline ----------------------------------------------------------------------


def take(model: Any) -> Baseline:
    """Take ``model``'s baseline now (as loaded, or after the farm changed it); it is kept on the model."""
    return Baseline(model)


def of(model: Any) -> Baseline:
    """``model``'s baseline, taken now if it has none."""
    baseline = model.__dict__.get(ATTRIBUTE)
    return baseline if baseline is not None else take(model)
