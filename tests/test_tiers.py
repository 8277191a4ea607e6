"""The two test tiers stay true (see tests/conftest.py): the fast tier cannot
start a stack or a server process by mistake, and what conftest lists as
end-to-end exists, so a renamed module or fixture is not silently moved to
the fast tier."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import conftest
from tests.servers import MotoServer
from tests.stack import Stack

TESTS = Path(__file__).resolve().parent


def test_a_fast_tier_test_cannot_start_a_stack_or_moto(tmp_path):
    stack = Stack(tmp_path / "home")
    with pytest.raises(RuntimeError, match=r"test_a_fast_tier_test_cannot_start_a_stack_or_moto starts a stack "
                                           r"but is in the fast tier: mark it end-to-end"):
        stack.start()
    assert not stack.started and not (tmp_path / "home" / "run").exists()
    with pytest.raises(RuntimeError, match="starts moto's S3 server but is in the fast tier"):
        MotoServer().start()


def test_every_listed_e2e_module_and_fixture_exists():
    for name in conftest.E2E_MODULES:
        assert (TESTS / f"{name}.py").is_file(), f"E2E_MODULES names {name}, which is not a test module"
    defined = set()
    for path in TESTS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                "fixture" in ast.unparse(decorator) for decorator in node.decorator_list
            ):
                defined.add(node.name)
    missing = conftest.E2E_FIXTURES - defined
    assert not missing, f"E2E_FIXTURES names fixtures no test module defines: {sorted(missing)}"
