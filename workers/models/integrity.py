"""Are the resident weights still what was loaded? Checked after jobs that could have changed them.

Two checks, for two kinds of writer:

* ``fingerprint`` (after every trusted job): a trusted block runs against the
  resident model itself and may edit a weight in place (``w[:] = 0``,
  ``w.data.zero_()``, ``w.data = ...``). The edit is the user's to make for
  their own run; the next user must not see it. Per tensor (every parameter and
  buffer, non-persistent ones included): its storage, shape, dtype and a
  wrapping sum of its bytes as 64-bit words, one read at memory bandwidth. It
  is made for accidents, not adversaries: any single changed word changes it,
  but changes can cancel (swapping two words; flipping the top bit of an even
  number of words, e.g. negating every other float32: each adds ``2**63``).
* ``KeyedHash`` (after every untrusted job where a child could write the
  weights: a GPU child of the zygote, or any model with
  ``NDIF_VERIFY_UNTRUSTED=1``): a keyed universal hash whose key the writer
  never sees, so no change it picks survives except with probability ~2**-60.

A mismatch of either reloads the model (``workers.models.resident``).
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterator

import torch

from workers import quantized


def named_tensors(module: torch.nn.Module) -> Iterator[tuple]:
    """(name, tensor) for every parameter and buffer, persistent or not (a rotary ``inv_freq`` is
    not in ``state_dict``), each tied weight and alias under each of its names: what
    ``named_parameters`` then ``named_buffers`` (``remove_duplicate=False``) give, in
    their order, from one walk of the modules (the stamps read it after every job);
    then the scales a quantized layer keeps beside its weight, which change its values as surely."""
    modules = list(module.named_modules(remove_duplicate=False))
    for members in ("_parameters", "_buffers"):
        for prefix, sub in modules:
            for name, tensor in getattr(sub, members).items():
                if tensor is not None:
                    yield (f"{prefix}.{name}" if prefix else name), tensor
    for prefix, kind, name, tensor in quantized.extra_tensors(module):  # a quantized layer's scales
        yield f"{prefix}.{kind}.{name}", tensor


def fingerprint(module: torch.nn.Module) -> dict:
    names, heads, sums = [], [], []
    with torch.no_grad():
        for name, tensor in named_tensors(module):
            t = tensor.detach()
            names.append(name)
            heads.append((t.data_ptr(), tuple(t.shape), t.dtype))
            sums.append(_word_sum(t))
    totals = _read_all(sums)
    return {name: (*head, total) for name, head, total in zip(names, heads, totals)}


#: Tensors under this many bytes are read together by ``PlainFingerprint``.
SMALL_BYTES = 1 << 20


class PlainFingerprint:
    """The plain :func:`fingerprint` of one module, taken at load and read
    again after trusted jobs, with what can be kept between reads kept.

    Read one tensor at a time, a model's many small tensors (norms, biases)
    cost more in per-call overhead than in bytes: 20 ms for the tiny GPT-2's
    149 tensors, about one forward of it. So the word views of the small ones
    are made once, and each read sums all of them with one concatenation and
    one indexed add per device; a large tensor is summed on its own (at memory
    bandwidth). The totals are the same numbers :func:`fingerprint` gives (a
    wrapping 64-bit sum does not depend on the order). Views hold their
    storage, so a tensor given another storage, shape or type shows in the
    heads, which every read compares first; a module whose heads moved is read
    the slow way (and differs from ``expected`` anyway)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.expected = fingerprint(module)
        self._heads: list = []
        self._large: list[int] = []  # indices summed one at a time
        self._small: dict = {}  # device -> (indices, word views, their segment ids, rest views, their segment ids)
        with torch.no_grad():
            for i, (name, tensor) in enumerate(named_tensors(module)):
                t = tensor.detach()
                self._heads.append((name, t.data_ptr(), tuple(t.shape), t.dtype))
                views = _in_place_words(t) if t.numel() * t.element_size() < SMALL_BYTES else None
                if views is None:
                    self._large.append(i)
                    continue
                indices, words, word_ids, rests, rest_ids = self._small.setdefault(t.device, ([], [], [], [], []))
                words.append(views[0])
                word_ids.append(len(indices))
                rests.append(views[1])
                rest_ids.append(len(indices))
                indices.append(i)
        for device, (indices, words, word_ids, rests, rest_ids) in list(self._small.items()):
            def segments(ids: list, parts: list) -> torch.Tensor:
                return torch.cat([torch.full((part.numel(),), i, dtype=torch.int64) for i, part in zip(ids, parts)]
                                 + [torch.zeros(0, dtype=torch.int64)]).to(device)
            self._small[device] = (indices, words, segments(word_ids, words), rests, segments(rest_ids, rests))

    def read(self, module: torch.nn.Module) -> dict:
        """The module's fingerprint now, as :func:`fingerprint` gives it."""
        tensors = list(named_tensors(module))
        heads = [(name, t.data_ptr(), tuple(t.shape), t.dtype) for name, t in tensors]
        if heads != self._heads:
            return fingerprint(module)
        totals: list = [None] * len(tensors)
        with torch.no_grad():
            large = _read_all([_word_sum(tensors[i][1].detach()) for i in self._large])
            for i, total in zip(self._large, large):
                totals[i] = total
            for device, (indices, words, word_ids, rests, rest_ids) in self._small.items():
                summed = torch.zeros(len(indices), dtype=torch.int64, device=device)
                summed.index_add_(0, word_ids, torch.cat(words))
                summed.index_add_(0, rest_ids, torch.cat(rests).to(torch.int64))
                for i, total in zip(indices, summed.tolist()):
                    totals[i] = total
        return {name: (ptr, shape, dtype, total) for (name, ptr, shape, dtype), total in zip(heads, totals)}

    def changed(self, module: torch.nn.Module) -> list[str]:
        """Names of the tensors that differ from ``expected`` (empty: intact)."""
        current = self.read(module)
        names = set(current) | set(self.expected)
        return sorted(name for name in names if current.get(name) != self.expected.get(name))


