"""Co-batching: several trusted users' traces on one model, one forward.

Different users' nnsight 0.8.1 requests for the same resident model are
prepared each in its own greenlet up to their forward, merged through
nnsight's own interleaving into one batched forward, and finished one by one,
so each user gets exactly their own saves, logs, errors and ``meta``. A
request that cannot share safely runs alone, through the trusted path, and
``meta["cobatch_solo"]`` says why. The design, its guards and what it refuses
are in docs/cobatching.md; the decision and its measurements are in
docs/decisions/cobatching.md.

Public entry::

    outcomes = run_batch(model, [Request(job_id, blob, compress, env, log), ...],
                         max_batch=settings.cobatch_max, pad=settings.cobatch_pad,
                         restore=...)

Modules, one job each:

* ``request``: :class:`Request`, :class:`Outcome` and ``run_alone`` (the
  trusted path of today, for whatever does not share);
* ``screen``: what may share a forward, and the sentence for what may not;
* ``park``: a request's greenlet, parked at its forward; per-request saves,
  depth and logs; errors kept to their own worker;
* ``batcher``: the co-batcher (rows, sequence window, flattened rows, each
  worker served copies of its own part and their writes put back, cache
  snapshots, refused changes of shared values) and ``compact`` of saved views;
* ``engine``: ``run_batch``: prepare, group, one forward per group with its
  guards, finish, and the runs alone.
"""

from .request import Outcome, Request, run_alone


def run_batch(*args, **kwargs):
    """``engine.run_batch``, imported at first use: the engine needs the farm's
    own nnsight, and a runtime's worker (``workers.adapters``) never batches."""
    from .engine import run_batch as run

    return run(*args, **kwargs)


__all__ = ["Outcome", "Request", "run_alone", "run_batch"]
