"""The 0.5.x clients' nnsight: NDIF's server recipe of that era.

Their payload is a zlib'd cloudpickle of a ``RequestModel``: the block
compiled into a function, sent as CPython bytecode (so it runs only on the
client's Python minor), and the tracer it runs on. The block pushes its saved
values into the frame that runs it; this adapter runs it in a frame of its
own and keeps what ``Globals.saves`` names. Results go back uncompressed:
the 0.5 client decompresses nothing.

cloudpickle 3.1.3 and later write every code object's filename as
``<dynamic-code>``. nnsight 0.5 finds its own frames by the ``<nnsight``
prefix, so those payloads fail without a repair: each code object nnsight
compiled (named ``__nnsight...``) gets that prefix back, with the code
nested in it.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import pickle
import re
import sys
import types
import zlib
from typing import Any, Optional

from nnsight.intervention import serialization
from nnsight.intervention.tracing import base as tracing_base
from nnsight.intervention.tracing.globals import Globals
from nnsight.intervention.tracing.tracer import Cache
from nnsight.modeling.mixins.remoteable import RemoteableMixin, StreamTracer

from ndif_celery.policy import model_policy

from . import cache_pickling

COBATCH = False
#: The 0.5 client reads its result as plain ``torch.save`` bytes.
RESULTS_COMPRESSED = False

#: What cloudpickle 3.1.3 writes as every code object's filename, and what nnsight 0.5 looks for.
_ANONYMOUS = "<dynamic-code>"
_REPAIRED = "<nnsight-remote>"
_UNKNOWN_ID = re.compile(r"Unknown persistent id: (.+)")


class NotServed(Exception):
    """Something these clients can ask that this farm does not do, said as a sentence."""


def _no_streaming(tracer: Any, block: Any) -> None:
    raise NotServed("tracer.local() (values sent to your machine in the middle of a job) is not served by this "
                    "farm: save the values, and run that code after the trace ends.")


StreamTracer.execute = _no_streaming
cache_pickling.register(Cache.CacheDict)


@contextlib.contextmanager
def _quiet():
    """What a block's inner ``with`` prints while nnsight swaps trace functions,
    dropped in memory: 0.5 writes it to ``os.devnull``, which a jailed child may not open."""
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = io.StringIO()
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


tracing_base.suppress_all_output = _quiet


def load(model_key: str, **kwargs) -> Any:
    """The canonical key as 0.5 loads it: ``LanguageModel:{repo_id, revision}``."""
    key = model_policy.parse(model_key)
    if key.task != model_policy.LANGUAGE_MODEL_TASK or key.trust_remote_code:
        raise ValueError(f"nnsight {_version()} runtimes load language models only "
                         f"(task {model_policy.LANGUAGE_MODEL_TASK}, no trust_remote_code)")
    suffix = json.dumps({"repo_id": key.repo_id, "revision": key.revision or model_policy.DEFAULT_BRANCH})
    return RemoteableMixin.from_model_key(f"{model_policy.LANGUAGE_MODEL}:{suffix}", **kwargs)


def set_env(model: Any, env: Optional[dict]) -> None:
    if env:
        raise ValueError(f"nnsight {_version()} clients send no env")


def persistent_objects(model: Any) -> dict:
    """0.5 binds the payload's envoys to the model by path while unpickling: no table."""
    return {}


def deserialize(model: Any, blob: bytes, compress: bool, persistent: dict) -> Any:
    """``compress`` is the client's ``nnsight-zlib``. The web checked the
    inflated size against NDIF_MAX_PAYLOAD_BYTES before the job was queued."""
    data = zlib.decompress(blob) if compress else blob
    return _RepairingUnpickler(data, model).load()


class _RepairingUnpickler(serialization.CustomCloudUnpickler):
    """nnsight 0.5's own unpickler, building code objects through :func:`_code`."""

    def __init__(self, data: bytes, model: Any) -> None:
        import io

        super().__init__(io.BytesIO(data), model, None)

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)
        if name == "_builtin_type" and module.startswith("cloudpickle"):
            return lambda type_name: _code if type_name == "CodeType" else found(type_name)
        return found


def _code(*args: Any) -> types.CodeType:
    code = types.CodeType(*args)
    return _repaired(code) if code.co_name.startswith("__nnsight") else code


def _repaired(code: types.CodeType) -> types.CodeType:
    """``code`` and the code nested in it, under nnsight's filename prefix."""
    if code.co_filename != _ANONYMOUS:
        return code
    consts = tuple(_repaired(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=_REPAIRED, co_consts=consts)


def run(request: Any) -> dict:
    """Execute the block in this frame; the values it saved, by variable name."""
    tracer, block = request.tracer, request.interventions
    frame = inspect.currentframe()
    tracer.info.frame = frame  # where the block pushes its variables
    for mediator in getattr(tracer, "mediators", None) or ():
        mediator.info.frame = frame
    Globals.stack = 0
    Globals.enter()
    try:
        tracer.execute(block)
    finally:
        Globals.exit()
        Globals.stack = 0
    pushed = dict(frame.f_locals)
    return {name: value for name, value in pushed.items() if id(value) in Globals.saves}


def caches(model: Any) -> list:
    """Compiled blocks, memoized by (filename, line)."""
    return [Globals.cache.cache]


def unwind(model: Any) -> None:
    """Cancel what a failed or cancelled run left parked."""
    interleaver = getattr(model, "_interleaver", None)
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
