"""What differs between the nnsight versions a worker can run: one module per minor version.

A request runs only under its client's own nnsight (docs/versions.md). So a
runtime's worker (``ndif-celery worker --nnsight 0.7.0``) imports that version,
not the farm's. The rest of a job's life is the same: the queue, the deadline,
the jail, the store, the ledger. What differs is here, behind one small
interface per minor:

``nnsight_08`` - the farm's own (0.8.x): the model by its key, the payload read
  under the request's env, the block run for its saves.
``nnsight_05`` - the 0.5.x clients. The same keys as 0.6/0.7; the payload is
  zlib'd bytecode (cloudpickle), run in a frame the adapter owns; results
  go back uncompressed.
``nnsight_06_07`` - the 0.6.x and 0.7.0 clients. The model is keyed as their
  ``LanguageModel``. The payload is a pickled ``RequestModel`` of the compiled
  block and its tracer. The saves are what the tracer pushes back.

Each module gives:

- ``load(model_key, **kwargs)``, for a canonical key from ``ndif_celery.policy.model_policy``;
- ``persistent_objects(model)``: the payload's persistent ids on the model;
- ``set_env(model, env)``;
- ``deserialize(model, blob, compress, persistent)``;
- ``run(prepared)``;
- ``caches(model)``: the process-global dicts a request may fill, restored after it.
  What a request changes on the model itself is ``workers.baseline``'s;
- ``after_run()``;
- ``unwind(model)``: cancel what a failed run left parked;
- ``clean_traceback(tb)``;
- ``unknown_module(error)``: the module path a payload named that this model lacks, or None;
- ``COBATCH``: whether co-batching runs on it;
- ``RESULTS_COMPRESSED``: whether a compressed request's result is compressed too.
"""

from __future__ import annotations

import functools
from types import ModuleType

from packaging.version import Version


@functools.lru_cache(maxsize=1)
def current() -> ModuleType:
    """The adapter of the nnsight this process imports."""
    import nnsight

    version = Version(nnsight.__version__)
    if version >= Version("0.8.0"):
        from . import nnsight_08 as adapter
    elif version >= Version("0.6.0"):
        from . import nnsight_06_07 as adapter
    elif version >= Version("0.5.0"):
        from . import nnsight_05 as adapter
    else:
        raise RuntimeError(f"nnsight {nnsight.__version__} has no adapter on this farm (0.5 and later run)")
    return adapter
