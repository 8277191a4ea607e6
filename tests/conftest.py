"""Shared test setup: an offline Hugging Face cache holding the tiny GPT-2.

At import time (before anything imports transformers / huggingface_hub or
nnsight, which read these variables once, at their own import):

* ``NNSIGHT_CONFIG`` = ``/dev/null`` and no ``NDIF_API_KEY`` / ``NDIF_HOST``: the
  clients read no config of this host's user;
* ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1`` (the hub is unreachable;
  without them loading sits in retry backoff for minutes);
* ``HF_HOME`` = ``tests/_out/hf`` (gitignored), unless ``HF_HOME`` already points
  at a folder holding the tiny model;
* the tiny model is built there once (`tests.support.tiny_model.build_tiny_gpt2` is idempotent
  and safe against concurrent builders).

Fixtures: ``hf_home`` (the folder), ``tiny_model_factory`` (build more tiny
models under it), ``model`` (the shared client model on ``REPO_ID``).
Constants (``PROMPT``, ``HIDDEN``, ``VOCAB``, ``N_LAYER``, ``REPO_ID``) live in
``tests.support.tiny_model`` and are re-exported here and by ``tests.support.conformance``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.paths import E2E_DIR, OUT_DIR
from tests.support.tiny_model import (
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
    (``tests.support.servers.embedded_redis``): the fast tier's in-process tests (the
    intake, the watchdogs) drive the real code against a real Redis."""
    from tests.support.servers import embedded_redis

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
# fix (``tests.support.servers.refuse_in_fast_tier``), so the fast tier stays fast.


def in_e2e_tier(path) -> bool:
    """Whether a test file is in the end-to-end tier: under tests/e2e/."""
    return Path(path).resolve().is_relative_to(E2E_DIR)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures: a fast-tier test that starts a stack or a
    server process fails, naming the fix (``tests.support.servers.refuse_in_fast_tier``)."""
    from tests.support import servers

    servers.FAST_TIER_TEST = "" if in_e2e_tier(item.path) else item.nodeid


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker, and before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if in_e2e_tier(item.path):
            item.add_marker(pytest.mark.e2e)
    groups = {item.nodeid: group_of(item) for item in items}
    cache = getattr(config, "cache", None)
    durations = cache.get(DURATIONS_KEY, {}) if cache is not None else {}
    if durations:
        # Stable: a module's own order is kept, and so is the order of modules without a time.
        items.sort(key=lambda item: -durations.get(_module(item), 0.0))
    if os.environ.get(GROUPS_FILE_ENV) and hasattr(config, "workerinput"):
        _write_groups(os.environ[GROUPS_FILE_ENV], groups)


# --- which pytest process runs what -------------------------------------------------
#
# ``make test`` runs ``--dist loadgroup``: the tests of one group run in one
# pytest process, a group at a time. A module is a group of its own (its
# module-scoped stack starts once), except the tests on the shared stacks of
# tests/support/stack_pool.py: every user of the trusted kinds joins one group,
# every user of the jailed kinds another, so each kind starts once per run, not
# once per process. A test names the kinds it takes from ``stack_pool`` by hand
# with ``@pytest.mark.pools(...)``; the pool fixtures say it for themselves.
#
# The grouping is ours, not pytest-xdist's ``xdist_group`` mark: xdist 3.8 puts
# the group into a test's nodeid, which pytest 9 no longer lets a plugin change.
# So each pytest process writes every test's group to a file the controlling
# process named (its collection is the same in each), and the controlling
# process's scheduler (``GroupScheduling``) reads it once collection is done.

GROUPS_FILE_ENV = "NDIF_TEST_GROUPS"

JAILED_KINDS = frozenset({"isolated", "zygote"})
AUTH_KINDS = frozenset({"auth"})
_JAIL_FIXTURES = frozenset({"jail", "worker_pid", "still_serving_after"})
_FS_FIXTURES = frozenset({"fs_stack", "on_fs_stack"})


def pool_kinds(item) -> set:
    """The stack_pool kinds a test uses."""
    kinds = set()
    for marker in item.iter_markers("pools"):
        kinds.update(marker.args)
    names = set(getattr(item, "fixturenames", ()))
    if names & _JAIL_FIXTURES:
        kinds |= JAILED_KINDS
    if names & _FS_FIXTURES:
        kinds.add("fs")
    callspec = getattr(item, "callspec", None)
    if "variant" in names and callspec is not None:
        kinds.add(callspec.params["variant"].stack)
    return kinds


def group_of(item) -> str:
    """The group a test runs in: its pool's, else its module's."""
    group = pool_group(item)
    if group is None and "stack_pool" in getattr(item, "fixturenames", ()):
        raise pytest.UsageError(f"{item.nodeid} takes stacks from stack_pool without naming their kinds: "
                                "mark it @pytest.mark.pools(\"fs\", ...) (tests/conftest.py groups by them)")
    return group or _module(item)


def _write_groups(path: str, groups: dict) -> None:
    partial = f"{path}.{os.getpid()}"
    with open(partial, "w") as out:
        json.dump(groups, out)
    os.replace(partial, path)  # whole or absent: every process writes the same


def scope_of(nodeid: str, groups: dict) -> str:
    """The scheduling scope of a test: its group as written by the pytest processes, else its module."""
    return groups.get(nodeid) or nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """Load-scope scheduling whose scope is a test's group (``group_of``)."""

        groups = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # first asked once every process has collected
                try:
                    with open(os.environ[GROUPS_FILE_ENV]) as written:
                        self.groups = json.load(written)
                except (KeyError, OSError, ValueError):
                    self.groups = {}
            return scope_of(nodeid, self.groups)

    config.option.loadscopereorder = False  # keep our order: the longest modules first
    return GroupScheduling(config, log)


