"""The two test tiers stay true (see tests/conftest.py): the tier follows from
the path. Every test under tests/e2e is marked ``e2e`` and none under
tests/unit or tests/inprocess is; the fast tier cannot start a stack or a
server process by mistake; and the stack fixtures exist only under tests/e2e."""

from __future__ import annotations

import ast
import types

import pytest

from tests.support.paths import E2E_DIR, OUT_DIR, ROOT, TESTS_DIR
from tests.support.stacks.servers import MotoServer
from tests.support.stacks.stack import Stack

FAST_DIRS = (TESTS_DIR / "unit", TESTS_DIR / "inprocess")


def suite_modules():
    """Every test module of the suite (not what tests/_out holds: the client environments' packages)."""
    return [path for path in sorted(TESTS_DIR.rglob("test_*.py")) if not path.is_relative_to(OUT_DIR)]


class Item:
    """What conftest's collection hook reads of a test item, and the marks it adds."""

    def __init__(self, nodeid, fixturenames=(), marks=(), params=None):
        self.nodeid, self.path = nodeid, ROOT / nodeid.split("::")[0]
        self.fixturenames, self.marks = list(fixturenames), list(marks)
        self.callspec = types.SimpleNamespace(params=params) if params is not None else None
        self.marked: dict = {}

    def iter_markers(self, name):
        return [mark for mark in self.marks if mark.name == name]

    def add_marker(self, marker):
        self.marked[marker.name] = marker.args


def test_a_fast_tier_test_cannot_start_a_stack_or_moto(tmp_path):
    stack = Stack(tmp_path / "home")
    with pytest.raises(RuntimeError, match=r"test_a_fast_tier_test_cannot_start_a_stack_or_moto starts a stack "
                                           r"but is in the fast tier: move it under tests/e2e/"):
        stack.start()
    assert not stack.started and not (tmp_path / "home" / "run").exists()
    with pytest.raises(RuntimeError, match="starts moto's S3 server but is in the fast tier"):
        MotoServer().start()


def test_this_test_is_in_the_fast_tier(request):
    assert request.node.get_closest_marker("e2e") is None


def test_every_e2e_test_is_marked_and_no_fast_one_is():
    """conftest's collection hook marks a test ``e2e`` exactly when its file is under tests/e2e."""
    from tests import conftest

    items = [Item(str(path.relative_to(ROOT))) for path in suite_modules()]

    config = types.SimpleNamespace(cache=None)
    conftest.pytest_collection_modifyitems(config, items)
    e2e = [item for item in items if item.path.is_relative_to(E2E_DIR)]
    fast = [item for item in items if any(item.path.is_relative_to(d) for d in FAST_DIRS)]
    assert e2e and fast and len(e2e) + len(fast) == len(items)
    assert all("e2e" in item.marked for item in e2e)
    assert not any("e2e" in item.marked for item in fast)


def test_modules_run_longest_first_by_the_last_runs_times():
    from tests.support import scheduling

    def order(durations):
        items = [Item(n) for n in ("tests/unit/a.py::x", "tests/unit/a.py::y", "tests/unit/b.py::x", "tests/unit/c.py::x")]
        cache = types.SimpleNamespace(get=lambda key, default: durations)
        scheduling.pytest_collection_modifyitems(types.SimpleNamespace(cache=cache), items)
        return [item.nodeid for item in items]

    assert order({}) == ["tests/unit/a.py::x", "tests/unit/a.py::y", "tests/unit/b.py::x", "tests/unit/c.py::x"]
    assert order({"tests/unit/c.py": 9.0, "tests/unit/a.py": 2.0}) == [
        "tests/unit/c.py::x", "tests/unit/a.py::x", "tests/unit/a.py::y", "tests/unit/b.py::x"]


def test_every_test_module_is_in_a_tier_and_every_folder_is_a_package():
    for path in suite_modules():
        rel = path.relative_to(TESTS_DIR)
        assert rel.parts[0] in ("unit", "inprocess", "e2e"), f"{rel}: a test module belongs in unit/, inprocess/ or e2e/"
    for folder in [TESTS_DIR, *(p for p in TESTS_DIR.rglob("*") if p.is_dir())]:
        if folder.name in ("__pycache__", "_out") or "_out" in folder.relative_to(TESTS_DIR).parts:
            continue
        if folder == TESTS_DIR / "support" / "stacks" / "warm_start":
            continue  # a directory put on PYTHONPATH for its sitecustomize.py, not a package
        assert (folder / "__init__.py").is_file(), f"{folder.relative_to(ROOT)} needs an __init__.py"


