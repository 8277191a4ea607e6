"""Co-batching: several trusted users' traces on one model, one forward.

Different users' nnsight 0.8.1 requests for the same resident model share one
forward. Each is prepared in its own greenlet up to its forward. nnsight's own
interleaving merges them into one batched forward. Then each is finished on its
own, so each user gets exactly their own saves, logs, errors and ``meta``. A
request that cannot share safely runs alone, through the trusted path.
``meta["cobatch_solo"]`` says why. The design, its guards and what it refuses
are in docs/cobatching.md. The decision and its measurements are in
docs/decisions/cobatching.md.

Public entry::

    outcomes = run_batch(model, [Request(job_id, blob, compress, env, log), ...],
                         max_batch=settings.cobatch_max, pad=settings.cobatch_pad,
                         restore=...)

Modules, one job each:

``request`` - :class:`Request`, :class:`Outcome` and ``run_alone``, the trusted
  path for whatever does not share.
``screen`` - what may share a forward, and the sentence for what may not.
``park`` - a request's greenlet, parked at its forward. Saves, depth and logs are
  per request; errors are kept to their own worker.
``batcher`` - the co-batcher: rows, sequence window, flattened rows, cache
  snapshots, and ``compact`` of saved views. Each worker is served copies of its
  own part, and their writes are put back. Changes of shared values are refused.
``engine`` - ``run_batch``: prepare, group, one guarded forward per group, finish,
  and the runs alone.
"""

from .request import Outcome, Request, run_alone


def run_batch(*args, **kwargs):
    """``engine.run_batch``, imported at first use: the engine needs the farm's
    own nnsight, and a runtime's worker (``workers.adapters``) never batches."""
    from .engine import run_batch as run

    return run(*args, **kwargs)


__all__ = ["Outcome", "Request", "run_alone", "run_batch"]
