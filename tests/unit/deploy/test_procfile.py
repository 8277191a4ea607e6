"""The ``Procfile``'s lines, read without running them: each names an
executable of this virtualenv and a real ``ndif-celery`` subcommand, and
together they run every service of the stack. honcho running it:
tests/e2e/host/test_deploy_procfile.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ndif_celery.host.services import SERVICES
from tests.support.stacks.deploy_recipes import VENV_BIN, parse_cli, procfile


def test_procfile_lines_are_venv_executables_running_real_subcommands():
    lines = procfile()
    assert lines
    subcommands = set()
    for name, argv in lines.items():
        found = shutil.which(argv[0], path=str(VENV_BIN))
        assert found and Path(found) == VENV_BIN / argv[0], f"{name}: {argv[0]} is not an executable of {VENV_BIN}"
        subcommands.add(parse_cli(argv[1:]).command.name)
    assert subcommands == set(SERVICES), f"the Procfile runs {sorted(subcommands)}; the stack is {SERVICES}"
