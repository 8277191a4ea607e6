"""A quantized model's bitsandbytes layers: held still, and rebuilt in a skeleton.

bitsandbytes changes its layers lazily, and a resident model must not change
between requests (``workers.baseline`` puts back what a request changed;
``workers.models.integrity`` reloads weights that moved). :func:`settle` makes
its two lazy changes once, at load:

* ``Linear8bitLt`` moves its int8 weights and scales into its ``state`` on
  its first forward, and reassigns ``weight.data`` on every forward.
* ``Linear4bit`` on a CPU with AVX512-BF16 repacks its weights in place on
  its first forward without gradients. After that no gradient can flow
  through the layer (an in-place add on a view of a leaf). Turned off here.
  GPUs never repack.

Settling changes no value: a settled model computes what a freshly loaded
one computes on its first request.

A jailed child runs on a skeleton of the model whose tensors map the
worker's (``workers.isolation.shared_weights``). A quantized layer keeps
tensors beside its weight (the 4-bit scales, the int8 row scales):
:func:`extra_tensors` names them so they are shared and checked like weights,
:func:`describe` and :func:`rebuild` make the skeleton's layers the same
classes as the worker's.
"""

from __future__ import annotations

import sys
from typing import Any, Iterator

#: The kinds of tensor a quantized layer keeps beside its parameters.
QUANT_STATE = "quant_state"  # a Linear4bit's weight.quant_state: absmax, code
INT8_STATE = "int8_state"  # a Linear8bitLt's state: SCB


def _bnb() -> Any:
    """bitsandbytes if this process imported it (transformers does, to quantize)."""
    return sys.modules.get("bitsandbytes")


def settle(module: Any) -> int:
    """Settle every bitsandbytes layer of ``module``; how many there were."""
    bnb = _bnb()
    if bnb is None:
        return 0
    count = 0
    for layer in module.modules():
        if isinstance(layer, bnb.nn.Linear4bit):
            layer.support_avx512bf16_for_cpu = False
            count += 1
        elif isinstance(layer, bnb.nn.Linear8bitLt):
            if layer.weight.CB is not None:
                layer.init_8bit_state()
            if not layer.state.has_fp16_weights and layer.state.CB is not None:
                layer.weight.data = layer.state.CB
            layer.state.is_training = layer.training
            count += 1
    return count


def refused_formats() -> dict:
    """Each quantization nnsight will not load on this machine, with its reason.

    Asked of nnsight's own table (each format's ``build``), so its rules stay
    its own: ``fp8`` refuses without a GPU of compute capability 8.9. Only
    asked on a worker with no GPU, where asking cannot initialise CUDA; a GPU
    worker finds out at its load, and the controller tries another. A
    runtime's older nnsight has no such table: its worker is never sent a
    quantized model (the intake refuses those clients one)."""
    try:
        from nnsight.modeling import quantization
    except ImportError:
        return {}

    refused = {}
    for name, fmt in quantization.QUANTIZATIONS.items():
        try:
            fmt.build(quantization._torch_dtype(fmt.compute_dtype))
        except Exception as error:  # noqa: BLE001 - any refusal is one, in nnsight's words
            refused[name] = f"{type(error).__name__}: {error}" if not isinstance(error, ValueError) else str(error)
    return refused


def is_quantized(module: Any) -> bool:
    """Whether transformers loaded ``module`` through a quantizer."""
    return getattr(module, "hf_quantizer", None) is not None


class Unshareable(Exception):
    """A quantized layer a skeleton cannot rebuild."""


