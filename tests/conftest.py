"""Shared test setup: an offline Hugging Face cache holding the tiny GPT-2.

At import time (before anything imports transformers / huggingface_hub or
nnsight, which read these variables once, at their own import):

* ``NNSIGHT_CONFIG`` = ``/dev/null`` and no ``NDIF_API_KEY`` / ``NDIF_HOST``: the
  clients read no config of this host's user;
* ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1`` (the hub is unreachable;
  without them loading sits in retry backoff for minutes);
* ``HF_HOME`` = ``tests/_out/hf`` (gitignored), unless ``HF_HOME`` already points
  at a folder holding the tiny model;
* the tiny model is built there once (`tests.support.cases.tiny_model.build_tiny_gpt2` is idempotent
  and safe against concurrent builders).

Fixtures: ``hf_home`` (the folder), ``tiny_model_factory`` (build more tiny
models under it), ``model`` (the shared client model on ``REPO_ID``).
Constants (``PROMPT``, ``HIDDEN``, ``VOCAB``, ``N_LAYER``, ``REPO_ID``) live in
``tests.support.cases.tiny_model`` and are re-exported here and by ``tests.support.cases.conformance``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.support.paths import E2E_DIR, OUT_DIR
from tests.support.cases.tiny_model import (
    HIDDEN,
    N_LAYER,
    PROMPT,
    PROMPTS,
    REPO_ID,
    VOCAB,
    build_tiny_gpt2,
    client_model,
    snapshot_dir,
)

__all__ = ["HIDDEN", "N_LAYER", "PROMPT", "PROMPTS", "REPO_ID", "VOCAB"]

# Which pytest process runs which tests, longest modules first.
pytest_plugins = ["tests.support.scheduling"]


def _configure_offline_hf() -> Path:
    """Point the HF libraries at a local cache and forbid network access."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    preset = os.environ.get("HF_HOME")
    if preset and snapshot_dir(Path(preset), REPO_ID) is not None:
        hf_home = Path(preset)
    else:
        hf_home = OUT_DIR / "hf"
        os.environ["HF_HOME"] = str(hf_home)

    # huggingface_hub freezes its cache path and offline flag at import.
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None and (
        Path(constants.HF_HUB_CACHE).resolve() != (hf_home / "hub").resolve()
        or not constants.HF_HUB_OFFLINE
    ):
        raise RuntimeError(
            "huggingface_hub was imported before tests/conftest.py could set "
            f"HF_HOME={hf_home} and HF_HUB_OFFLINE=1; set them in the environment "
            "instead (e.g. HF_HOME=tests/_out/hf HF_HUB_OFFLINE=1 pytest ...)."
        )
    return hf_home


def _configure_nnsight_client() -> None:
    """Every client the suite runs (here and in the processes it starts) reads
    nnsight's shipped defaults and what the tests set, never this host's user
    config file (``~/.config/nnsight/config.yaml``: a REMOTE_LOGGING off there
    silenced the client processes whose status lines tests read) or its
    ``NDIF_API_KEY`` / ``NDIF_HOST``."""
    if "nnsight" in sys.modules:
        raise RuntimeError("nnsight was imported before tests/conftest.py could set NNSIGHT_CONFIG")
    os.environ["NNSIGHT_CONFIG"] = os.devnull
    os.environ.pop("NDIF_API_KEY", None)
    os.environ.pop("NDIF_HOST", None)


_configure_nnsight_client()
HF_HOME = _configure_offline_hf()
build_tiny_gpt2(HF_HOME, REPO_ID)


@pytest.fixture(scope="session")
def hf_home() -> Path:
    """The offline HF cache folder (``$HF_HOME``) the tiny models live in."""
    return HF_HOME


@pytest.fixture(scope="session")
def tiny_model_factory(hf_home):
    """``make(repo_id, **sizes) -> snapshot dir``: build another tiny model once."""

    def make(repo_id: str, **kwargs) -> Path:
        return build_tiny_gpt2(hf_home, repo_id, **kwargs)

    return make


@pytest.fixture(scope="session")
def model():
    """The shared nnsight client model (``TransformersModel``) on ``REPO_ID``."""
    return client_model(REPO_ID)


# --- an embedded Redis for the fast tier's in-process tests ------------------------


@pytest.fixture(scope="module")
def embedded_settings(tmp_path_factory, request):
    """Settings of a real embedded redis-server of this module's own
    (``tests.support.stacks.servers.embedded_redis``): the fast tier's in-process tests (the
    intake, the watchdogs) drive the real code against a real Redis."""
    from tests.support.stacks.servers import embedded_redis

    with embedded_redis(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])) as settings:
        yield settings


@pytest.fixture
def redis_client(embedded_settings):
    """A client of the module's embedded Redis, emptied before each test."""
    import redis

    client = redis.Redis.from_url(embedded_settings.redis_url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def local_results(model, tmp_path_factory):
    """``results(case)``: what a conformance case gives run locally, computed once."""
    cache = {}

    def results(case):
        if case not in cache:
            cache[case] = case(model, lambda m: {}, tmp_path_factory.mktemp("local"))
        return cache[case]

    return results


# --- test tiers ---------------------------------------------------------------------
#
# The tier follows from the path. Everything under tests/e2e/ starts (or shares)
# a real multi-process stack (embedded Redis + gunicorn + Celery worker + Flower)
# or another real server process (moto, a PostgreSQL proxy, chromium, honcho)
# and is marked ``e2e`` here. tests/unit/ and tests/inprocess/ are the fast tier
# (`make test-fast`): unit tests and in-process integration (Flask's test
# client, an embedded Redis, the worker's job function called directly).
#
# A fast-tier test that starts a stack or moto anyway fails at once, naming the
# fix (``tests.support.stacks.servers.refuse_in_fast_tier``), so the fast tier stays fast.


def in_e2e_tier(path) -> bool:
    """Whether a test file is in the end-to-end tier: under tests/e2e/."""
    return Path(path).resolve().is_relative_to(E2E_DIR)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures: a fast-tier test that starts a stack or a
    server process fails, naming the fix (``tests.support.stacks.servers.refuse_in_fast_tier``)."""
    from tests.support.stacks import servers

    servers.FAST_TIER_TEST = "" if in_e2e_tier(item.path) else item.nodeid


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if in_e2e_tier(item.path):
            item.add_marker(pytest.mark.e2e)


def _pin_torch_threads() -> None:
    """The suite compares remote values with local runs in its own processes, to
    the bit, and a thread count can change the last bits. So every stack's
    workers use the count this torch uses (inherited by the pytest processes
    and the stacks), not one measured per model; a test of the setting passes its own."""
    if "NDIF_TORCH_THREADS" not in os.environ:
        import torch

        os.environ["NDIF_TORCH_THREADS"] = str(torch.get_num_threads())


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controlling process: the pytest processes inherit it
        _pin_torch_threads()
