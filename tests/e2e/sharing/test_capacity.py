"""A crowd of waiting researchers: 500 blocking clients whose
jobs all wait behind a slow job hold their ``/subscribe`` sockets at once, then
all complete, each with its own correct values.

Under the old threaded web (2 x 64 threads, a Redis pub/sub connection per
socket) the 129th waiting socket did not even get its session id. Now a
waiting socket is a mailbox on its web process's one shared pub/sub
connection (``web/hub.py``, gunicorn's gevent worker), so 500 is nothing
special. The clients are the real nnsight client's ``AsyncRemoteBackend``
(the blocking stream: subscribe, take the session id, POST; only the wait is
deferred), so one test process holds 500 real client sockets without 500
threads. ``bench/capacity.py`` measures the same at 10,000.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from nnsight.intervention.backends.remote import AsyncRemoteBackend

from tests.support.clients.load import COBATCH_TOLERANCE as TOLERANCE
from tests.support.cases.tiny_model import PROMPT

pytestmark = pytest.mark.pools("fs")

CLIENTS = 500


@pytest.fixture(scope="module")
def stack(stack_pool):
    # The default stack (trusted, auth off: the slow job's block may wait on a file).
    return stack_pool.get("fs")


def _wait_for(backend: AsyncRemoteBackend, status: str):
    """Read the backend's own status frames up to ``status`` (resolve() reads the rest)."""
    while True:
        response = backend.parse(backend.connection.recv())
        if response.status == status:
            return response
        assert response.status not in ("COMPLETED", "ERROR"), response


def _queued(backend: AsyncRemoteBackend):
    return _wait_for(backend, "QUEUED")


def _submit(model, prompt: str) -> AsyncRemoteBackend:
    backend = AsyncRemoteBackend(model.to_model_key())
    with model.trace(prompt, backend=backend):
        logits = model.lm_head.output[0, -1].save()  # noqa: F841
    return backend


def test_500_blocking_clients_wait_behind_a_slow_job_then_all_complete(stack, model, monkeypatch):
    import nnsight

    monkeypatch.setattr(nnsight.CONFIG.API, "HOST", stack.url)
    monkeypatch.setattr(nnsight.CONFIG.APP, "REMOTE_LOGGING", False)
    flag = str(stack.home / "release-the-slow-job")

    # The slow job: holds the only worker until the flag exists (at most 5 min).
    slow = AsyncRemoteBackend(model.to_model_key())
    with model.trace(PROMPT, backend=slow):
        first = model.lm_head.output[0, -1].save()  # noqa: F841
        for _ in range(6000):
            if os.path.exists(flag):
                break
            time.sleep(0.05)
    _wait_for(slow, "RUNNING")

    prompts = [f"{PROMPT} number {i}" for i in range(CLIENTS)]
    waiting = [_submit(model, prompt) for prompt in prompts]
    # Every one of them subscribed, got its session id and is queued behind the slow job.
    assert all(backend.connection is not None and backend.connection.connected for backend in waiting)
    assert _queued(waiting[-1]).status == "QUEUED"

    open(flag, "w").close()
    assert asyncio.run(slow.resolve())["first"].shape == (model.config.vocab_size,)

    async def collect(backend):
        backend.connection.settimeout(180)  # a lost frame fails the test instead of hanging it
        return await backend.resolve()

    results = [asyncio.run(collect(backend)) for backend in waiting]

    distinct = set()
    for prompt, result in zip(prompts, results):
        with model.trace(prompt):
            expected = model.lm_head.output[0, -1].save()
        # Exact, or within the co-batching engine's stated tolerance: the stack merges waiting
        # traces (co-batching), and these prompts differ in length ("number 9", "number 10"), so a
        # shared forward pads some rows.
        worst = (result["logits"] - expected.detach()).abs().max().item()
        assert worst <= TOLERANCE, f"{prompt}: max abs diff {worst!r} > {TOLERANCE}"
        distinct.add(tuple(result["logits"][:4].tolist()))
    assert len(distinct) > 1  # each client got its own values, not one shared answer
