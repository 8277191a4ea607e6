"""Status texts a client reads that more than one process writes, written once.

The web tells a new job its queue position and the farm controller tells it
again as the queue moves; the in-process and the isolated execution paths
both end a job that ran too long. Each text lives here so the two writers can
never drift apart (tests and researchers match on them: docs/researchers.md).

Torch-free: the web and the workers import it.
"""

from __future__ import annotations

from . import wire


def queued(model_key: str, position: int) -> str:
    """QUEUED: where the job waits (``position`` 1 is next)."""
    return f"Your job is queued for {wire.repo_id(model_key)} (position {position})."


def timed_out(timeout_s: float) -> str:
    """ERROR ``kind="timeout"``: the job ran past ``NDIF_EXECUTION_TIMEOUT_S``."""
    return f"Your job exceeded the execution timeout of {timeout_s:g}s."
