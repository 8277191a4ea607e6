"""The farm's own nnsight (0.8.x): its server recipe."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import nnsight
from nnsight.intervention.serialization import UnknownPersistentIdError
from nnsight.modeling.mixins.remotable import Remotable
from nnsight.schema.request import RequestModel
from nnsight.tracing import globals as nnsight_globals
from nnsight.tracing.tracer import _saves, dec, inc
from nnsight.tracing.util import clean_traceback  # noqa: F401 - the adapter's interface

from ndif_celery.policy import client_versions, model_policy

# Co-batching reaches into nnsight's interleaver: built and tested on the farm's own version only.
COBATCH = nnsight.__version__ == client_versions.MAIN
#: The client reads the result compressed when its request was.
RESULTS_COMPRESSED = True


def load(model_key: str, **kwargs) -> Any:
    """The key as the client wrote it: a runtime's deployment (0.8.0) drops the
    farm's runtime field, which nnsight would pass on to the model's class."""
    key = model_policy.parse(model_key)
    if key.nnsight:
        model_key = dataclasses.replace(key, nnsight="").key
    return Remotable.from_model_key(model_key, **kwargs)


def persistent_objects(model: Any) -> dict:
    """The payload's persistent ids (each module by path) on ``model``."""
    return model._remoteable_persistent_objects()


def set_env(model: Any, env: Optional[dict]) -> None:
    model._remoteable_set_env(env)


def deserialize(model: Any, blob: bytes, compress: bool, persistent: dict) -> Any:
    return RequestModel.deserialize(blob, persistent, compress=compress)


def run(tracer: Any) -> dict:
    """Execute the block; the values it saved, by variable name."""
    inc()
    try:
        tracer.execute(tracer.info.code)
        saves = _saves()
        return {name: value for name, value in tracer.info.frame.f_locals.items() if id(value) in saves}
    finally:
        dec()


def caches(model: Any) -> list:
    """nnsight memoizes compiled blocks by (filename, line), and payloads register their source."""
    return [nnsight_globals.SOURCES, nnsight_globals.BLOCKS]


def unwind(model: Any) -> None:
    """Cancel what a failed or cancelled run left parked."""
    model.interleaver.cancel()


def after_run() -> None:
    pass


def unknown_module(error: BaseException) -> Optional[str]:
    return str(error) if isinstance(error, UnknownPersistentIdError) else None
