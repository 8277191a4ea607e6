"""Which pytest process runs which tests, and in what order (a pytest plugin).

Registered by ``tests/conftest.py`` (``pytest_plugins``). ``make test`` runs
``-n 2 --dist loadgroup``; this plugin gives ``loadgroup`` its groups (a module,
or all the tests on one pool of shared stacks) and starts the longest modules
first. Why: docs/decisions/test-processes.md.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    groups = {item.nodeid: group_of(item) for item in items}
    cache = getattr(config, "cache", None)
    durations = cache.get(DURATIONS_KEY, {}) if cache is not None else {}
    if durations:
        # Stable: a module's own order is kept, and so is the order of modules without a time.
        items.sort(key=lambda item: -durations.get(_module(item), 0.0))
    if os.environ.get(GROUPS_FILE_ENV) and hasattr(config, "workerinput"):
        _write_groups(os.environ[GROUPS_FILE_ENV], groups)


def pytest_configure(config):
    # Recorded by the controlling process only: an xdist worker's reports reach it too.
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(_ModuleDurations(), "ndif-module-durations")
        if getattr(config.option, "dist", "no") == "loadgroup":
            # Before the pytest processes start: they inherit it (see GroupScheduling).
            os.environ[GROUPS_FILE_ENV] = os.path.join(tempfile.mkdtemp(prefix="ndif-test-groups-"), "groups.json")


# --- which pytest process runs what -------------------------------------------------
#
# ``make test`` runs ``--dist loadgroup``: the tests of one group run in one
# pytest process, a group at a time. A module is a group of its own (its
# module-scoped stack starts once), except the tests on the shared stacks of
# tests/support/stacks/stack_pool.py: every user of the trusted kinds joins one group,
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
                                "mark it @pytest.mark.pools(\"fs\", ...) (tests/support/scheduling.py groups by them)")
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
