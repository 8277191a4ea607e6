"""The formats a deployment may hold its weights in: torch's float types and
nnsight's quantizations.

The quantization names come from nnsight's own table
(``nnsight.modeling.quantization.QUANTIZATIONS``), the one the loader builds
from and the one ``bytes_per_element`` sizes by. There is no second table here.
The module is read from its file, not imported: importing it through its
package would import torch, and the web must not.

Several names mean one format (``int4``, ``4bit`` and ``nf4``). The farm keys
a deployment by the first name of each format in nnsight's table, so two
spellings are one deployment.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from typing import Optional

from ndif_celery.wire import WireError

#: The float types a plain deployment may be loaded as (``deploy --dtype``).
FLOATS = ("float32", "float16", "bfloat16", "float64")
#: The nnsight module that holds the quantization table.
TABLE_MODULE = "nnsight.modeling.quantization"


class FormatError(WireError):
    """A held format this farm does not know (422)."""


@functools.lru_cache(maxsize=1)
def _table() -> dict:
    """nnsight's ``QUANTIZATIONS``, read from its file without importing torch."""
    loaded = sys.modules.get(TABLE_MODULE)
    if loaded is None:
        spec = importlib.util.find_spec("nnsight")
        if spec is None or not spec.submodule_search_locations:
            return {}
        path = f"{list(spec.submodule_search_locations)[0]}/modeling/quantization.py"
        if not os.path.exists(path):  # a runtime's older nnsight: no quantization by name
            return {}
        file_spec = importlib.util.spec_from_file_location("_ndif_nnsight_quantization", path)
        loaded = importlib.util.module_from_spec(file_spec)
        sys.modules[file_spec.name] = loaded  # its dataclass looks its module up while it is built
        file_spec.loader.exec_module(loaded)  # its top level imports only dataclasses and typing
    return dict(loaded.QUANTIZATIONS)


def quantizations() -> tuple:
    """Each format's canonical name, in nnsight's order (``nf4``, ``fp4``, ``int8``, ``fp8``)."""
    seen: list = []
    names = []
    for name, fmt in _table().items():
        if not any(fmt is other for other in seen):
            seen.append(fmt)
            names.append(name)
    return tuple(names)


def canonical_quantization(name: str) -> Optional[str]:
    """The canonical name of the quantization ``name`` spells, or None for any other name."""
    table = _table()
    fmt = table.get(str(name).removeprefix("torch.").lower())
    if fmt is None:
        return None
    return next(first for first in quantizations() if table[first] is fmt)


def compute_dtype(name: str) -> str:
    """What a quantized model computes in and holds its untouched weights in (nnsight's)."""
    return _table()[canonical_quantization(name)].compute_dtype


def known() -> tuple:
    """Every name ``deploy --dtype`` takes: the floats, then the quantizations and their aliases."""
    return FLOATS + tuple(_table())


def check(name: object) -> str:
    """``name`` as the farm keeps it: a float as written, a quantization by its
    canonical name; FormatError naming the choices otherwise."""
    if isinstance(name, str) and name in FLOATS:
        return name
    found = canonical_quantization(name) if isinstance(name, str) else None
    if found is None:
        shown = name[:40] if isinstance(name, str) else type(name).__name__
        raise FormatError(f"dtype {shown!r} is not one this farm loads: a float type ({', '.join(FLOATS)}) or a "
                          f"quantization nnsight loads ({', '.join(_table())}).")
    return found


def is_quantized(name: Optional[str]) -> bool:
    return bool(name) and canonical_quantization(name) is not None
