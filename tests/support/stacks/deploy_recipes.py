"""What the deploy-recipe tests (``tests/unit/test_deploy*.py``, ``tests/e2e/host/test_deploy_procfile.py``) share: where the
recipes are, the real click parser of a recipe's command line, every
``NDIF_*`` name the configuration reads, a service's settings, and the
Dockerfile's and units' small parsers.

Why a module of its own: the recipe checks are split by recipe (this file's
users: ``test_deploy`` the names and the Dockerfile, ``test_deploy_compose``,
``test_deploy_systemd``, ``test_deploy_procfile``), and the Compose checks
read the Dockerfile's entrypoint and environment. The ``dockerfile`` fixture
is defined here and imported by the modules that use it.
"""

from __future__ import annotations

import configparser
import json
import re
import shlex
import sys
from pathlib import Path

import click
import pytest

from ndif_celery import config
from ndif_celery.cli import main as cli_main
from tests.support.paths import ROOT

DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
SYSTEMD = DEPLOY / "systemd"
ENV_EXAMPLE = SYSTEMD / "env.example"
PROCFILE = ROOT / "Procfile"
# Where the units expect the installation (docs/deploy.md says so).
INSTALLED_CLI = "/opt/ndif-celery/venv/bin/ndif-celery"
# The virtualenv running the tests: its console scripts (not resolved: the
# interpreter is a symlink out of the venv).
VENV_BIN = Path(sys.executable).parent
TARGET = "ndif-celery.target"


def parse_cli(argv: list[str]) -> click.Context:
    """Parse ``ndif-celery <argv>`` with the real click CLI down to the leaf
    command, without running it; raises ``click.UsageError`` on an unknown
    command, option or extra argument."""
    command: click.Command = cli_main
    ctx = command.make_context("ndif-celery", list(argv))
    while isinstance(command, click.Group):
        # click 8.x keeps the subcommand name apart from its arguments.
        args = [*ctx.__dict__.get("_protected_args", []), *ctx.args]
        name, sub, rest = command.resolve_command(ctx, args)
        ctx = sub.make_context(name, rest, parent=ctx)
        command = sub
    return ctx


def procfile() -> dict[str, list[str]]:
    """The ``Procfile``'s lines: process name -> its command, split as a shell would."""
    out = {}
    for line in PROCFILE.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9_-]+):\s*(.+)", line.strip())
        assert match, f"not a Procfile line: {line!r}"
        out[match.group(1)] = shlex.split(match.group(2))
    return out


def config_variables() -> set[str]:
    """Every ``NDIF_*`` name the configuration reads: ``config.VARIABLES``, the
    table ``tests/unit/ndif_celery/test_config.py`` keeps docs/configuration.md in sync
    with, cross-checked against what ``config.load`` asks its environment for
    while it runs."""
    seen: set[str] = set()

    class Recorder(dict):
        def get(self, key, default=None):
            seen.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            seen.add(key)
            return super().__getitem__(key)

    config.load(Recorder(NDIF_HOME="/nonexistent-ndif-home", NDIF_SECRET_KEY="x"))
    declared = {var.name for var in config.VARIABLES}
    read = {name for name in seen if name.startswith("NDIF_")}
    assert {"NDIF_HOME", "NDIF_REDIS_URL", "NDIF_OBJECT_STORE_BUCKET"} <= read
    assert read <= declared, f"config.load reads {sorted(read - declared)}, which config.VARIABLES misses"
    return declared


def load_settings(env: dict, home: Path) -> config.Settings:
    """``config.load`` of a service's environment; ``NDIF_HOME`` moved to
    ``home`` because the deployed path (/var/lib/...) is not writable here."""
    return config.load({**{k: str(v) for k, v in env.items()}, "NDIF_HOME": str(home)})


def setup_cfg() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    return parser


def cfg_list(value: str) -> list[str]:
    return [line.strip() for line in value.splitlines() if line.strip()]


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        pending += stripped
        instruction, _, args = pending.partition(" ")
        out.append((instruction.upper(), args.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends in a continuation line"
    return out


def dockerfile_env(instructions) -> dict:
    env = {}
    for instruction, args in instructions:
        if instruction == "ENV":
            for word in shlex.split(args):
                key, sep, value = word.partition("=")
                assert sep, f"ENV {args!r}: use the KEY=value form"
                env[key] = value
    return env


def exec_form(instructions, name: str) -> list[str]:
    found = [args for instruction, args in instructions if instruction == name]
    assert found, f"the Dockerfile has no {name}"
    value = json.loads(found[-1])
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"{name} must be the JSON (exec) form"
    return value


@pytest.fixture(scope="module")
def dockerfile():
    return dockerfile_instructions(DOCKERFILE.read_text())


def words(value) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]