def _in_place_words(t: torch.Tensor) -> "tuple | None":
    """The tensor's bytes as int64 words and the 0-7 bytes after them (uint8),
    both views of its own storage; None where they cannot be (not contiguous,
    not 8-byte aligned)."""
    if not t.is_contiguous():
        return None
    raw = t.reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    try:
        words = raw[:whole].view(torch.int64)
    except RuntimeError:
        return None
    if raw.numel() and raw.data_ptr() != t.data_ptr():
        return None
    return words, raw[whole:]


#: Words of each tensor the stamps keep a copy of, spread evenly over it.
SAMPLED_WORDS = 16
#: What ``Stamps.changed`` says.
STAMP_CHANGED = "a weight's version counter or storage changed"
SAMPLE_CHANGED = "a sampled word of a weight changed"


class Stamps:
    """What the worker reads after every trusted job instead of the whole
    fingerprint (``NDIF_TRUSTED_CHECK_EVERY``): cheap evidence that no weight
    was written, in about a millisecond whatever the model's size.

    Per tensor (the names of :func:`named_tensors`): its version counter,
    storage address, shape and dtype, and a copy of :data:`SAMPLED_WORDS` of
    its 64-bit words spread evenly over it. Two ways in which a write shows:

    * torch bumps a tensor's version counter on every in-place write through
      it or a view that shares its autograd history: ``w[:] = 0`` in a trace,
      ``w.zero_()``, ``w.detach().add_(1)``, ``torch.nn.init.*_``,
      ``load_state_dict``; ``w.data = t`` and ``module.w = Parameter(...)`` move
      the storage;
    * writes through ``w.data`` (``w.data[:] = 0``, ``w.data.mul_(2)``) bump
      nothing (``.data`` is a view with a version counter of its own): the
      sampled words catch those that change any of them, so every write to
      the whole tensor, its first or last word, or a row a sample falls in.

    A write through ``.data`` to words no sample covers (``w.data[3, 5] = 1``)
    is only seen by the whole fingerprint, which the worker still reads after
    every Nth trusted job and whenever it would otherwise wait for a job.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.heads = _heads(module)
        self._views: dict = {}  # device -> the sampled words, as views of each tensor's storage
        with torch.no_grad():
            for _, tensor in named_tensors(module):
                for view in _sampled(tensor):
                    self._views.setdefault(view.device, []).append(view)
        self.samples = self._read()

    def _read(self) -> dict:
        return {device: torch.cat(views) for device, views in self._views.items()}

    def changed(self, module: torch.nn.Module) -> str:
        """Why the module may have been written since these stamps ('' if nothing shows)."""
        if _heads(module) != self.heads:
            return STAMP_CHANGED
        with torch.no_grad():
            now = self._read()
        if any(not torch.equal(now[device], self.samples[device]) for device in self.samples):
            return SAMPLE_CHANGED
        return ""


def _heads(module: torch.nn.Module) -> list:
    return [(name, t._version, t.data_ptr(), tuple(t.shape), t.dtype) for name, t in named_tensors(module)]


def _sampled(tensor: torch.Tensor) -> list:
    """Views of the tensor's own storage (so a write shows in them): its first
    word and every ``n / SAMPLED_WORDS``-th after it, and its last word, as
    int64; none when its bytes cannot be viewed as words in place (not
    contiguous, not 8-byte aligned, under 8 bytes)."""
    t = tensor.detach()
    if not t.is_contiguous() or t.numel() * t.element_size() < 8:
        return []
    words, _ = _words(t)
    if words.data_ptr() != t.data_ptr():  # a copy: it would not see a write
        return []
    step = max(1, words.numel() // SAMPLED_WORDS)
    return [words[::step][:SAMPLED_WORDS - 1], words[-1:]]


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


_P = (1 << 31) - 1  # the prime of the keyed hash (a Mersenne prime: int64 products cannot overflow)
_ROW = 1 << 16  # 16-bit words per row, each row weighted by one secret s: |row sum| < 2**16 * 2**15 * 2**31 = 2**62
# Rows per step, so the scratch memory is bounded whatever the model's size (two int64 blocks): 64 rows
# (64 MiB) on a GPU, where fewer, larger kernels are faster; 8 (8 MiB) on a CPU, where blocks that stay in
# cache were 2x faster here (0.48 s per GiB against 1.1 s with 64 rows).
_BLOCK_ROWS = {"cpu": 8}
_BLOCK_ROWS_GPU = 64
LANES = 2  # independent hashes per tensor: a chosen change survives all of them with probability < (2/p)**2 ~ 2**-60


class KeyedHash:
    """A keyed universal hash of every parameter and buffer, computed on their own device.

    Used where whoever may have written the weights is an adversary: a GPU
    child of the zygote holds a writable CUDA IPC mapping of them. The key
    (32 random bytes, drawn per load) lives only in the worker.

    The math, per tensor and per lane. Its bytes are read as signed 16-bit
    words ``x_0 .. x_{n-1}`` (an odd last byte is one more word), zero-padded
    to rows of ``C = 2**16`` words: ``x_{c,j}``. Modulo the prime
    ``p = 2**31 - 1``::

        H = sum_c s_c * (sum_j R_j * x_{c,j})   (mod p)

    with ``R_0 .. R_{C-1}`` (one vector per lane, shared by every row of every
    tensor) and ``s_c`` (one per row of this tensor, drawn from the key and the
    tensor's name) uniform in ``[0, p)``, from a ``torch.Generator`` seeded by
    a keyed BLAKE2b of the key, the lane and the name. Why a change survives
    with probability at most ``2/p`` per lane: the writer fixes a change
    ``d = x' - x`` without knowing the key; its words differ by less than
    ``2**16 < p`` in absolute value, so some row ``c*`` has ``d_c*`` nonzero
    modulo p. ``sum_j R_j d_{c*,j}`` is a nonzero linear form in the uniform
    ``R``: it is 0 with probability exactly ``1/p``. When it is not 0,
    ``sum_c s_c D_c`` is 0 only for one value of the uniform ``s_c*`` (given
    all the others): probability ``1/p``. So at most ``2/p`` per lane, and
    ``(2/p)**2 ~ 2**-60`` for two independent lanes, whatever the change
    (sign flips in pairs, swaps, a bit in any byte). A plain or odd-weighted
    sum modulo ``2**64`` is not like this: ``2**63`` times any odd number is
    ``2**63``, so two flipped sign bits cancel.

    Two levels (``R`` shared, ``s`` per row) rather than a fresh coefficient
    per word: the per-word random numbers would cost more than the hashing
    (the generator is the slow part on a CPU), while ``R`` and every ``s`` are
    drawn once per key and kept on the tensor's device (``8 * 2**16`` bytes
    per lane, plus one int64 per 65536 words). The arithmetic is int64 on the
    tensor's device, in blocks of bounded size: nothing is copied to the host
    but one pair of numbers per tensor. The same code runs on a CPU.
    """

    def __init__(self, key: bytes) -> None:
        self._key = bytes(key)
        self._r: dict = {}  # device -> (LANES, _ROW) int64
        self._s: dict = {}  # (device, name) -> (LANES, rows) int64

    def _seed(self, *parts: str) -> int:
        digest = hashlib.blake2b("\0".join(parts).encode(), key=self._key, digest_size=8).digest()
        return int.from_bytes(digest, "little") & ((1 << 63) - 1)

    def _draw(self, count: int, *parts: str) -> torch.Tensor:
        """``LANES x count`` uniform values in [0, p), from the key and ``parts`` (drawn on the CPU: the
        same numbers whatever the device)."""
        rows = []
        for lane in range(LANES):
            generator = torch.Generator().manual_seed(self._seed(str(lane), *parts))
            rows.append(torch.randint(0, _P, (count,), generator=generator, dtype=torch.int64))
        return torch.stack(rows)

    def _coefficients(self, device: torch.device, name: str, rows: int) -> tuple:
        r = self._r.get(device)
        if r is None:
            r = self._r[device] = self._draw(_ROW, "R").to(device)
        s = self._s.get((device, name))
        if s is None or s.shape[1] != rows:
            s = self._s[(device, name)] = self._draw(rows, "s", name).to(device)
        return r, s

    def of(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor's ``LANES`` hashes, as an int64 tensor on its device (not read back)."""
        t = tensor.detach()
        device = t.device
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        even = raw.numel() // 2 * 2
        try:
            words = raw[:even].view(torch.int16)
        except RuntimeError:  # bytes not 2-aligned (a 1-byte dtype's odd offset): one word per byte
            words = raw
        tail = raw[even:] if words is not raw else raw[:0]
        count = words.numel() + tail.numel()
        rows = max(1, -(-count // _ROW))
        r, s = self._coefficients(device, name, rows)
        total = torch.zeros(LANES, dtype=torch.int64, device=device)
        block = _BLOCK_ROWS.get(device.type, _BLOCK_ROWS_GPU) * _ROW
        x = torch.empty(min(block, rows * _ROW), dtype=torch.int64, device=device)
        product = torch.empty_like(x)
        for start in range(0, max(count, 1), block):
            n = min(block, count - start)
            k = max(1, -(-n // _ROW))
            xs = x[: k * _ROW]
            from_words = max(0, min(n, words.numel() - start))
            xs[:from_words].copy_(words[start : start + from_words])
            if from_words < n:  # the odd last byte
                xs[from_words:n].copy_(tail)
            xs[n:].zero_()
            row0 = start // _ROW
            for lane in range(LANES):
                ps = product[: k * _ROW].view(k, _ROW)
                torch.mul(xs.view(k, _ROW), r[lane], out=ps)
                sums = ps.sum(dim=1).remainder_(_P)
                total[lane] += (sums * s[lane, row0 : row0 + k]).remainder_(_P).sum()
            total.remainder_(_P)
        return total

    def fingerprint(self, module: torch.nn.Module) -> dict:
        """name -> (shape, dtype, lane hashes) for every parameter and buffer (tied and non-persistent ones
        too), one synchronisation per device."""
        names, heads, values = [], [], []
        with torch.no_grad():
            for name, tensor in named_tensors(module):
                names.append(name)
                heads.append((tuple(tensor.shape), tensor.dtype))
                values.append(self.of(name, tensor))
        return {name: (*head, tuple(value)) for name, head, value in zip(names, heads, _read_all(values))}


def keyed_fingerprint(module: torch.nn.Module, key: "bytes | int") -> dict:
    """``KeyedHash(key).fingerprint(module)`` (an int key is taken as its 32 bytes)."""
    return KeyedHash(_key_bytes(key)).fingerprint(module)


def _key_bytes(key: "bytes | int") -> bytes:
    return key if isinstance(key, bytes) else int(key).to_bytes(32, "little", signed=True)


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


def changed(module: torch.nn.Module, expected: dict, key: "KeyedHash | bytes | int | None" = None) -> list[str]:
    """Names of the tensors that differ from ``expected`` (empty: intact);
    ``key``: compare keyed fingerprints (a ``KeyedHash``, or its key)."""
    if key is None:
        current = fingerprint(module)
    else:
        current = (key if isinstance(key, KeyedHash) else KeyedHash(_key_bytes(key))).fingerprint(module)
    names = set(current) | set(expected)
    return sorted(name for name in names if current.get(name) != expected.get(name))


def model_module(model: Any) -> torch.nn.Module:
    return model._module
