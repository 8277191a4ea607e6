"""The models this worker keeps loaded, by model key.

The controller decides what a worker holds; this module only loads and drops.
A model is built once from its model key (from the HF cache, or the hub when
reachable) and stays resident for every later job until it is evicted.
"""

from __future__ import annotations

import gc
import os
import secrets
import time
from typing import Any, Optional

from . import integrity
from .execute import RequestError, no_grad_weights


class ResidentModels:
    def __init__(self) -> None:
        self.models: dict[str, Any] = {}
        self.fingerprints: dict[str, dict] = {}
        self.zygotes: dict[str, Any] = {}  # model key -> its workers.zygote.Zygote (NDIF_ISOLATION=zygote)
        self.shared: dict[str, Any] = {}  # model key -> its shared_weights.Shared
        self.keyed: dict[str, tuple] = {}  # model key -> (key, keyed fingerprint): GPU weights a child could write
        self.dtypes: dict[str, Optional[str]] = {}
        self.sizes: dict[str, int] = {}  # as placed, for re-registering

    def get(self, model_key: str) -> Optional[Any]:
        return self.models.get(model_key)

    def load(self, model_key: str, dtype: Optional[str] = None) -> float:
        """Load ``model_key`` (if not already here); return the seconds it took."""
        if model_key in self.models:
            return 0.0
        from nnsight.modeling.mixins.remotable import Remotable

        from ndif_celery.wire import repo_fields

        started = time.monotonic()
        kwargs = {"dispatch": True}
        if dtype:
            kwargs["dtype"] = dtype
        if _gpus_visible():
            # Onto this worker's GPUs (CUDA_VISIBLE_DEVICES is its own), spread
            # over them when there are several, loaded straight there.
            kwargs["device_map"] = "auto"
        try:
            model = Remotable.from_model_key(model_key, **kwargs)
        except Exception as error:  # noqa: BLE001 - any load failure is reported to the jobs
            raise RequestError(
                f"Could not load model {repo_fields(model_key)['repo_id']!r} ({model_key}): "
                f"{type(error).__name__}: {error}"
            ) from None
        no_grad_weights(model._module)
        self.models[model_key] = model
        self.fingerprints[model_key] = integrity.fingerprint(model._module)
        self.dtypes[model_key] = dtype
        return round(time.monotonic() - started, 3)

    def zygote(self, model_key: str) -> Optional[Any]:
        """The model's zygote (``workers.zygote``), started on first use: its
        weights move into shared memory once, then a clean process maps them."""
        from . import shared_weights
        from .zygote import Zygote

        model = self.models.get(model_key)
        if model is None:
            return None
        current = self.zygotes.get(model_key)
        if current is not None and current.fits(model):
            return current
        if current is not None:
            current.close()
        shared = self.shared.get(model_key)
        if shared is None:
            shared = self.shared[model_key] = shared_weights.share(model._module)
            self.fingerprints[model_key] = integrity.fingerprint(model._module)  # same values, new storage
            if shared.cuda:
                key = secrets.randbits(62)
                self.keyed[model_key] = (key, integrity.keyed_fingerprint(model._module, key))
        zygote = self.zygotes[model_key] = Zygote(model, shared, model_key, self.dtypes.get(model_key))
        return zygote

    def drop_zygote(self, model_key: str) -> None:
        zygote = self.zygotes.pop(model_key, None)
        if zygote is not None:
            zygote.close()

    def restore_if_changed(self, model_key: str, keyed: bool = False) -> list[str]:
        """Reload the model if a job changed its weights; return what had changed.

        ``keyed`` (after an untrusted job that could write the GPU weights
        through CUDA IPC) compares the keyed fingerprint, which an adversary
        who cannot read the key cannot preserve while changing a value."""
        model = self.models.get(model_key)
        if model is None:
            return []
        if keyed:
            if model_key not in self.keyed:
                return []
            key, expected = self.keyed[model_key]
            changed = integrity.changed(model._module, expected, key=key)
        else:
            changed = integrity.changed(model._module, self.fingerprints[model_key])
        if changed:
            dtype = self.dtypes.get(model_key)
            self.evict(model_key)
            self.load(model_key, dtype)
        return changed

    def evict(self, model_key: str) -> bool:
        self.drop_zygote(model_key)
        shared = self.shared.pop(model_key, None)
        if shared is not None and shared.cpu_fd >= 0:
            os.close(shared.cpu_fd)
        self.keyed.pop(model_key, None)
        model = self.models.pop(model_key, None)
        self.fingerprints.pop(model_key, None)
        if model is None:
            return False
        del model
        gc.collect()
        _empty_cuda_cache()
        return True

    def keys(self) -> list[str]:
        return list(self.models)


def _gpus_visible() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def cuda_initialized() -> bool:
    """Whether this process has initialised CUDA (after which it cannot fork a usable child)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _empty_cuda_cache() -> None:
    import torch

    if cuda_initialized():
        torch.cuda.empty_cache()
