"""The web app imports no torch, transformers or nnsight: data flows one way,
and the web only enqueues."""

from __future__ import annotations

import subprocess
import sys

from tests.support.paths import ROOT


def test_the_web_never_imports_torch(tmp_path):
    script = (
        "import sys\n"
        "from ndif_celery import config\n"
        "from web.app import create_app\n"
        f"app = create_app(config.load({{'NDIF_HOME': {str(tmp_path)!r}}}))\n"
        "assert app.url_map is not None\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'nnsight') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
