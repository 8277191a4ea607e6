"""Are the resident weights still what was loaded? Checked after every trusted job.

A trusted block runs against the resident model itself, and may edit a weight
in place (``w[:] = 0``, ``w.data.zero_()``, ``w.data = ...``). The edit is
the user's to make for their own run; the next user must not see it. A
fingerprint per tensor (its storage, shape, dtype and a wrapping sum of its
bytes as 64-bit words: any single changed element changes it) costs one read
of the weights at memory bandwidth; a mismatch reloads the model. Untrusted
jobs run in a child whose edits die with it (copy-on-write), so they need no
check, except a GPU child of the zygote, which maps the weights writable:
after its job the worker compares a keyed fingerprint (``keyed_fingerprint``).
"""

from __future__ import annotations

from typing import Any

import torch

def fingerprint(module: torch.nn.Module) -> dict:
    names, heads, sums = [], [], []
    with torch.no_grad():
        for name, tensor in module.state_dict(keep_vars=True).items():
            t = tensor.detach()
            names.append(name)
            heads.append((t.data_ptr(), tuple(t.shape), t.dtype))
            sums.append(_word_sum(t))
    totals = _read_all(sums)
    return {name: (*head, total) for name, head, total in zip(names, heads, totals)}


def _word_sum(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes summed as 64-bit words (wrapping): any one changed
    word changes it. Summed natively as int64, it runs at memory bandwidth;
    widening each 32-bit element to 64 bits first was 20x slower on a CPU
    (1 s per GiB here, more than a forward pass of the model it guarded)."""
    words, rest = _words(t)
    return words.sum() + rest.sum()


def _words(t: torch.Tensor) -> tuple:
    """The tensor's bytes as int64 words (a view, no copy), and the 0-7 bytes
    after the last whole word, one int64 each. A tensor whose bytes do not
    start 8-byte aligned comes back as all bytes, one int64 each (a copy)."""
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    try:
        return raw[:whole].view(torch.int64), raw[whole:].to(torch.int64)
    except RuntimeError:
        return raw.to(torch.int64), raw[:0].to(torch.int64)


_CHUNK = 1 << 24  # elements per step of the keyed sum: bounds its scratch memory


def keyed_fingerprint(module: torch.nn.Module, key: int) -> dict:
    """Per tensor, a sum of its 64-bit words each times a secret pseudo-random
    odd coefficient (wrapping 64-bit arithmetic), the coefficients drawn from
    ``key``. Used where the one who may have written the weights is an
    adversary (a GPU child holding a writable IPC mapping): the plain sum
    survives swapping two values, this one does not, unless the writer knows
    the key, which lives only in the worker. Three passes over the weights
    (words, coefficients, product) on their own device."""
    names, heads, sums = [], [], []
    with torch.no_grad():
        for index, (name, tensor) in enumerate(module.state_dict(keep_vars=True).items()):
            t = tensor.detach()
            generator = torch.Generator(device=t.device)
            generator.manual_seed((key * 1_000_003 + index) & ((1 << 63) - 1))
            total = torch.zeros((), dtype=torch.int64, device=t.device)
            for part in _words(t):
                for start in range(0, part.numel(), _CHUNK):
                    chunk = part[start : start + _CHUNK]
                    coefficients = torch.randint(-(1 << 62), 1 << 62, chunk.shape, generator=generator,
                                                 dtype=torch.int64, device=t.device) | 1
                    total += (chunk * coefficients).sum()
            names.append(name)
            sums.append(total)
            heads.append((tuple(t.shape), t.dtype))
    return {name: (*head, total) for name, head, total in zip(names, heads, _read_all(sums))}


def _read_all(sums: list) -> list:
    """The values of on-device scalars, with one synchronisation per device, not one per tensor."""
    totals: list = [None] * len(sums)
    by_device: dict = {}
    for i, total in enumerate(sums):
        by_device.setdefault(total.device, []).append(i)
    for indices in by_device.values():
        for i, value in zip(indices, torch.stack([sums[i] for i in indices]).tolist()):
            totals[i] = value
    return totals


def changed(module: torch.nn.Module, expected: dict, key: int | None = None) -> list[str]:
    """Names of the tensors that differ from ``expected`` (empty: intact);
    ``key``: compare keyed fingerprints (``keyed_fingerprint``)."""
    current = fingerprint(module) if key is None else keyed_fingerprint(module, key)
    names = set(current) | set(expected)
    return sorted(name for name in names if current.get(name) != expected.get(name))


def model_module(model: Any) -> torch.nn.Module:
    return model._module
