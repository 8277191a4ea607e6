"""A resident model's weights in memory another process can map, and mapping them.

The zygote (``workers.isolation.zygote``) is a separate, freshly started interpreter
that must run untrusted blocks on the worker's model without a copy of its
weights and without being able to change them:

* **CPU**: every parameter and buffer moves into one ``memfd`` (the worker's
  tensors become views of a shared mapping of it, same values); the zygote maps
  the same file ``MAP_PRIVATE``, so its children read the worker's pages and a
  write copies the page into the writer alone (as a fork's copy-on-write did).
* **CUDA**: the tensors on each GPU move into one flat buffer per device (its
  own allocation, so the handle exposes nothing else) whose CUDA IPC handle a
  child opens after it has initialised CUDA. An IPC mapping is writable, so the
  worker checks those weights after every untrusted job with a keyed
  fingerprint (``workers.models.integrity``) and reloads on any change.

``share`` runs in the worker; ``attach`` in the zygote (CPU regions) and in
each child (CUDA regions). The manifest that connects them is plain data:
names, dtypes, shapes, strides and offsets, no code. A quantized model's
bitsandbytes layers are described too (``workers.quantized``): the skeleton
gets the same layer classes, and the scales they keep beside their weights
are shared like the weights.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field

import torch

from workers import quantized

ALIGN = 64  # bytes: every region starts aligned for any dtype and vector loads
_CUDA_GRANULE = 2 << 20


@dataclass
class Shared:
    """What the worker hands the zygote: the manifest, the CPU file, the CUDA handles."""

    manifest: list = field(default_factory=list)  # one dict per (module, tensor name)
    regions: list = field(default_factory=list)  # one dict per distinct storage
    cpu_fd: int = -1
    cpu_bytes: int = 0
    cuda: dict = field(default_factory=dict)  # device index -> (rebuild args for its flat buffer)
    keep: list = field(default_factory=list)  # the worker's flat buffers (kept alive)
    quantized: list = field(default_factory=list)  # workers.quantized.describe: its bitsandbytes layers

    def header(self) -> dict:
        return {"manifest": self.manifest, "regions": self.regions, "cpu_bytes": self.cpu_bytes,
                "cuda": {str(k): v for k, v in self.cuda.items()}, "quantized": self.quantized}


def _tensors(module: torch.nn.Module):
    """(module path, kind, name, tensor) for every parameter and buffer, tied ones
    included, then the tensors quantized layers keep beside their weights."""
    for path, sub in module.named_modules(remove_duplicate=False):
        for name, tensor in sub._parameters.items():
            if tensor is not None:
                yield path, "param", name, tensor
        for name, tensor in sub._buffers.items():
            if tensor is not None:
                yield path, "buffer", name, tensor
    yield from quantized.extra_tensors(module)


def _key(tensor: torch.Tensor) -> tuple:
    storage = tensor.untyped_storage()
    return (tensor.device.type, tensor.device.index, storage.data_ptr())


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def share(module: torch.nn.Module) -> Shared:
    """Move ``module``'s tensors into shareable memory (in place, same values)."""
    shared = Shared(quantized=quantized.describe(module))
    storages: dict[tuple, int] = {}  # storage key -> region index
    sizes: dict[str, int] = {}  # device name -> bytes so far
    originals = []
    for path, kind, name, tensor in _tensors(module):
        key = _key(tensor)
        if key not in storages:
            storage = tensor.untyped_storage()
            device = str(tensor.device)
            start = sizes.get(device, 0)
            sizes[device] = _aligned(start + storage.nbytes())
            storages[key] = len(shared.regions)
            shared.regions.append({"device": device, "start": start, "nbytes": storage.nbytes()})
            originals.append(storage)
        shared.manifest.append({
            "module": path, "kind": kind, "name": name, "region": storages[key],
            "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "stride": list(tensor.stride()), "offset": tensor.storage_offset(),
            "requires_grad": bool(tensor.requires_grad), "parameter": isinstance(tensor, torch.nn.Parameter),
        })
    flats = {}
    for device, total in sizes.items():
        total = max(total, ALIGN)
        if device == "cpu":
            fd = os.memfd_create("ndif-weights", os.MFD_CLOEXEC)
            os.ftruncate(fd, total)
            mapping = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            flats[device] = torch.frombuffer(mapping, dtype=torch.uint8)
            shared.cpu_fd, shared.cpu_bytes = fd, total
        else:
            # Its own cudaMalloc, sized to the allocator's 2 MiB granule: an IPC
            # handle maps the whole allocation, and no other tensor may share it.
            torch.cuda.empty_cache()
            total = (total + _CUDA_GRANULE - 1) // _CUDA_GRANULE * _CUDA_GRANULE
            flats[device] = torch.empty(total, dtype=torch.uint8, device=device)
    with torch.no_grad():
        for region, storage in zip(shared.regions, originals):
            target = flats[region["device"]][region["start"] : region["start"] + region["nbytes"]]
            source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            target.copy_(source)
    _point(module, shared.header(), flats, in_place=True)
    for device, flat in flats.items():
        if device != "cpu":
            from torch.multiprocessing.reductions import reduce_tensor

            index = torch.device(device).index
            shared.cuda[index] = reduce_tensor(flat)[1]
    shared.keep = list(flats.values())
    return shared