def test_the_stack_fixtures_are_defined_only_for_the_e2e_tier():
    stack_fixtures = {"stack_pool", "fs_stack", "on_fs_stack", "variant", "stack_for_variant"}
    for path in (p for p in TESTS_DIR.rglob("conftest.py") if not p.is_relative_to(OUT_DIR)):
        defined = {
            node.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef)
            and any("fixture" in ast.unparse(decorator) for decorator in node.decorator_list)
        }
        if path.parent == E2E_DIR:
            assert stack_fixtures <= defined
        else:
            assert not stack_fixtures & defined, f"{path.relative_to(ROOT)} defines a stack fixture outside tests/e2e"


def test_the_tests_of_each_pool_share_one_process_and_the_rest_go_by_module():
    """Under ``--dist loadgroup``: one group for the trusted pooled kinds, one for the
    jailed ones, one for the auth farm (each pooled stack starts once per run), a
    module of its own otherwise."""
    from tests.support import scheduling
    from tests.support.clients.remote import VARIANTS

    by_kind = {variant.stack: variant for variant in VARIANTS}
    items = [
        Item("tests/e2e/api/a.py::x", ["on_fs_stack", "stack_pool"]),
        Item("tests/e2e/isolation/b.py::y", ["jail", "stack_pool"]),
        Item("tests/e2e/isolation/c.py::z", ["stack_pool"], [pytest.mark.pools("zygote")]),
        Item("tests/e2e/api/d.py::v[s3]", ["variant", "stack_pool"], params={"variant": by_kind["s3"]}),
        Item("tests/e2e/api/d.py::v[zygote]", ["variant", "stack_pool"], params={"variant": by_kind["zygote"]}),
        Item("tests/e2e/api/e.py::both", ["fs_stack", "stack_pool"], [pytest.mark.pools("isolated")]),
        Item("tests/e2e/access/h.py::k[sqlite]", ["stack_pool"], [pytest.mark.pools("auth")]),
        Item("tests/e2e/farm/f.py::w", ["hf_home"]),
    ]
    groups = {item.nodeid: scheduling.group_of(item) for item in items}
    assert list(groups.values()) == [
        "pool-trusted", "pool-jailed", "pool-jailed", "pool-trusted", "pool-jailed", "pool-jailed",
        "pool-auth", "tests/e2e/farm/f.py"]
    # The controlling process schedules by what the pytest processes wrote.
    assert scheduling.scope_of("tests/e2e/api/d.py::v[s3]", groups) == "pool-trusted"
    assert scheduling.scope_of("tests/e2e/farm/g.py::not_written", groups) == "tests/e2e/farm/g.py"

    unnamed = Item("tests/e2e/api/g.py::takes_its_own", ["stack_pool"])
    with pytest.raises(pytest.UsageError, match="mark it @pytest.mark.pools"):
        scheduling.group_of(unnamed)


def test_make_test_keeps_each_group_in_one_process(tmp_path):
    """Two pytest processes under ``--dist loadgroup``: a module's tests all run in one."""
    import subprocess
    import sys

    (tmp_path / "test_a.py").write_text("".join(f"def test_{i}():\n    pass\n" for i in range(6)))
    (tmp_path / "test_b.py").write_text("".join(f"def test_{i}():\n    pass\n" for i in range(6)))
    (tmp_path / "conftest.py").write_text(
        "pytest_plugins = [\"tests.support.scheduling\"]\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                             "-v", "--rootdir", str(tmp_path), str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    runs = [line.split()[0] + " " + line.split("::")[0].rsplit("/", 1)[-1]
            for line in result.stdout.splitlines() if "PASSED" in line and line.startswith("[gw")]
    assert len(runs) == 12, result.stdout[-3000:]
    for module in ("test_a.py", "test_b.py"):
        assert len({run.split()[0] for run in runs if run.endswith(module)}) == 1, runs
