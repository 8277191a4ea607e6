"""The models this worker keeps loaded, by model key.

A model is built once from its model key (from the HF cache, or the hub when
reachable) and stays resident for every later job; the farm's placement and
eviction build on this.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ndif_celery import registry, wire

from .execute import RequestError, no_grad_weights


class ResidentModels:
    def __init__(self, redis_client, worker_name: str) -> None:
        self.redis = redis_client
        self.worker = worker_name
        self.models: dict[str, Any] = {}

    def get(self, model_key: str, deploying: Callable[[str], None]) -> Any:
        """The resident model for ``model_key``, loading it first if needed."""
        model = self.models.get(model_key)
        if model is None:
            model = self._load(model_key, deploying)
            self.models[model_key] = model
        return model

    def _load(self, model_key: str, deploying: Callable[[str], None]) -> Any:
        from nnsight.modeling.mixins.remotable import Remotable

        repo = wire.repo_fields(model_key)["repo_id"]
        deploying(f"Loading {repo} onto {self.worker} (first request for this model here).")
        registry.set_deployment(self.redis, self.worker, model_key, "DEPLOYING")
        started = time.monotonic()
        try:
            model = Remotable.from_model_key(model_key, dispatch=True)
        except Exception as error:  # noqa: BLE001 - any load failure is reported to the job
            registry.remove_deployment(self.redis, self.worker, model_key)
            raise RequestError(
                f"Could not load model {repo!r} ({model_key}): {type(error).__name__}: {error}"
            ) from None
        no_grad_weights(model._module)
        seconds = round(time.monotonic() - started, 3)
        registry.set_deployment(
            self.redis, self.worker, model_key, "RUNNING", loaded_at=time.time(), load_seconds=seconds
        )
        return model

    def keys(self) -> list[str]:
        return list(self.models)