def attach(module: torch.nn.Module, header: dict, cpu_fd: int = -1, devices: str = "cpu") -> None:
    """Point ``module`` (a skeleton: the same structure, meta tensors) at the shared weights.

    ``devices`` is ``"cpu"`` (the zygote: CPU regions, mapped privately) or
    ``"cuda"`` (a child: CUDA regions, through their IPC handles)."""
    if devices == "cpu":  # the zygote: its skeleton's quantized layers, as the worker's (a child inherits them)
        quantized.rebuild(module, header.get("quantized", []))
    flats = {}
    if devices == "cpu" and header["cpu_bytes"]:
        mapping = mmap.mmap(cpu_fd, header["cpu_bytes"], flags=mmap.MAP_PRIVATE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
        flats["cpu"] = torch.frombuffer(mapping, dtype=torch.uint8)
    if devices == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        for index, args in header["cuda"].items():
            flats[f"cuda:{index}"] = rebuild_cuda_tensor(*args)
    _point(module, header, flats)


def _point(module: torch.nn.Module, header: dict, flats: dict, in_place: bool = False) -> None:
    """Re-point every manifest entry whose region lives in ``flats``.

    ``in_place`` (the worker) keeps each Parameter object and swaps its data;
    otherwise (a skeleton) new Parameters are made, one per tied tensor."""
    manifest, regions = header["manifest"], header["regions"]
    made: dict[tuple, torch.Tensor] = {}  # one object per (region, view): ties stay tied
    modules = dict(module.named_modules(remove_duplicate=False))
    layers = {spec["path"]: spec for spec in header.get("quantized", [])}
    for entry in manifest:
        region = regions[entry["region"]]
        flat = flats.get(region["device"])
        if flat is None:
            continue
        key = (entry["region"], entry["offset"], tuple(entry["shape"]), tuple(entry["stride"]), entry["dtype"])
        tensor = made.get(key)
        if tensor is None:
            dtype = getattr(torch, entry["dtype"])
            raw = flat[region["start"] : region["start"] + region["nbytes"]]
            typed = raw.view(dtype) if region["nbytes"] else torch.empty(0, dtype=dtype, device=flat.device)
            # as_strided's offset counts from the flat buffer's start, not the view's.
            tensor = typed.as_strided(entry["shape"], entry["stride"], typed.storage_offset() + entry["offset"])
            spec = layers.get(entry["module"])
            if entry["parameter"] and not in_place and spec is not None and entry["name"] == "weight":
                tensor = quantized.weight(modules[entry["module"]], spec, tensor)
            elif entry["parameter"] and not in_place:
                tensor = torch.nn.Parameter(tensor, requires_grad=entry["requires_grad"])
            made[key] = tensor
        owner = modules[entry["module"]]
        if entry["kind"] in (quantized.QUANT_STATE, quantized.INT8_STATE):
            quantized.point(owner, layers[entry["module"]], entry["kind"], entry["name"], tensor)
        elif entry["kind"] == "param" and in_place:
            owner._parameters[entry["name"]].data = tensor
        elif entry["kind"] == "param":
            owner._parameters[entry["name"]] = tensor
        else:
            owner._buffers[entry["name"]] = tensor
