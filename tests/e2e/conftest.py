"""Fixtures of the end-to-end tier: the shared real stacks.

Every test under tests/e2e is marked ``e2e`` (tests/conftest.py); these
fixtures exist only here, so no fast-tier test can ask for a stack.
"""

from __future__ import annotations

import pytest

# --- the real stack ---------------------------------------------------------------


@pytest.fixture(scope="session")
def stack_pool(tmp_path_factory, hf_home):
    """Real stacks (redis, gunicorn web, celery worker, flower) started through
    the CLI on first use, one per kind, stopped at the end of the session."""
    from tests.support.stacks.stack_pool import StackPool

    pool = StackPool(
        tmp_path_factory.mktemp("stacks"),
        {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def fs_stack(stack_pool):
    return stack_pool.get("fs")


@pytest.fixture
def on_fs_stack(fs_stack):
    """The client pointed at the default stack (inline results, filesystem store)."""
    from tests.support.clients.remote import client_pointed_at

    with client_pointed_at(fs_stack.url):
        yield fs_stack


def _variant_params():
    from tests.support.clients.remote import VARIANTS

    return [pytest.param(v, id=v.id) for v in VARIANTS]


@pytest.fixture(scope="session", params=_variant_params())
def variant(request, stack_pool):
    """One way of reaching the farm; the client is pointed at its stack."""
    v = request.param
    stack = stack_pool.get(v.stack)
    from tests.support.clients.remote import client_pointed_at

    with client_pointed_at(stack.url, compress=v.compress):
        yield v


@pytest.fixture
def stack_for_variant(variant, stack_pool):
    return stack_pool.get(variant.stack)