def pool_group(item):
    """``pool-jailed``, ``pool-auth`` or ``pool-trusted`` for a test on the shared stacks, else None.

    A test that needs a jailed kind runs with the jailed kinds, even if it also
    takes another one (that one then starts a second time, in that process);
    one that needs the auth farm, with the auth farm."""
    kinds = pool_kinds(item)
    if not kinds:
        return None
    if kinds & JAILED_KINDS:
        return "pool-jailed"
    return "pool-auth" if kinds & AUTH_KINDS else "pool-trusted"


# --- order: the longest modules first ------------------------------------------------
#
# ``make test`` shares the modules out among pytest-xdist processes (``--dist
# loadscope``: a module at a time, in collection order). A long module picked
# last runs alone at the end while the other processes idle, so the longest go
# first: each run records every module's time (setup, call and teardown of its
# tests) in pytest's cache (.pytest_cache), and the next run orders the modules
# by it, longest first. With no times recorded the collection order is kept.

DURATIONS_KEY = "ndif/module_durations"


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0]


class _ModuleDurations:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report) -> None:
        module = report.nodeid.split("::", 1)[0]
        self.seconds[module] = self.seconds.get(module, 0.0) + report.duration

    def pytest_sessionfinish(self, session) -> None:
        cache = getattr(session.config, "cache", None)  # None with -p no:cacheprovider
        if cache is None or not self.seconds:
            return
        durations = cache.get(DURATIONS_KEY, {})
        durations.update({module: round(s, 2) for module, s in self.seconds.items()})
        cache.set(DURATIONS_KEY, durations)


def _pin_torch_threads() -> None:
    """The suite compares remote values with local runs in its own processes, to
    the bit, and a thread count can change the last bits. So every stack's
    workers use the count this torch uses (inherited by the pytest processes
    and the stacks), not one measured per model; a test of the setting passes its own."""
    if "NDIF_TORCH_THREADS" not in os.environ:
        import torch

        os.environ["NDIF_TORCH_THREADS"] = str(torch.get_num_threads())


def pytest_configure(config):
    # Recorded by the controlling process only: an xdist worker's reports reach it too.
    if not hasattr(config, "workerinput"):
        _pin_torch_threads()
        config.pluginmanager.register(_ModuleDurations(), "ndif-module-durations")
        if getattr(config.option, "dist", "no") == "loadgroup":
            # Before the pytest processes start: they inherit it (see GroupScheduling).
            os.environ[GROUPS_FILE_ENV] = os.path.join(tempfile.mkdtemp(prefix="ndif-test-groups-"), "groups.json")
