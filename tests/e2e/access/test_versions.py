"""The client version gate (NDIF_MIN_NNSIGHT_VERSION, NDIF_MIN_PYTHON_VERSION):
the real nnsight 0.8.1 client against stacks with a minimum above and equal to it. Each check at its edges is
tests/inprocess/test_versions.py."""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys

import httpx
import pytest
import torch
from nnsight.intervention.backends.remote import RemoteError

from tests.support.stack import client_on_stack
from tests.support.tiny_model import PROMPT

INSTALLED = importlib.metadata.version("nnsight")
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"


# -- nnsight --


# -- python --


# -- configuration --


# -- the web, without a stack --


# -- the real client against real stacks --


def _below(version: str) -> str:
    """A version just below ``version`` (its last part one less, or the one before it)."""
    parts = [int(p) for p in re.findall(r"\d+", version)[:3]]
    for i in reversed(range(len(parts))):
        if parts[i] > 0:
            parts[i] -= 1
            return ".".join(map(str, parts))
    raise ValueError(f"nothing is below {version}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, hf_home):
    """One stack whose minimums are exactly this client's nnsight and Python: the
    installed client is at the gate; one that reports an older version is below it."""
    env = {"NDIF_MIN_NNSIGHT_VERSION": INSTALLED, "NDIF_MIN_PYTHON_VERSION": HERE}
    with client_on_stack(tmp_path_factory.mktemp("gate"), hf_home, env) as stack:
        yield stack


def test_client_below_the_minimum_raises_with_the_message(stack, model, monkeypatch):
    from nnsight.intervention.backends import remote

    older = _below(INSTALLED)
    # The real client, reporting an older nnsight: the header is all the server reads of it.
    monkeypatch.setattr(remote, "_NNSIGHT_VERSION", older)
    message = (f"Client nnsight version {older} is below the minimum supported {INSTALLED}. "
               "Please `pip install --upgrade nnsight`.")
    for blocking in (True, False):
        with pytest.raises(RemoteError) as caught:
            with model.trace(PROMPT, remote=True, blocking=blocking):
                model.transformer.h[0].output.save()
        assert message in str(caught.value), (blocking, str(caught.value))
    # A new enough nnsight on an old python: the python message.
    old_python = f"{_below(HERE)} (main, Jan  1 2020, 00:00:00) [GCC 9.0.0]"
    envelope = {"model_key": model.to_model_key(), "session_id": "", "compress": False, "env": {}}
    response = httpx.post(
        f"{stack.url}/request", data={"data": json.dumps(envelope)},
        files={"blob": ("request", b"x", "application/octet-stream")},
        headers={"nnsight-version": INSTALLED, "python-version": old_python}, timeout=30,
    )
    assert response.status_code == 400
    assert response.json() == {"detail": f"Client python version {_below(HERE)} is below the minimum supported "
                                         f"{HERE}. Please update python."}


def test_client_at_the_minimum_works(stack, model):
    with model.trace(PROMPT, remote=True):
        remote = model.transformer.h[0].output.save()
    with model.trace(PROMPT):
        local = model.transformer.h[0].output.save()
    assert torch.equal(remote, local)