def extra_tensors(module: Any) -> Iterator[tuple]:
    """(module path, kind, name, tensor) for the tensors each settled
    bitsandbytes layer keeps beside its parameters."""
    bnb = _bnb()
    if bnb is None:
        return
    for path, layer in module.named_modules():
        if isinstance(layer, bnb.nn.Linear4bit):
            state = layer.weight.quant_state
            if state is None or state.nested:
                raise Unshareable(f"{path}: a 4-bit layer with {'no' if state is None else 'nested'} quantization "
                                  "state cannot be shared with a jailed child")
            yield path, QUANT_STATE, "absmax", state.absmax
            yield path, QUANT_STATE, "code", state.code
        elif isinstance(layer, bnb.nn.Linear8bitLt):
            scales = layer.state.SCB if layer.state.SCB is not None else layer.weight.SCB  # settled, or not yet
            if scales is None:
                raise Unshareable(f"{path}: an 8-bit layer without its row scales cannot be shared with a jailed "
                                  "child")
            yield path, INT8_STATE, "SCB", scales


def describe(module: Any) -> list[dict]:
    """Plain data for :func:`rebuild`: each bitsandbytes layer's class and arguments."""
    bnb = _bnb()
    if bnb is None:
        return []
    layers = []
    for path, layer in module.named_modules():
        if isinstance(layer, bnb.nn.Linear4bit):
            state = layer.weight.quant_state
            layers.append({
                "path": path, "class": "Linear4bit", "in_features": layer.in_features,
                "out_features": layer.out_features, "bias": layer.bias is not None,
                "compute_dtype": _name(layer.compute_dtype), "quant_type": state.quant_type,
                "blocksize": state.blocksize, "quant_storage": _name(layer.weight.quant_storage),
                "shape": list(state.shape), "dtype": _name(state.dtype),
            })
        elif isinstance(layer, bnb.nn.Linear8bitLt):
            layers.append({
                "path": path, "class": "Linear8bitLt", "in_features": layer.in_features,
                "out_features": layer.out_features, "bias": layer.bias is not None,
                "threshold": layer.state.threshold,
            })
    return layers


def rebuild(module: Any, layers: list[dict]) -> None:
    """Replace the skeleton's modules at ``layers``' paths with empty (meta)
    bitsandbytes layers of the worker's classes, settled as the worker's are."""
    if not layers:
        return
    import bitsandbytes as bnb  # the worker's model has these layers: so does its skeleton
    import torch

    modules = dict(module.named_modules())
    for spec in layers:
        parent_path, _, child = spec["path"].rpartition(".")
        if spec["class"] == "Linear4bit":
            layer = bnb.nn.Linear4bit(spec["in_features"], spec["out_features"], bias=spec["bias"],
                                      compute_dtype=getattr(torch, spec["compute_dtype"]),
                                      quant_type=spec["quant_type"],
                                      quant_storage=getattr(torch, spec["quant_storage"]), device="meta")
        else:
            layer = bnb.nn.Linear8bitLt(spec["in_features"], spec["out_features"], bias=spec["bias"],
                                        has_fp16_weights=False, threshold=spec["threshold"], device="meta")
        layer.requires_grad_(False)
        setattr(modules[parent_path] if parent_path else module, child, layer)
    settle(module)


def point(layer: Any, spec: dict, kind: str, name: str, tensor: Any) -> None:
    """Set one of :func:`extra_tensors`' tensors on a rebuilt (or the worker's own) layer."""
    if kind == QUANT_STATE:
        setattr(layer.weight.quant_state, name, tensor)
    else:
        layer.state.SCB = tensor
        layer.state.CB = layer.weight.data


def weight(layer: Any, spec: dict, data: Any) -> Any:
    """The parameter a rebuilt layer's weight must be: bitsandbytes' own class over ``data``."""
    import bitsandbytes as bnb
    import torch
    from bitsandbytes.functional import QuantState

    if spec["class"] == "Linear4bit":
        state = QuantState(absmax=None, shape=torch.Size(spec["shape"]), code=None, blocksize=spec["blocksize"],
                           quant_type=spec["quant_type"], dtype=getattr(torch, spec["dtype"]))
        return bnb.nn.Params4bit(data, requires_grad=False, quant_state=state, blocksize=spec["blocksize"],
                                 quant_type=spec["quant_type"], quant_storage=getattr(torch, spec["quant_storage"]),
                                 module=layer, bnb_quantized=True)
    return bnb.nn.Int8Params(data, requires_grad=False, has_fp16_weights=False)


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")
