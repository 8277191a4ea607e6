"""The ``Procfile``: each line a virtualenv executable running a real
subcommand. ``honcho start`` running it as a working farm is
tests/e2e/host/test_deploy_procfile.py. Shared helpers:
``tests/support/deploy_recipes.py``.
"""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path


from ndif_celery.host.services import SERVICES
from tests.support.deploy_recipes import PROCFILE, VENV_BIN, parse_cli


def procfile() -> dict[str, list[str]]:
    out = {}
    for line in PROCFILE.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9_-]+):\s*(.+)", line.strip())
        assert match, f"not a Procfile line: {line!r}"
        out[match.group(1)] = shlex.split(match.group(2))
    return out


def test_procfile_lines_are_venv_executables_running_real_subcommands():
    lines = procfile()
    assert lines
    subcommands = set()
    for name, argv in lines.items():
        found = shutil.which(argv[0], path=str(VENV_BIN))
        assert found and Path(found) == VENV_BIN / argv[0], f"{name}: {argv[0]} is not an executable of {VENV_BIN}"
        subcommands.add(parse_cli(argv[1:]).command.name)
    assert subcommands == set(SERVICES), f"the Procfile runs {sorted(subcommands)}; the stack is {SERVICES}"
