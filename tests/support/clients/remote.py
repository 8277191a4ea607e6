"""How the end-to-end tests point the real nnsight client at a running stack.

A *variant* is one way a researcher can reach us: blocking (websocket) or
non-blocking (submit, then poll ``/response``), compressed or not, against a
stack whose results come back inline, through the filesystem store or through
S3. The conformance cases take a ``remote(model)`` callable; a variant builds it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass

import pytest
from nnsight.intervention.backends.remote import RemoteBackend, RemoteError

from ndif_celery.farm import actions
from tests.support import pace
from tests.support.cases.tiny_model import PROMPT
from tests.support.waiting import wait_until


def recorded_request(fn, *args, **kwargs):
    """What the real client would POST for the block ``fn(*args, **kwargs)``
    runs: its envelope (nnsight's ``RequestModel``) and its payload bytes,
    recorded in place of ``RemoteBackend.request`` (nothing is sent). The
    recorder answers nothing, so a block that reads a saved value after its
    trace fails there; once the request is recorded, that is ignored."""
    from nnsight.schema.request import RequestModel

    sent = []

    def record(self, request, tracer):
        sent.append((request.metadata(), self._serialize(tracer)))
        return {}

    original = RemoteBackend.request
    RemoteBackend.request = record
    try:
        fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - see the docstring; re-raised when nothing was recorded
        if not sent:
            raise
    finally:
        RemoteBackend.request = original
    (metadata, blob), = sent
    return RequestModel.model_validate_json(metadata), blob


@contextlib.contextmanager
def client_pointed_at(url: str, compress: bool = True):
    """The real client's host (and compression) set to ``url`` for a while; its
    host, compression and API key restored after."""
    import nnsight

    api = nnsight.CONFIG.API
    saved = (api.HOST, api.COMPRESS, api.APIKEY)
    api.HOST, api.COMPRESS = url, compress
    try:
        yield
    finally:
        api.HOST, api.COMPRESS, api.APIKEY = saved


def poll(backend, timeout_s: float = 60.0, interval_s: float = 0.1):
    """Call a non-blocking backend (or any callable) until it returns the saves (it raises on ERROR)."""
    return wait_until(backend, pace.bound(timeout_s), f"job {getattr(backend, 'job_id', '?')} to finish",
                      report=lambda: f"last status {getattr(backend, 'status', '?')}",
                      interval_s=interval_s, done=lambda result: result is not None, error=AssertionError)


def slow_job(model, steps: int = 0, layer: int = 0):
    """Submit a non-blocking job saving ``out`` (layer ``layer``'s output) that
    then sleeps ``steps`` x 50 ms in Python, so it stays running, and killable."""
    with model.trace(PROMPT, remote=True, blocking=False) as tracer:
        out = model.transformer.h[layer].output.save()  # noqa: F841
        for _ in range(steps):
            time.sleep(0.05)
    return tracer.backend


def kill_stuck(stack, model, block, said: str = "cancelling on", settle_s: float = 0.0) -> None:
    """Submit a job stuck in ``block``, ``ndif-celery kill`` it once RUNNING
    (and ``settle_s`` later, for a block that must first reach where it sticks):
    the client's ERROR says the operator cancelled it, and is there when the
    command returns (within a poll or two of it).

    Why not one bound from the command's start: that counts the CLI's own
    interpreter start and imports, which take 1 s on an idle 2-core machine and
    over 3 s at load 5 (on top of ``KILL_REPLY_S`` for a worker that cannot
    reply), so it measured the machine, not the kill."""
    with model.trace(PROMPT, remote=True, blocking=False) as tracer:
        out = model.transformer.h[0].output.save()  # noqa: F841
        block()
    backend = tracer.backend
    wait_status(stack.url, backend.job_id, "RUNNING")
    time.sleep(settle_s)
    started = time.monotonic()
    result = stack.cli("kill", backend.job_id)
    cli_s = time.monotonic() - started
    assert said in result.stdout, result.stdout + result.stderr
    with pytest.raises(RemoteError, match="cancelled by the operator"):
        poll(backend, timeout_s=30)
    took = time.monotonic() - started
    print(f"kill: the command {cli_s:.2f} s, the ERROR {took:.2f} s after it started (load {os.getloadavg()[0]:.1f})")
    assert took - cli_s < pace.bound(2), f"the ERROR came {took - cli_s:.1f} s after the command returned"
    assert cli_s < actions.KILL_REPLY_S + pace.bound(8), f"the command took {cli_s:.1f} s"


def _latest(url: str, job_id: str, headers: dict | None):
    import httpx

    return lambda: httpx.get(f"{url}/response/{job_id}", headers=headers, timeout=10).json()


def wait_status(url: str, job_id: str, status: str, contains: str = "", headers: dict | None = None,
                timeout_s: float = 60.0) -> dict:
    """Poll ``GET /response/<id>`` until the job's latest status is ``status``
    (with ``contains`` in its description); return it."""
    return wait_until(_latest(url, job_id, headers), pace.bound(timeout_s),
                      f"job {job_id} to reach {status} {contains!r}", interval_s=0.05,
                      done=lambda latest: latest["status"] == status and contains in latest["description"],
                      error=AssertionError)


def final_status(url: str, job_id: str, headers: dict | None = None, timeout_s: float = 60.0) -> dict:
    """Poll ``GET /response/<id>`` until COMPLETED or ERROR; return that status."""
    return wait_until(_latest(url, job_id, headers), pace.bound(timeout_s), f"job {job_id} to finish",
                      interval_s=0.05, done=lambda latest: latest["status"] in ("COMPLETED", "ERROR"),
                      error=AssertionError)


def blocking_client_in_background(request) -> tuple[threading.Thread, dict]:
    """Start ``request()`` (a blocking client's call, waiting on its websocket)
    in a thread; the dict gets ``out`` (what it returned) or ``error`` (what it
    raised, as ``"Type: message"``)."""
    outcome: dict = {}

    def client():
        try:
            outcome["out"] = request()
        except Exception as error:  # noqa: BLE001 - what the client raises is the point
            outcome["error"] = f"{type(error).__name__}: {error}"

    thread = threading.Thread(target=client)
    thread.start()
    return thread, outcome


class PollUntilDone(RemoteBackend):
    """The real non-blocking client path (POST without a websocket, then GET
    ``/response/<id>`` until COMPLETED), with the saves pushed back into the
    caller's frame afterwards so the same conformance cases can read them."""

    timeout_s = 60.0
    interval_s = 0.05

    def __init__(self, model, **kwargs) -> None:
        super().__init__(model.to_model_key(), env=model._remoteable_get_env(), blocking=False, **kwargs)

    def __call__(self, tracer=None):
        self.job_id = None
        super().__call__(tracer)  # submit: stores job_id, returns None
        assert self.job_id, "submit did not return a job id"
        result = poll(lambda: super(PollUntilDone, self).__call__(tracer), self.timeout_s, self.interval_s)
        self._push(result, tracer)
        return result


@dataclass(frozen=True)
class Variant:
    stack: str  # which stack kind serves it (see tests.support.stacks.stack_pool.STACK_KINDS)
    blocking: bool
    compress: bool
    inline: bool  # whether results are expected inline on the websocket

    @property
    def id(self) -> str:
        mode = "blocking" if self.blocking else "nonblocking"
        return f"{self.stack}-{mode}-{'zstd' if self.compress else 'raw'}"

    def remote(self, model) -> dict:
        if self.blocking:
            return {"remote": True}
        return {"backend": PollUntilDone(model)}


VARIANTS = [
    Variant("fs", blocking=True, compress=True, inline=True),
    Variant("fs", blocking=True, compress=False, inline=True),
    Variant("fs", blocking=False, compress=True, inline=False),
    Variant("fs", blocking=False, compress=False, inline=False),
    Variant("s3", blocking=True, compress=True, inline=False),
    Variant("s3", blocking=True, compress=False, inline=False),
    Variant("s3", blocking=False, compress=True, inline=False),
    Variant("isolated", blocking=True, compress=True, inline=True),
    Variant("isolated", blocking=False, compress=False, inline=False),
    Variant("zygote", blocking=True, compress=True, inline=True),
    Variant("zygote", blocking=False, compress=False, inline=False),
]


def same_as_local(model, layer: int = 2) -> None:
    """One remote trace of ``PROMPT`` saves exactly what the same trace saves locally."""
    import torch

    from tests.support.cases.tiny_model import PROMPT

    with model.trace(PROMPT, remote=True):
        remote = model.transformer.h[layer].output.save()
    with model.trace(PROMPT):
        local = model.transformer.h[layer].output.save()
    assert torch.equal(remote, local)
