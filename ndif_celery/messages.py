"""Status texts a client reads that more than one process writes, written once.

The web tells a new job its queue position and the farm controller tells it
again as the queue moves; the in-process and the isolated execution paths
both end a job that ran too long. Each text lives here so the two writers can
never drift apart (tests and researchers match on them: docs/researchers.md).

Torch-free: the web and the workers import it.
"""

from __future__ import annotations

from typing import Optional

from . import wire

# One small function per text, alike in shape on purpose (tools/duplicates
# sees them as a repeat): each is greppable where it is sent, and its words
# change in exactly one place.


def queued(model_key: str, position: int, wait_s: Optional[float] = None) -> str:
    """QUEUED: where the job waits (``position`` 1 is next) and, when the model
    ran jobs lately, about how long (``state.run_times``)."""
    wait = f", {spoken(wait_s)}" if wait_s is not None else ""
    return f"Your job is queued for {wire.repo_id(model_key)} (position {position}{wait})."


def spoken(seconds: float) -> str:
    """A wait as a person says it: about 40 s, about 3 min, about 2 h."""
    if seconds < 90:
        return f"about {max(round(seconds), 1)} s"
    if seconds < 90 * 60:
        return f"about {round(seconds / 60)} min"
    return f"about {round(seconds / 3600)} h"


def timed_out(timeout_s: float) -> str:
    """ERROR ``kind="timeout"``: the job ran past ``NDIF_EXECUTION_TIMEOUT_S``."""
    return f"Your job exceeded the execution timeout of {timeout_s:g}s."


def timed_out_unanswered(timeout_s: float) -> str:
    """ERROR ``kind="timeout"`` sent by the beat: the job's worker did not answer its deadline."""
    return (timed_out(timeout_s) + " Its worker did not answer (the code held the interpreter in a C call); "
            "the worker is restarted.")


#: ERROR ``kind="cancelled"``: ``ndif-celery kill`` (queued or running).
CANCELLED = "Your job was cancelled by the operator."
CANCELLED_BY_OWNER = "Your job was cancelled at your request (POST /cancel/<id> with its API key)."


def client_gone(grace_s: float) -> str:
    """ERROR ``kind="cancelled"`` of a blocking job whose client went away (``web/subscribe.py``)."""
    return (f"Your job was cancelled: its client went away (its websocket closed) and did not come back within "
            f"{grace_s:g} s (NDIF_DISCONNECT_GRACE_S), so it stopped holding the model.")


def cancelled_unanswered(worker: str, text: str = CANCELLED) -> str:
    """ERROR ``kind="cancelled"`` sent by ``ndif-celery kill`` itself: the running worker did not reply."""
    return (text + f" The worker running it ({worker}) did not reply (the code held the interpreter in a C call); "
            "it is restarted at the job's deadline.")


def worker_lost_again(worker: str) -> str:
    """QUEUED: the worker running the job died; the watchdog sent it again (attempt 2)."""
    return f"The worker running your job ({worker}) was lost; your job is queued to run again."


#: Who "the worker" was for a job lost between the broker and a worker (``watchdog.find_lost``).
LOST_IN_DELIVERY = "one that never started it: the broker's delivery was lost"


def worker_lost_twice(worker: str) -> str:
    """ERROR ``kind="worker_lost"``: its second worker died too; it is not run a third time."""
    return (f"The worker was lost while running your job ({worker}, twice); "
            "it may have run out of memory. It was not run again.")


def unserved(model_key: str) -> str:
    """QUEUED: no live worker holds the job's model (told once per change, by the watchdog)."""
    return (f"No worker is serving {wire.repo_id(model_key)} right now; your job stays queued "
            "and runs once a worker is back.")
