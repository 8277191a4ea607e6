"""The 0.6.x and 0.7.0 clients' nnsight: NDIF's server recipe of that era.

Their payload is a pickled ``RequestModel``: the block compiled into a
function (``interventions``) and the tracer it runs on. ``tracer.execute(fn)``
returns what it pushes back to the user's frame, the saved values; 0.6 counts
its trace depth in ``Globals`` (``enter``/``exit``), 0.7 does not. A model is
keyed as their ``LanguageModel`` with no task. Co-batching is the farm's own
nnsight's only, and ``.local()`` (a block streamed back to the client mid-job)
is refused with a sentence.
"""

from __future__ import annotations

import json
import pickle
import re
from typing import Any, Optional

from nnsight.intervention.tracing.globals import Globals
from nnsight.intervention.tracing.tracer import Cache
from nnsight.modeling.mixins.remoteable import RemoteableMixin, StreamTracer
from nnsight.schema.request import RequestModel

from ndif_celery.policy import model_policy

from . import cache_pickling

COBATCH = False
#: The client reads the result compressed when its request was.
RESULTS_COMPRESSED = True


class NotServed(Exception):
    """Something these clients can ask that this farm does not do, said as a sentence."""


def _no_streaming(tracer: Any, block: Any) -> None:
    raise NotServed("tracer.local() / session.local() (values sent to your machine in the middle of a job) is "
                    "not served by this farm: save the values, and run that code after the session ends.")


# Their server side of .local() streams a block back to the client over the socket; here it fails at once.
StreamTracer.execute = _no_streaming
cache_pickling.register(Cache.CacheDict)

_UNKNOWN_ID = re.compile(r"Unknown persistent id: (.+)")


def load(model_key: str, **kwargs) -> Any:
    """The canonical key as these versions load it: ``LanguageModel:{repo_id, revision}``."""
    key = model_policy.parse(model_key)
    if key.task != model_policy.LANGUAGE_MODEL_TASK or key.trust_remote_code:
        raise ValueError(f"nnsight {_version()} runtimes load language models only "
                         f"(task {model_policy.LANGUAGE_MODEL_TASK}, no trust_remote_code)")
    suffix = json.dumps({"repo_id": key.repo_id, "revision": key.revision or model_policy.DEFAULT_BRANCH})
    return RemoteableMixin.from_model_key(f"{model_policy.LANGUAGE_MODEL}:{suffix}", **kwargs)


def persistent_objects(model: Any) -> dict:
    """The payload's persistent ids (each module by path) on ``model``."""
    return model._remoteable_persistent_objects()


def set_env(model: Any, env: Optional[dict]) -> None:
    if env:
        raise ValueError(f"nnsight {_version()} clients send no env")


def deserialize(model: Any, blob: bytes, compress: bool, persistent: dict) -> Any:
    return RequestModel.deserialize(blob, persistent, compress)


def run(request: Any) -> dict:
    """Execute the block; the values it saved, by variable name."""
    tracer, block = request.tracer, request.interventions
    counted = hasattr(Globals, "enter")  # 0.6
    if counted:
        Globals.stack = 0
        Globals.enter()
    try:
        pushed = tracer.execute(block)
        if isinstance(pushed, dict) and pushed:
            return dict(pushed)
        return {name: value for name, value in tracer.info.frame.f_locals.items() if id(value) in Globals.saves}
    finally:
        if counted:
            Globals.exit()
            Globals.stack = 0


def caches(model: Any) -> list:
    """Compiled blocks and their sources, memoized by (filename, line). These
    versions also change the shared model for good (0.7's ``tracer.cache()``
    leaves its hooks on the modules, 0.6's ``.source`` swaps in an instrumented
    forward): ``workers.baseline`` puts the modules and envoys back as loaded."""
    return [Globals.cache.cache, Globals.cache.code_cache]


def unwind(model: Any) -> None:
    """Cancel what a failed or cancelled run left parked (0.6 names the interleaver ``_interleaver``)."""
    interleaver = getattr(model, "_interleaver", None) or getattr(model, "interleaver", None)
    if interleaver is not None and getattr(interleaver, "mediators", None):
        interleaver.cancel()


def after_run() -> None:
    Globals.saves.clear()


def clean_traceback(tb):
    return tb


def unknown_module(error: BaseException) -> Optional[str]:
    found = _UNKNOWN_ID.search(str(error)) if isinstance(error, pickle.UnpicklingError) else None
    return found.group(1) if found else None


def _version() -> str:
    import nnsight

    return nnsight.__version__
