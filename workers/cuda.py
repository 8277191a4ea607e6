"""What this process has done with CUDA.

Apart from the resident models because the fork server asks too: a process
that has initialised CUDA cannot fork a usable child.
"""

from __future__ import annotations

from typing import Any

import torch


def on_gpu(tensors: Any) -> bool:
    """Whether any of ``(name, tensor)`` pairs lives on a GPU."""
    return any(t.device.type == "cuda" for _, t in tensors)


def gpus_visible() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def cuda_initialized() -> bool:
    """Whether this process has initialised CUDA (after which it cannot fork a usable child)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def empty_cuda_cache() -> None:
    if cuda_initialized():
        torch.cuda.empty_cache()
