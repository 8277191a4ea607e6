"""The models this worker keeps loaded, by model key.

The controller decides what a worker holds; this module only loads and drops.
A model is built once from its model key (from the HF cache, or the hub when
reachable) and stays resident for every later job until it is evicted.
"""

from __future__ import annotations

import gc
import logging
import os
import secrets
import time
from typing import Any, Optional

from . import integrity
from .execute import RequestError, no_grad_weights

log = logging.getLogger(__name__)


class ResidentModels:
    def __init__(self, verify_untrusted: bool = False) -> None:
        # NDIF_VERIFY_UNTRUSTED: the keyed check after every untrusted job on
        # every model, not only on GPU models (whose weights a child can write).
        self.verify_untrusted = verify_untrusted
        self.models: dict[str, Any] = {}
        self.fingerprints: dict[str, dict] = {}
        self.zygotes: dict[str, Any] = {}  # model key -> its workers.zygote.Zygote (NDIF_ISOLATION=zygote)
        self.shared: dict[str, Any] = {}  # model key -> its shared_weights.Shared
        self.keyed: dict[str, tuple] = {}  # model key -> (KeyedHash, its fingerprint at load): checked after untrusted jobs
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

        from ndif_celery import config, model_policy

        try:  # again here, whoever sent the load: never a key the policy refuses
            canonical = model_policy.Policy.from_settings(config.load()).loadable(model_key)
        except model_policy.PolicyError as error:
            raise RequestError(f"Could not load model: {error.detail}", kind="deploy") from None
        started = time.monotonic()
        kwargs = {"dispatch": True}
        if dtype:
            kwargs["dtype"] = dtype
        if _gpus_visible():
            # Onto this worker's GPUs (CUDA_VISIBLE_DEVICES is its own), spread
            # over them when there are several, loaded straight there.
            kwargs["device_map"] = "auto"
        try:
            model = Remotable.from_model_key(canonical, **kwargs)
        except Exception as error:  # noqa: BLE001 - any load failure is reported to the jobs
            raise RequestError(
                f"Could not load model {repo_fields(model_key)['repo_id']!r} ({model_key}): "
                f"{type(error).__name__}: {error}"
            ) from None
        no_grad_weights(model._module)
        self.models[model_key] = model
        self.fingerprints[model_key] = integrity.fingerprint(model._module)
        if self.verify_untrusted or _on_gpu(model._module):
            # A fresh key per load, drawn here and never handed to any child.
            keyed = integrity.KeyedHash(secrets.token_bytes(32))
            self.keyed[model_key] = (keyed, keyed.fingerprint(model._module))
        self.dtypes[model_key] = dtype
        return round(time.monotonic() - started, 3)

    def zygote(self, model_key: str, fork_server: Any = None) -> Optional[Any]:
        """The model's zygote (``workers.zygote``), started on first use: its
        weights move into shared memory once, then a clean process maps them
        (exec'd, or forked from ``fork_server``: ``workers.forkserver``)."""
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
            # (the keyed fingerprint, taken at load, depends on the values only)
        zygote = self.zygotes[model_key] = Zygote(model, shared, model_key, self.dtypes.get(model_key),
                                                  fork_server=fork_server)
        return zygote

    def drop_zygote(self, model_key: str) -> None:
        zygote = self.zygotes.pop(model_key, None)
        if zygote is not None:
            zygote.close()

    def restore_if_changed(self, model_key: str) -> list[str]:
        """After a trusted job: reload the model if its plain fingerprint changed; return what had changed."""
        model = self.models.get(model_key)
        if model is None:
            return []
        changed = integrity.changed(model._module, self.fingerprints[model_key])
        if changed:
            self._reload(model_key)
        return changed

    def checks_untrusted(self, model_key: str) -> bool:
        """Whether untrusted jobs on this model are followed by the keyed check: its weights are on a GPU
        (a zygote's child maps them writable), or the operator asked for it (NDIF_VERIFY_UNTRUSTED)."""
        return model_key in self.keyed

    def check_after_untrusted(self, model_key: str) -> list[str]:
        """After an untrusted job, however it ended, once its child is dead: compare the keyed
        fingerprint, reload the model on any change; return what had changed.

        Fails closed: if the check itself fails, the model is evicted (the
        next job loads it afresh) rather than served unverified."""
        model = self.models.get(model_key)
        if model is None or model_key not in self.keyed:
            return []
        keyed, expected = self.keyed[model_key]
        try:
            changed = integrity.changed(model._module, expected, key=keyed)
        except Exception as error:  # noqa: BLE001 - an unverifiable model is not served
            log.exception("the keyed weight check of %s failed; evicting the model", model_key)
            self.evict(model_key)
            return [f"(the check failed: {type(error).__name__})"]
        if changed:
            self._reload(model_key)
        return changed

    def _reload(self, model_key: str) -> None:
        dtype = self.dtypes.get(model_key)
        self.evict(model_key)
        self.load(model_key, dtype)

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


def _on_gpu(module: Any) -> bool:
    return any(t.device.type == "cuda" for _, t in integrity.named_tensors(module))


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
