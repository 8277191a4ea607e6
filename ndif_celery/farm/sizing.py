"""How much memory a model will take, decided before it is loaded.

Exact where the weights are on disk: the safetensors headers of the cached
checkpoint list every tensor's shape, so the element count costs a few small
reads and no torch graph. Otherwise nnsight's own estimate (the hub's
parameter count, or the architecture built on the meta device). Then padded
for activations and runtime overhead, as placement needs.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Optional

from ndif_celery import wire
from ndif_celery.policy import held_formats, model_policy
from ndif_celery.state import registry


class SizingError(Exception):
    pass


def padded(size_bytes: int, factor: float, extra: int) -> int:
    return math.ceil(size_bytes * (1 + factor) + extra)


def weight_bytes(model_key: str, dtype: Optional[str], redis_client=None) -> int:
    """Bytes of the weights as they will be held (``dtype``, or the checkpoint's).
    A runtime's deployment holds the same weights as the farm's own key; a
    quantized deployment holds them as its key says."""
    model_key, dtype = _checkpoint(model_key, dtype)
    size = known_weight_bytes(model_key, dtype, redis_client)
    if size is None:
        size = _from_nnsight(model_key, dtype or "float32")
        if redis_client is not None:
            redis_client.hset(registry.SIZES, _cache_field(model_key, dtype), size)
    return size


def known_weight_bytes(model_key: str, dtype: Optional[str], redis_client=None) -> Optional[int]:
    """:func:`weight_bytes` from what is at hand only (the farm's cache of sizes,
    this host's checkpoint), else None: an operator's command checks capacity
    with it and must not wait on the hub."""
    model_key, dtype = _checkpoint(model_key, dtype)
    cache_field = _cache_field(model_key, dtype)
    if redis_client is not None:
        cached = redis_client.hget(registry.SIZES, cache_field)
        if cached is not None:
            return int(cached)
    size = _from_local_checkpoint(model_key, dtype)
    if size is not None and redis_client is not None:
        redis_client.hset(registry.SIZES, cache_field, size)
    return size


def _checkpoint(model_key: str, dtype: Optional[str]) -> tuple[str, Optional[str]]:
    """The checkpoint's own key, and the dtype its weights will be held in."""
    try:
        key = model_policy.parse(model_key)
    except model_policy.PolicyError:
        return model_key, dtype  # sized as given: the loader refuses it anyway
    return key.main_key, key.held or dtype


def _cache_field(model_key: str, dtype: Optional[str]) -> str:
    return f"{model_key}|{dtype or ''}"


def _from_local_checkpoint(model_key: str, dtype: Optional[str]) -> Optional[int]:
    fields = wire.repo_fields(model_key)
    snapshot = _snapshot_dir(fields["repo_id"], fields.get("revision"))
    if snapshot is None:
        return None
    files = _weight_files(snapshot)
    if not files:
        return None
    from nnsight.modeling.mixins.remotable import bytes_per_element

    held = held_formats.canonical_quantization(dtype) if dtype else None
    rest = bytes_per_element(held_formats.compute_dtype(held)) if held else None
    total = 0
    for path in files:
        for name, info in _safetensors_header(path).items():
            if name == "__metadata__":
                continue
            elements = math.prod(info["shape"])
            if held:
                quantized = len(info["shape"]) == 2 and not _UNQUANTIZED.search(name)
                total += math.ceil(elements * (bytes_per_element(held) * (1 + _BLOCK_SCALES.get(held, 0))
                                               if quantized else rest))
            elif dtype:
                total += math.ceil(elements * bytes_per_element(dtype))
            else:
                begin, end = info["data_offsets"]
                total += end - begin
    return total


# A quantization replaces the linear layers' weights only. The embeddings, the LM
# head (bitsandbytes keeps the output embedding), norms and biases stay at the
# compute dtype: nnsight's nominal width counts them narrow too and undersizes
# a model by up to 40 % (its own docstring measures Llama-3.2-1B).
_UNQUANTIZED = re.compile(r"embed|wte|wpe|lm_head|(^|\.)shared\.weight$", re.IGNORECASE)
# bitsandbytes' 4-bit formats keep a float32 scale per block of 64 weights:
# 4/64 bytes over the half byte of each weight.
_BLOCK_SCALES = {"nf4": 0.125, "fp4": 0.125}


def _weight_files(snapshot: Path) -> list[Path]:
    """The checkpoint's safetensors files: at its root, or a diffusers pipeline's in
    its components' folders, each folder's plain files over its variants (``*.fp16.*``)."""
    if not (snapshot / "model_index.json").exists():
        return sorted(snapshot.glob("*.safetensors"))
    files = []
    for folder in sorted(path for path in snapshot.iterdir() if path.is_dir()):
        found = sorted(folder.glob("*.safetensors"))
        plain = [path for path in found if path.name.count(".") == 1]
        files += plain or found
    return files


def _snapshot_dir(repo_id: str, revision: Optional[str]) -> Optional[Path]:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached: size it another way (never as a local path: policy.model_policy)
        return None


def _safetensors_header(path: Path) -> dict:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def _from_nnsight(model_key: str, dtype: str) -> int:
    from nnsight.modeling.mixins.remotable import Remotable

    try:
        return Remotable.estimate_bytes(model_key, dtype)
    except Exception as error:  # noqa: BLE001 - reported to every waiting client
        repo = wire.repo_fields(model_key)["repo_id"]
        raise SizingError(
            f"Could not load model {repo!r} ({model_key}): it is not in this farm's model cache "
            f"and could not be sized from the hub ({type(error).__name__}: {error})"
        ) from None
