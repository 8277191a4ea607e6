"""The deploy recipes (``Procfile``, ``deploy/Dockerfile``,
``deploy/docker-compose.yml``, ``deploy/systemd/``) checked against the code
they run, offline: no image is built and no Docker daemon or systemd is used.

* Commands are parsed by the real click CLI (``ndif_celery.cli.main``), so an
  unknown subcommand or flag fails here, not on a production host.
* Every ``NDIF_*`` name must be one ``config.load`` reads.
* Settings are loaded with ``config.load`` and compared across services.
* The systemd units go through ``systemd-analyze verify``.
* The Procfile runs under ``honcho start`` and serves the real nnsight client.

One module per recipe: this one the ``NDIF_*`` names of every recipe and the
Dockerfile; ``test_deploy_compose``, ``test_deploy_systemd`` and
``test_deploy_procfile`` the others; what they share is ``tests/deploy_recipes``.
"""

from __future__ import annotations

import importlib
import re
import shlex
from fnmatch import fnmatch
from pathlib import Path

import click
import pytest

from ndif_celery.cli import main as cli_main
from tests.support.stacks.deploy_recipes import (
    COMPOSE_FILE,
    DOCKERFILE,
    ENV_EXAMPLE,
    PROCFILE,
    ROOT,
    SYSTEMD,
    VENV_BIN,
    cfg_list,
    config_variables,
    dockerfile,
    dockerfile_env,
    exec_form,
    load_settings,
    parse_cli,
    setup_cfg,
    words,
)

# --------------------------------------------------------------------------------
# The parser these checks use
# --------------------------------------------------------------------------------


def test_the_cli_parser_used_here_rejects_what_the_cli_rejects():
    """The checks below rely on parse_cli failing for a wrong command line."""
    assert parse_cli(["worker", "--gpus", "0", "--name", "a@b"]).params["gpus"] == "0"
    assert parse_cli(["keys", "list", "--json"]).command.name == "list"
    for wrong in (["wrker"], ["worker", "--gpu", "0"], ["web", "extra"], ["keys"], ["worker", "--memory", "lots"]):
        with pytest.raises(click.UsageError):
            parse_cli(wrong)


# --------------------------------------------------------------------------------
# NDIF_* names in every recipe
# --------------------------------------------------------------------------------


RECIPE_FILES = [
    COMPOSE_FILE, DOCKERFILE, ENV_EXAMPLE, PROCFILE, ROOT / "docs" / "deploy.md",
    *sorted(SYSTEMD.glob("*.service")), *sorted(SYSTEMD.glob("*.target")),
    ROOT / "deploy" / "slurm" / "ndif-worker.sbatch", *sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml")),
]


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_ndif_variable_in_the_recipes_is_one_the_code_reads(path):
    known = config_variables()
    used = set(re.findall(r"\bNDIF_[A-Z0-9_]+", path.read_text()))
    assert used - known == set(), f"{path.relative_to(ROOT)} names NDIF_* variables config.py never reads"


def test_the_recipes_do_configure_ndif_variables():
    # The check above passes trivially on a file without any; these must have some.
    for path in (COMPOSE_FILE, DOCKERFILE, ENV_EXAMPLE):
        assert re.search(r"\bNDIF_[A-Z0-9_]+", path.read_text()), path


# --------------------------------------------------------------------------------
# Dockerfile
# --------------------------------------------------------------------------------


def test_the_image_is_python_slim_with_torch_installed_first_from_a_chosen_index(dockerfile):
    names = [i for i, _ in dockerfile]
    assert dockerfile[0] == ("FROM", "python:3.11-slim")
    assert names.count("FROM") == 1

    args = {}
    for index, (instruction, value) in enumerate(dockerfile):
        if instruction == "ARG":
            name, _, default = value.partition("=")
            args[name] = (index, default)
    torch_pin = [r for r in cfg_list(setup_cfg()["options"]["install_requires"]) if re.match(r"torch\b", r)]
    assert torch_pin == ["torch==2.13.0"]
    assert args["TORCH_SPEC"][1] == torch_pin[0], "TORCH_SPEC must default to setup.cfg's torch pin"
    assert "TORCH_INDEX_URL" in args

    runs = [(i, v) for i, (instruction, v) in enumerate(dockerfile) if instruction == "RUN"]
    torch_runs = [i for i, v in runs if re.search(r"pip install\b.*\$\{?TORCH_SPEC\}?", v)]
    project_runs = [i for i, v in runs if re.search(r"pip install\b[^;&|]*\s\.(\s|$)", v)]
    assert len(torch_runs) == 1 and len(project_runs) == 1, (torch_runs, project_runs)
    torch_run = dockerfile[torch_runs[0]][1]
    assert re.search(r"\$\{?TORCH_INDEX_URL", torch_run), "the torch install must use TORCH_INDEX_URL"
    # The ARGs are declared in the stage, before the RUN that reads them.
    assert 0 < args["TORCH_SPEC"][0] < torch_runs[0] and 0 < args["TORCH_INDEX_URL"][0] < torch_runs[0]
    assert torch_runs[0] < project_runs[0], "torch must be installed before the project"
    first_copy = names.index("COPY")
    assert torch_runs[0] < first_copy, "install torch before copying the code, so code changes keep its layer"


