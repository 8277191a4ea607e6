"""The type stub of config.py (``tools/config_stub.py`` writes ``ndif_celery/config.pyi``).

``Settings`` takes its fields from ``VARIABLES`` at import, so editors read them
from the stub: it must be what the tool writes now, and Python must never import it.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys

from ndif_celery import config
from tests.support.paths import ROOT

SCRIPT = ROOT / "tools" / "config_stub.py"
STUB = ROOT / "ndif_celery" / "config.pyi"


def test_the_checked_in_stub_is_what_the_tool_writes_now():
    result = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr + "(run: python tools/config_stub.py, and commit the stub)"


def test_the_stub_types_every_setting_with_its_parsers_type():
    tree = ast.parse(STUB.read_text())
    settings = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Settings")
    typed = {node.target.id: ast.unparse(node.annotation) for node in settings.body if isinstance(node, ast.AnnAssign)}
    wanted = {var.attr: var.parse.__annotations__["return"] for var in config.VARIABLES}
    assert typed == {**wanted, "embedded_redis": "bool"}


def test_python_imports_the_module_never_the_stub(tmp_path):
    assert importlib.util.find_spec("ndif_celery.config").origin == str(ROOT / "ndif_celery" / "config.py")
    assert config.load({"NDIF_HOME": str(tmp_path), "NDIF_API_PORT": "9001"}).api_port == 9001
