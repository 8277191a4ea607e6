"""What the repository may not hold: references to an issue tracker it does
not have, or to files outside it (a development machine's paths, the notes
beside the checkout). History belongs in commits, reasons in the text."""

from __future__ import annotations

import re
import subprocess

from tests.support.paths import ROOT

ISSUE = re.compile(r"\bissues? #\d+|\(#\d+\)|#\d+ item", re.IGNORECASE)
OUTSIDE = re.compile(r"/work/(main|shared)\b|\.\./shared/|\bshared/(cobatch/|[a-z-]+\.md\b)")


def _tracked_text():
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        path = ROOT / name
        if path.suffix in (".png", ".jpg", ".ico") or not path.is_file():
            continue
        try:
            yield name, path.read_text()
        except UnicodeDecodeError:
            continue


def test_no_issue_numbers_and_no_paths_outside_the_repository():
    found = []
    for name, text in _tracked_text():
        for number, line in enumerate(text.splitlines(), 1):
            if ISSUE.search(line) or OUTSIDE.search(line):
                found.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not found, "\n".join(found)


def test_the_rules_catch_what_they_name():
    hash_ = "#"  # written apart, so this file does not hold what it looks for
    assert ISSUE.search(f"as issue {hash_}15 asked") and ISSUE.search(f"fixed ({hash_}13)")
    assert ISSUE.search(f"{hash_}14 item 4")
    assert not ISSUE.search("port 8001 # the API") and not ISSUE.search("color: #1a2b3c")
    assert OUTSIDE.search("see /work" + "/sha" + "red/cobatch/README.md") and OUTSIDE.search(".." + "/sha" + "red/design.md")
    assert OUTSIDE.search("(see " + "sha" + "red/server-recipe.md)") and not OUTSIDE.search("a shared/ folder")


# A project module imported under another name sends a reader to a file that
# does not exist (``isolate.run`` and no isolate.py). Each alias kept names why.
MODULE_ALIASES = {
    ("ndif_celery/cli/host.py", "service_logs"): "the `logs` command's function has the module's name",
    ("ndif_celery/cli/ops.py", "usage_report"): "the `usage` command's function has the module's name",
    ("ndif_celery/cli/ops.py", "health"): "the `probes` command's function has the module's name",
    ("ndif_celery/cli/checks.py", "checks"): "the `doctor` command's function has the module's name",
    ("workers/worker.py", "farm_metrics"): "the worker has metrics of its own (workers.metrics) beside the farm's",
    ("workers/job/gather.py", "job_life"): "``life`` names a job's Life in every step",
    ("tests/inprocess/workers/job/test_life.py", "job_life"): "``life`` names a job's Life in the tests",
    ("workers/cobatch/engine.py", "parking"): "``park`` names one parked request there",
    ("workers/adapters/__init__.py", "adapter"): "the one adapter of the nnsight installed, picked at import",
    ("web/gunicorn_conf.py", "_config"): "gunicorn reads every public name of its config file as a setting",
    ("tests/inprocess/ndif_celery/farm/test_watchdog.py", "watchdog_module"): "``watchdog`` is the fixture under test",
    ("tests/inprocess/web/test_hub.py", "hub_module"): "``hub`` is the fixture under test",
    ("tests/support/stacks/servers.py", "redis_server"): "``embedded_redis`` names the server object it starts",
}


def _module_aliases() -> set:
    import ast

    found = set()
    for folder in ("ndif_celery", "workers", "web", "tests", "tools", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "_out" in path.parts:
                continue
            relative = path.relative_to(ROOT)
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom):
                    continue
                package = relative.parent.parts[: len(relative.parent.parts) - node.level + 1] if node.level else ()
                source = ROOT.joinpath(*package, *(node.module or "").split("."))
                for alias in node.names:
                    target = source / alias.name
                    is_module = target.with_suffix(".py").exists() or (target / "__init__.py").exists()
                    if alias.asname and alias.asname != alias.name and is_module:
                        found.add((str(relative), alias.asname))
    return found


def test_project_modules_are_imported_by_their_own_names():
    assert _module_aliases() - set(MODULE_ALIASES) == set(), "alias a module only with a reason in MODULE_ALIASES"
    assert set(MODULE_ALIASES) - _module_aliases() == set(), "MODULE_ALIASES lists an alias no longer used"


# The fast tier mirrors the packages: ndif_celery/state/turns.py is proven in
# tests/unit/ndif_celery/state/test_turns.py or tests/inprocess/ndif_celery/state/test_turns.py.
# A module proven elsewhere (by a test of another name, or end to end) has a row
# in tests/README.md's "Where each module is proven" table naming those tests.
PRODUCT_FOLDERS = ("ndif_celery", "workers", "web")
PROOF_ROW = re.compile(r"^\| `((?:ndif_celery|workers|web)/[\w/]+\.py)` \| (.+) \|$", re.MULTILINE)


def product_modules() -> list:
    """Every product module with code of its own (a package face of imports only is not one)."""
    import ast

    found = []
    for folder in PRODUCT_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            if any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign))
                   for node in tree.body):
                found.append(path.relative_to(ROOT))
    return found


def mirrored_tests(module) -> list:
    name = module.parent.name if module.name == "__init__.py" else module.stem
    folder = module.parent.parent if module.name == "__init__.py" else module.parent
    return [ROOT / "tests" / tier / folder / f"test_{name}.py" for tier in ("unit", "inprocess")]


def proof_rows() -> dict:
    return dict(PROOF_ROW.findall((ROOT / "tests" / "README.md").read_text()))


def test_every_product_module_has_its_mirrored_test_or_a_row_naming_its_proof():
    rows = proof_rows()
    missing = [str(module) for module in product_modules()
               if not any(path.exists() for path in mirrored_tests(module)) and str(module) not in rows]
    assert not missing, "no mirrored test module and no row in tests/README.md:\n" + "\n".join(missing)


def test_every_proof_row_names_a_module_and_tests_that_exist():
    modules = {str(module) for module in product_modules()}
    wrong = []
    for module, proof in proof_rows().items():
        named = re.findall(r"`(tests/[\w/.]+\.py)`", proof)
        if module not in modules or not named or not all((ROOT / path).exists() for path in named):
            wrong.append(f"{module}: {proof}")
    assert not wrong, "\n".join(wrong)
