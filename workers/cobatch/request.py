"""What goes into a co-batch and what comes out, and the run of one request alone.

A :class:`Request` is what the worker already has for a job (its payload and
how to read it, its env, where its LOG lines go); an :class:`Outcome` is what
the trusted path produces today (the saved-values dict ``execute.run``
returns, or the ``RequestError`` the client reads) plus ``meta`` saying how it
ran. :func:`run_alone` is that trusted path itself, line for line as
``executors.InProcess.run`` does it (``request_scope``, ``deserialize``,
``run``, the user's error formatted while the source is still registered), so a
request that does not share a forward behaves exactly as it does today.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from workers import execute


@dataclass
class Request:
    """One trusted job's request: ``blob`` as the client POSTed it (zstd when
    ``compress``), ``env`` from its envelope, ``log`` for its LOG lines."""

    job_id: str
    blob: bytes
    compress: bool = False
    env: dict = field(default_factory=dict)
    log: Callable[[str], None] = lambda line: None
    trusted: bool = True


@dataclass
class Outcome:
    """``saved`` (name -> value, for ``results.encode``) or ``error`` (the
    ``execute.RequestError`` the client reads), and ``meta``:

    * ``cobatch``: how many requests shared the forward it ran in (1: alone;
      for a session, its largest);
    * ``cobatch_solo``: why it ran alone, when it did (absent otherwise).
    """

    job_id: str
    saved: Optional[dict] = None
    error: Optional[execute.RequestError] = None
    meta: dict = field(default_factory=dict)
    deserialize_ms: Optional[float] = None  # run alone: how long its payload took to read (the ledger's timing)

    @property
    def ok(self) -> bool:
        return self.error is None


def run_alone(model: Any, request: Request, why: str) -> Outcome:
    """The request alone, exactly as the trusted path runs it today."""
    outcome = Outcome(request.job_id, meta={"cobatch": 1, "cobatch_solo": why})
    started = time.perf_counter()
    with execute.request_scope(model):
        try:
            tracer = execute.deserialize(model, request.blob, request.compress, request.env)
            outcome.deserialize_ms = round((time.perf_counter() - started) * 1000, 1)
            outcome.saved = execute.run(tracer, request.log)
        except Exception as error:  # noqa: BLE001 - user code may raise anything
            # Formatted inside the scope: linecache still holds the user's source.
            outcome.error = execute.RequestError(execute.format_user_error(error))
    return outcome