def dockerignore_patterns() -> list[str]:
    return [
        line.strip().lstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def dockerignored(rel: str, patterns: list[str]) -> bool:
    """Whether .dockerignore excludes ``rel`` (or a folder above it)."""
    parts = Path(rel).parts
    for depth in range(1, len(parts) + 1):
        prefix = "/".join(parts[:depth])
        for pattern in patterns:
            if fnmatch(prefix, pattern):
                return True
            if pattern.startswith("**/") and any(
                fnmatch("/".join(parts[start:depth]), pattern[3:]) for start in range(depth)
            ):
                return True
    return False


def test_dockerignore_keeps_local_state_out_of_the_build_context():
    patterns = dockerignore_patterns()
    for rel in (".venv/bin/python", ".git/HEAD", "tests/_out/hf/x", "ndif_celery/__pycache__/cli.cpython-311.pyc"):
        assert dockerignored(rel, patterns), f"{rel} is sent to the Docker build"
    assert not dockerignored("ndif_celery/cli/__init__.py", patterns)


def test_every_copy_source_exists_and_the_project_is_complete(dockerfile):
    patterns = dockerignore_patterns()
    copied = set()
    for instruction, args in dockerfile:
        if instruction not in ("COPY", "ADD"):
            continue
        assert instruction == "COPY", "use COPY, not ADD"
        words = [w for w in shlex.split(args) if not w.startswith("--")]
        assert len(words) >= 2, args
        for source in words[:-1]:
            assert (ROOT / source).exists(), f"COPY {source}: no such file in the build context (the repo root)"
            assert not dockerignored(source, patterns), f"COPY {source}: excluded by .dockerignore"
            copied.add(Path(source).as_posix().rstrip("/"))

    cfg = setup_cfg()
    needed = {"setup.py", "setup.cfg"}
    needed |= {p.rstrip("*") for p in cfg_list(cfg["options.packages.find"]["include"]) if "." not in p.rstrip("*")}
    for key in ("long_description", "license_files"):
        value = cfg["metadata"].get(key, "")
        if value.startswith("file:"):
            needed |= {f.strip() for f in value[len("file:"):].split(",")}
    missing = needed - copied
    assert not missing, f"`pip install .` in the image needs {sorted(missing)}, which are not copied"


def test_the_image_runs_the_cli_as_a_non_root_user(dockerfile, tmp_path):
    names = [i for i, _ in dockerfile]
    users = [(i, v) for i, (instruction, v) in enumerate(dockerfile) if instruction == "USER"]
    assert users, "the image runs as root"
    last_user_index, user = users[-1]
    assert user.split(":")[0] not in ("root", "0")
    last_run = max(i for i, n in enumerate(names) if n == "RUN")
    assert last_run < last_user_index < names.index("ENTRYPOINT")

    entrypoint = exec_form(dockerfile, "ENTRYPOINT")
    scripts = dict(
        (name.strip(), target.strip())
        for name, _, target in (line.partition("=") for line in cfg_list(setup_cfg()["options.entry_points"]["console_scripts"]))
    )
    assert entrypoint == ["ndif-celery"] and entrypoint[0] in scripts
    module, _, attr = scripts[entrypoint[0]].partition(":")
    assert getattr(importlib.import_module(module), attr) is cli_main
    assert (VENV_BIN / entrypoint[0]).is_file(), f"the console script is not installed in {VENV_BIN}"

    cmd = exec_form(dockerfile, "CMD")
    assert cmd == ["up"]
    parse_cli(cmd)

    # The ports the image's environment gives the API and Flower are exposed.
    exposed = {int(p.split("/")[0]) for i, v in dockerfile if i == "EXPOSE" for p in v.split()}
    settings = load_settings(dockerfile_env(dockerfile), tmp_path / "home")
    assert {settings.api_port, settings.flower_port} <= exposed
    # ...and the web listens beyond the container's loopback.
    assert settings.api_host == "0.0.0.0"


def test_the_image_requires_keys_by_default(dockerfile, tmp_path):
    """Its web listens on every address, so an open farm (no keys, every request
    trusted in the worker) is the operator's explicit NDIF_AUTH=0, not the default."""
    settings = load_settings(dockerfile_env(dockerfile), tmp_path / "home")
    assert settings.api_host == "0.0.0.0" and settings.auth, "the image serves an open farm on every address"


def test_the_images_model_cache_lies_outside_what_a_jailed_child_reads(dockerfile):
    """A child reads its own model's folder of the cache, nothing else of it: that
    holds only where HF_HOME is under none of the paths the jail leaves readable
    (the image's Python lives in /usr/local; /var is not readable)."""
    from workers.isolation.jail import SYSTEM_READABLE, covering

    hf_home = dockerfile_env(dockerfile)["HF_HOME"]
    assert covering(["/usr/local", *SYSTEM_READABLE], [hf_home, f"{hf_home}/hub", f"{hf_home}/token"]) == ("", "")
