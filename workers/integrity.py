"""Are the resident weights still what was loaded? Checked after every trusted job.

A trusted block runs against the resident model itself, and may edit a weight
in place (``w[:] = 0``, ``w.data.zero_()``, ``w.data = ...``). The edit is
the user's to make for their own run; the next user must not see it. A
fingerprint per tensor (its storage, shape, dtype and an integer sum of its
bits: any single changed element changes it) costs one read of the weights;
a mismatch reloads the model. Untrusted jobs run in a forked child whose
edits die with it (copy-on-write), so they need no check.
"""

from __future__ import annotations

from typing import Any

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(module: torch.nn.Module) -> dict:
    names, heads, sums = [], [], []
    with torch.no_grad():
        for name, tensor in module.state_dict(keep_vars=True).items():
            t = tensor.detach()
            bits = t.contiguous().view(_INT_VIEW[t.element_size()]) if t.element_size() in _INT_VIEW else t
            names.append(name)
            heads.append((t.data_ptr(), tuple(t.shape), t.dtype))
            sums.append(bits.sum(dtype=torch.int64))
    # One synchronisation per device for all of them, not one per tensor.
    totals: list = [None] * len(sums)
    by_device: dict = {}
    for i, total in enumerate(sums):
        by_device.setdefault(total.device, []).append(i)
    for indices in by_device.values():
        for i, value in zip(indices, torch.stack([sums[i] for i in indices]).tolist()):
            totals[i] = value
    return {name: (*head, total) for name, head, total in zip(names, heads, totals)}


def changed(module: torch.nn.Module, expected: dict) -> list[str]:
    """Names of the tensors that differ from ``expected`` (empty: intact)."""
    current = fingerprint(module)
    names = set(current) | set(expected)
    return sorted(name for name in names if current.get(name) != expected.get(name))


def model_module(model: Any) -> torch.nn.Module:
    return model._module
