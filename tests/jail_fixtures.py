"""Fixtures shared by the attack suites (``tests/test_security*.py``).

Each attack module imports ``jail``, ``worker_pid`` and
``still_serving_after`` from here, so every attack runs once per isolation
mode (children of the fork server, ``NDIF_ISOLATION=fork``, and of the
model's zygote, ``=zygote``) and is followed by the same check: the same
worker answers, exactly right. ``attempt`` ships with the blocks by value.
"""

from __future__ import annotations

import nnsight
import pytest
import torch

from tests.tiny_model import PROMPT

nnsight.register(__name__)  # attempt() below runs inside remote blocks


@pytest.fixture(scope="module", params=["isolated", "zygote"])
def jail(stack_pool, request):
    """Each attack runs against both isolation modes: NDIF_ISOLATION=fork
    (the ``isolated`` stack) and =zygote."""
    stack = stack_pool.get(request.param)
    saved = nnsight.CONFIG.API.HOST, nnsight.CONFIG.API.COMPRESS
    nnsight.CONFIG.API.HOST, nnsight.CONFIG.API.COMPRESS = stack.url, True
    yield stack
    nnsight.CONFIG.API.HOST, nnsight.CONFIG.API.COMPRESS = saved


@pytest.fixture
def worker_pid(jail):
    (info,) = jail.farm()["cluster"]["workers"].values()
    return info["pid"]


@pytest.fixture(autouse=True)
def still_serving_after(jail, worker_pid, model):
    """After every attack: the same worker answers, and exactly right."""
    yield
    with model.trace(PROMPT, remote=True) as tracer:
        remote = model.transformer.h[3].output.save()
    with model.trace(PROMPT):
        local = model.transformer.h[3].output.save()
    assert torch.equal(remote, local)
    assert tracer.backend.meta["isolated"] is True
    (info,) = jail.farm()["cluster"]["workers"].values()
    assert info["pid"] == worker_pid, "the worker was replaced"


def isolation(stack) -> str:
    return stack.env.get("NDIF_ISOLATION", "zygote")


def attempt(fn):
    """Run ``fn``; its outcome as a string (value, or the error's type and text)."""
    try:
        return f"ok: {fn()!r}"
    except BaseException as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
