"""The import graph (``tools/import_graph.py``): the project's own has no
module circle and keeps its layers, and the script really finds each kind of
problem, on small made-up trees laid out like the project's packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.paths import ROOT

SCRIPT = ROOT / "tools" / "import_graph.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def tree(root: Path, files: dict[str, str]) -> Path:
    """The three packages, and ``files`` with a package (an ``__init__.py``) around each."""
    for package in ("ndif_celery", "workers", "web"):
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").touch()
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(text)
    return root


def test_the_project_has_no_cycle_and_keeps_its_layers():
    result = run()
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert "web -> ndif_celery" in {line.split(" (")[0] for line in lines}
    assert "workers -> ndif_celery" in {line.split(" (")[0] for line in lines}
    assert not any(line.startswith(("web -> workers", "ndif_celery -> web", "workers -> web")) for line in lines)
    assert lines[-1] == "no cycles, layers kept"
    # The jobs module is the bottom of the job-state layer: it imports no module that imports it.
    (jobs,) = [line for line in lines if line.startswith("ndif_celery.state.jobs -> ")]
    for above in ("accounts.limits", "monitoring.metrics", "state.queues", "accounts.ledger"):
        assert f"ndif_celery.{above}" not in jobs.split(" -> ", 1)[1].split(", ")


def test_a_circle_held_by_a_function_local_import_is_named(tmp_path):
    root = tree(tmp_path, {
        "ndif_celery/a.py": "from . import b\n",
        "ndif_celery/b.py": "def later():\n    from ndif_celery.c import x\n",
        "ndif_celery/c.py": "import ndif_celery.a\nx = 1\n",
    })
    result = run("--root", str(root))
    assert result.returncode == 1
    assert ("cycle: ndif_celery.a -> ndif_celery.b -> ndif_celery.c -> ndif_celery.a "
            "(circle of 3 modules: ndif_celery.a, ndif_celery.b, ndif_celery.c)") in result.stderr


def test_the_web_reaching_torch_or_workers_through_the_core_is_refused(tmp_path):
    root = tree(tmp_path, {
        "web/routes.py": "def handler():\n    from ndif_celery import heavy\n",
        "ndif_celery/heavy.py": "import torch.nn\n",
        "web/app.py": "from workers.tasks import run\n",
        "workers/tasks.py": "run = None\n",
    })
    result = run("--root", str(root), "--quiet")
    assert result.returncode == 1
    assert "web must not import torch: web.routes -> ndif_celery.heavy -> torch" in result.stderr
    assert "web must not import workers: web.app -> workers.tasks" in result.stderr
    assert result.stdout == ""


def test_the_core_importing_workers_or_web_is_refused(tmp_path):
    root = tree(tmp_path, {
        "ndif_celery/jobs.py": "from web import app\n",
        "web/app.py": "",
        "ndif_celery/farm.py": "import workers.controller\n",
        "workers/controller.py": "from ndif_celery import jobs\n",
    })
    result = run("--root", str(root), "--quiet")
    assert result.returncode == 1
    assert "ndif_celery must not import web: ndif_celery.jobs -> web.app" in result.stderr
    assert "ndif_celery must not import workers: ndif_celery.farm -> workers.controller" in result.stderr


def test_an_import_from_a_layer_above_is_refused(tmp_path):
    root = tree(tmp_path, {
        "ndif_celery/state/jobs.py": "def later():\n    from ndif_celery.accounts import limits\n",
        "ndif_celery/accounts/limits.py": "from ndif_celery.state import jobs\n",
        "ndif_celery/stray.py": "",
    })
    result = run("--root", str(root), "--quiet")
    assert result.returncode == 1
    assert ("ndif_celery.state.jobs imports ndif_celery.accounts.limits from a layer above its own"
            in result.stderr)
    assert "ndif_celery.stray is on no layer of ndif_celery (add it to LAYERS)" in result.stderr
    # the downward edge of the same circle is not called a layer problem
    assert "ndif_celery.accounts.limits imports" not in result.stderr


def test_a_clean_tree_passes(tmp_path):
    root = tree(tmp_path, {
        "ndif_celery/wire.py": "import json\n",
        "ndif_celery/state/jobs.py": "from ndif_celery import wire\n",
        "web/routes.py": "from ndif_celery import wire\nfrom ndif_celery.state import jobs\n",
        "workers/tasks.py": "from ndif_celery.state.jobs import wire\nimport torch\n",
    })
    result = run("--root", str(root))
    assert result.returncode == 0, result.stderr
    assert "web.routes -> ndif_celery.state.jobs, ndif_celery.wire" in result.stdout
    assert "workers.tasks -> ndif_celery.state.jobs" in result.stdout


def test_an_import_for_type_checkers_only_is_no_edge(tmp_path):
    root = tree(tmp_path, {
        "ndif_celery/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ndif_celery import b\n",
        "ndif_celery/b.py": "from ndif_celery import a\n",
    })
    result = run("--root", str(root))
    assert "cycle" not in result.stderr
    assert "ndif_celery.a -> -" in result.stdout and "ndif_celery.b -> ndif_celery.a" in result.stdout
