"""The deploy recipes (``Procfile``, ``deploy/Dockerfile``,
``deploy/docker-compose.yml``, ``deploy/systemd/``) checked against the code
they run, offline: no image is built and no Docker daemon or systemd is used.

* Commands are parsed by the real click CLI (``ndif_celery.cli.main``), so an
  unknown subcommand or flag fails here, not on a production host.
* Every ``NDIF_*`` name must be one ``config.load`` reads.
* Settings are loaded with ``config.load`` and compared across services.
* The systemd units go through ``systemd-analyze verify``.
* The Procfile runs under ``honcho start`` and serves the real nnsight client.
"""

from __future__ import annotations

import configparser
import contextlib
import importlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from fnmatch import fnmatch
from pathlib import Path
from urllib.parse import urlparse

import click
import pytest
import yaml

from ndif_celery import config
from ndif_celery.cli import main as cli_main
from ndif_celery.stack import SERVICES
from tests.servers import free_ports, port_open
from tests.stack import _NOT_INHERITED

ROOT = Path(__file__).resolve().parent.parent
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


# --------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------


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


def config_variables() -> set[str]:
    """Every ``NDIF_*`` name the configuration reads: ``config.VARIABLES``, the
    table ``tests/test_wire_and_config.py`` keeps docs/configuration.md in sync
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
    assert not dockerignored("ndif_celery/cli.py", patterns)


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


# --------------------------------------------------------------------------------
# docker-compose.yml
# --------------------------------------------------------------------------------

_VAR = re.compile(r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?P<sep>:?-)?(?P<default>[^}]*)\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value):
    """Compose's interpolation with every ``${VAR:-default}`` at its default
    (what a trial run without an .env gets); ``$$`` is a literal ``$``."""
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if not isinstance(value, str):
        return value

    def one(match):
        if match.group("bare") or not match.group("sep"):
            raise AssertionError(f"{match.group(0)} in {value!r}: give it a default (${{VAR:-default}})")
        return match.group("default")

    return "$".join(_VAR.sub(one, part) for part in value.split("$$"))


@pytest.fixture(scope="module")
def compose() -> dict:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    return interpolate(raw)


@pytest.fixture(scope="module")
def image_env(dockerfile) -> dict:
    return dockerfile_env(dockerfile)


def services(compose) -> dict:
    return compose["services"]


def ours(compose) -> dict:
    """The services that run this project's image (built from deploy/Dockerfile)."""
    out = {}
    for name, service in services(compose).items():
        build = service.get("build")
        if build is None:
            continue
        build = {"context": build} if isinstance(build, str) else build
        context = (COMPOSE_FILE.parent / build.get("context", ".")).resolve()
        dockerfile = (context / build.get("dockerfile", "Dockerfile")).resolve()
        assert context == ROOT, f"{name}: the build context must be the repository root"
        assert dockerfile == DOCKERFILE, f"{name}: builds {dockerfile}, not deploy/Dockerfile"
        out[name] = service
    return out


def environment(service: dict) -> dict:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    for key, value in env.items():
        # Compose refuses booleans and nulls here ("invalid type").
        assert isinstance(value, (str, int, float)) and not isinstance(value, bool), f"{key}: {value!r}"
    return {k: str(v) for k, v in env.items()}


def words(value) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def argv_of(service: dict, dockerfile) -> list[str]:
    entrypoint = words(service.get("entrypoint")) or exec_form(dockerfile, "ENTRYPOINT")
    command = words(service.get("command")) if "command" in service else exec_form(dockerfile, "CMD")
    return entrypoint + command


def settings_of(name: str, compose, image_env, tmp_path) -> config.Settings:
    service = services(compose)[name]
    base = image_env if name in ours(compose) else {}
    return load_settings({**base, **environment(service)}, tmp_path / f"home-{name}")


def ports_of(service: dict) -> list[tuple[str, int, int]]:
    """(host ip, host port, container port) of each published port."""
    out = []
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            out.append((entry.get("host_ip", ""), int(entry["published"]), int(entry["target"])))
            continue
        parts = str(entry).split("/")[0].split(":")
        ip = parts[0] if len(parts) == 3 else ""
        out.append((ip, int(parts[-2]) if len(parts) > 1 else int(parts[-1]), int(parts[-1])))
    return out


def by_image(compose, prefix: str) -> str:
    found = [n for n, s in services(compose).items() if str(s.get("image", "")).startswith(prefix)]
    assert len(found) == 1, f"one service with image {prefix}*: {found}"
    return found[0]


def ndif_commands(compose, dockerfile) -> dict[str, click.Context]:
    out = {}
    for name, service in ours(compose).items():
        argv = argv_of(service, dockerfile)
        assert argv[0] == "ndif-celery", f"{name} runs {argv[0]!r}, not ndif-celery"
        try:
            out[name] = parse_cli(argv[1:])
        except click.UsageError as exc:
            raise AssertionError(f"{name}: `{shlex.join(argv)}` is not a valid command: {exc.format_message()}") from None
    return out


def workers(compose, dockerfile) -> dict[str, click.Context]:
    return {n: c for n, c in ndif_commands(compose, dockerfile).items() if c.command.name == "worker"}


def test_every_service_has_an_image_or_a_build(compose):
    assert services(compose)
    for name, service in services(compose).items():
        assert service.get("image") or service.get("build"), f"{name} has neither image nor build"


def test_every_service_of_the_stack_runs_as_a_real_cli_command(compose, dockerfile):
    commands = ndif_commands(compose, dockerfile)
    kinds = [ctx.command.name for ctx in commands.values()]
    # Redis is the redis image's; every other service of the stack runs here.
    assert set(kinds) == set(SERVICES) - {"redis"}, kinds
    assert commands["web"].command.name == "web" and commands["flower"].command.name == "flower"
    beats = [name for name, ctx in commands.items() if ctx.command.name == "beat"]
    assert len(beats) == 1, f"run exactly one beat per farm, not {beats}"
    assert services(compose)[beats[0]].get("deploy", {}).get("replicas", 1) == 1


def test_the_farm_services_agree_on_broker_store_bucket_and_database(compose, image_env, tmp_path):
    minio, postgres, redis_name = by_image(compose, "minio/minio"), by_image(compose, "postgres"), by_image(compose, "redis")
    minio_env, pg_env = environment(services(compose)[minio]), environment(services(compose)[postgres])
    farm = {n: settings_of(n, compose, image_env, tmp_path) for n in ours(compose) if n != "flower"}
    assert "web" in farm and len(farm) >= 3

    from sqlalchemy.engine import make_url

    shared = ("redis_url", "object_store_url", "object_store_public_url", "object_store_access_key",
              "object_store_secret_key", "object_store_bucket", "database_url", "auth")
    web = farm["web"]
    for name, settings in farm.items():
        for field in shared:
            assert getattr(settings, field) == getattr(web, field), f"{name} and web differ in {field}"
        # Containers share no filesystem: results must go through the object store.
        assert settings.uses_s3 and not settings.embedded_redis, name

    broker = urlparse(web.redis_url)
    assert (broker.hostname, broker.port or 6379) == (redis_name, 6379)
    store = urlparse(web.object_store_url)
    assert (store.hostname, store.port) == (minio, 9000)
    assert (web.object_store_access_key, web.object_store_secret_key) == (
        minio_env["MINIO_ROOT_USER"], minio_env["MINIO_ROOT_PASSWORD"]
    )
    assert len(minio_env["MINIO_ROOT_PASSWORD"]) >= 8, "MinIO refuses a root password under 8 characters"
    public = urlparse(web.object_store_public_url)
    assert public.port in {p for _, p, target in ports_of(services(compose)[minio]) if target == 9000}
    db = make_url(web.database_url)
    assert db.drivername == "postgresql+psycopg" and db.host == postgres
    assert (db.username, db.password, db.database) == (pg_env["POSTGRES_USER"], pg_env["POSTGRES_PASSWORD"], pg_env["POSTGRES_DB"])

    assert web.api_host == "0.0.0.0"
    assert web.api_port in {target for _, _, target in ports_of(services(compose)["web"])}


def test_flower_reaches_the_broker(compose, image_env, tmp_path):
    flower = services(compose)["flower"]
    settings = settings_of("flower", compose, image_env, tmp_path)
    broker = urlparse(settings.redis_url)
    redis_name = by_image(compose, "redis")
    if flower.get("network_mode") == "host":
        # `ndif-celery flower` listens on 127.0.0.1 only: in the host's network
        # it reaches Redis on the port the redis service publishes there.
        assert broker.hostname in ("127.0.0.1", "localhost")
        published = {(ip, port) for ip, port, target in ports_of(services(compose)[redis_name]) if target == 6379}
        assert any(port == (broker.port or 6379) for _, port in published), published
        assert all(ip == "127.0.0.1" for ip, _ in published), "publish Redis on the host's loopback only"
    else:
        assert (broker.hostname, broker.port or 6379) == (redis_name, 6379)


def test_gpu_workers_each_reserve_their_own_nvidia_gpu(compose, dockerfile, image_env, tmp_path):
    gpu_workers = workers(compose, dockerfile)
    assert {"worker-gpu0", "worker-gpu1"} <= set(gpu_workers)
    taken, names = set(), set()
    for name, ctx in gpu_workers.items():
        service = services(compose)[name]
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        nvidia = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]
        assert len(nvidia) == 1, f"{name}: one nvidia device reservation with capabilities [gpu]"
        ids = [str(i) for i in nvidia[0]["device_ids"]]
        assert ids and not (set(ids) & taken), f"{name}: device_ids {ids} empty or already reserved"
        taken |= set(ids)
        # Inside the container its reserved GPUs are numbered 0..n-1.
        gpus = ctx.params["gpus"]
        assert gpus is not None, f"{name}: pass --gpus"
        assert all(0 <= int(g) < len(ids) for g in gpus.split(",")), f"{name}: --gpus {gpus} vs {len(ids)} GPU(s)"
        worker_name = ctx.params["name"]
        assert worker_name and worker_name not in names, f"{name}: --name must be set and unique"
        names.add(worker_name)
        # docker stop waits for the running job (SIGTERM lets it finish).
        assert service.get("stop_signal", "SIGTERM") == "SIGTERM"
        grace = compose_duration(service.get("stop_grace_period", "10s"))
        timeout = settings_of(name, compose, image_env, tmp_path).execution_timeout_s
        assert grace > timeout, f"{name}: stop_grace_period {grace}s does not cover a {timeout}s job"


def compose_duration(value) -> float:
    units = {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    text = str(value)
    parts = re.findall(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


def test_redis_keeps_an_append_only_file_on_a_volume(compose):
    redis_service = services(compose)[by_image(compose, "redis")]
    assert str(redis_service["image"]).split(":")[1].split(".")[0] == "7"
    argv = words(redis_service.get("command"))
    assert argv and "--appendonly" in argv and argv[argv.index("--appendonly") + 1] == "yes", argv
    assert any(str(v).endswith(":/data") for v in redis_service.get("volumes", []))
    assert redis_service.get("healthcheck")


def shell_commands(script: str, env: dict) -> list[list[str]]:
    """The simple commands of a /bin/sh script, ``$VAR`` expanded from ``env``."""

    def expand(match):
        name = match.group(1) or match.group(2)
        assert name in env, f"${name} is not set in the service's environment"
        return env[name]

    script = re.sub(r"\$(?:\{(\w+)\}|(\w+))", expand, script)
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token in (";", "&&", "||", "|", "&"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    return [c for c in commands if c]


def test_minio_init_sets_an_expiry_rule_on_the_farm_bucket(compose, dockerfile, image_env, tmp_path):
    name = by_image(compose, "minio/mc")
    service = services(compose)[name]
    minio = by_image(compose, "minio/minio")
    assert service["depends_on"][minio]["condition"] == "service_healthy"
    argv = words(service.get("entrypoint")) + words(service.get("command"))
    assert argv[:2] in (["/bin/sh", "-c"], ["sh", "-c"]) and len(argv) == 3, argv
    commands = shell_commands(argv[2], environment(service))

    aliases = {c[3]: c[4] for c in commands if c[:3] == ["mc", "alias", "set"]}
    for alias, url in aliases.items():
        assert (urlparse(url).hostname, urlparse(url).port) == (minio, 9000)
    made = [c[-1] for c in commands if c[:2] == ["mc", "mb"]]
    rules = [c for c in commands if c[:4] == ["mc", "ilm", "rule", "add"]]
    assert rules, "no `mc ilm rule add`"
    buckets = set()
    for rule in rules:
        days = int(rule[rule.index("--expire-days") + 1])
        assert days > 0
        alias, _, bucket = rule[-1].partition("/")
        assert alias in aliases and rule[-1] in made
        buckets.add(bucket)

    farm = {settings_of(n, compose, image_env, tmp_path).object_store_bucket
            for n, ctx in ndif_commands(compose, dockerfile).items() if ctx.command.name in ("web", "worker")}
    assert len(farm) == 1 and farm <= buckets, f"the farm uses bucket {farm}; the expiry rule is on {buckets}"


def test_every_long_running_service_is_restarted_by_docker(compose):
    """Compose is these services' supervisor (``up``'s is not used): each one
    that is not a one-shot comes back after a crash, an OOM kill or a worker
    that replaced itself (ndif_celery.supervisor.REPLACE_EXIT_CODE)."""
    for name, service in services(compose).items():
        if name == by_image(compose, "minio/mc"):
            assert service.get("restart") == "no", name  # the bucket's one-shot setup
            continue
        assert service.get("restart") in ("unless-stopped", "always"), f"{name}: restart {service.get('restart')!r}"


def test_dependencies_wait_for_health(compose, dockerfile, image_env, tmp_path):
    all_services = services(compose)
    for name, service in all_services.items():
        depends = service.get("depends_on", {})
        assert isinstance(depends, dict), f"{name}: use depends_on with conditions"
        for target, rule in depends.items():
            assert target in all_services, f"{name} depends on unknown {target}"
            condition = rule["condition"]
            if condition == "service_healthy":
                assert all_services[target].get("healthcheck"), f"{name} waits for {target}'s health; it has no check"
            else:
                assert condition == "service_completed_successfully", condition
                assert all_services[target].get("restart", "no") == "no", f"{target} is a one-shot"

    redis_name, postgres, init = by_image(compose, "redis"), by_image(compose, "postgres"), by_image(compose, "minio/mc")
    for name, ctx in ndif_commands(compose, dockerfile).items():
        depends = all_services[name].get("depends_on", {})
        assert depends.get(redis_name, {}).get("condition") == "service_healthy", name
        settings = settings_of(name, compose, image_env, tmp_path)
        if settings.uses_s3:
            assert depends.get(init, {}).get("condition") == "service_completed_successfully", name
        if urlparse(settings.database_url).hostname == postgres and ctx.command.name != "flower":
            assert depends.get(postgres, {}).get("condition") == "service_healthy", name
    for name in ("web", "flower"):
        assert all_services[name].get("healthcheck"), f"{name} has no healthcheck"


def test_workers_share_the_hf_cache_volume_at_their_hf_home(compose, dockerfile, image_env):
    assert "hf-cache" in (compose.get("volumes") or {})
    for name in workers(compose, dockerfile):
        hf_home = {**image_env, **environment(services(compose)[name])}.get("HF_HOME")
        assert hf_home, f"{name}: no HF_HOME"
        mounts = [str(v) for v in services(compose)[name].get("volumes", [])]
        assert f"hf-cache:{hf_home}" in mounts, f"{name}: mount hf-cache at HF_HOME={hf_home}"


# --------------------------------------------------------------------------------
# systemd
# --------------------------------------------------------------------------------


def unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (systemd allows a key more than once)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped[0] in "#;":
            continue
        assert not stripped.endswith("\\"), f"{path.name}: keep each setting on one line"
        if stripped.startswith("["):
            current = sections.setdefault(stripped.strip("[]"), {})
            continue
        key, sep, value = stripped.partition("=")
        assert sep and current is not None, f"{path.name}: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(sections, section: str, key: str) -> str:
    values = sections.get(section, {}).get(key, [])
    assert len(values) == 1, f"[{section}] {key}: {values}"
    return values[0]


def systemd_seconds(value: str) -> float:
    if re.fullmatch(r"\d+(\.\d+)?", value):
        return float(value)
    units = {"us": 1e-6, "ms": 1e-3, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "d": 86400}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]+)", value)
    assert parts and all(u in units for _, u in parts), f"not a time span: {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


def env_file(path: Path) -> dict:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: {line!r}"
            env[key.strip()] = value.strip()
    return env


SERVICE_UNITS = {
    "ndif-celery-web.service": "web",
    "ndif-celery-flower.service": "flower",
    "ndif-celery-beat.service": "beat",
    "ndif-celery-worker@.service": "worker",
}


def test_the_units_cover_every_service_of_the_stack():
    present = {p.name for p in SYSTEMD.iterdir() if p.suffix in (".service", ".target")}
    assert present == set(SERVICE_UNITS) | {TARGET}
    # Redis (like MinIO and PostgreSQL) is the operator's own.
    assert set(SERVICE_UNITS.values()) == set(SERVICES) - {"redis"}


@pytest.mark.parametrize("name", sorted(SERVICE_UNITS))
def test_each_unit_runs_a_real_cli_command_under_the_farm_target(name, tmp_path):
    sections = unit(SYSTEMD / name)
    assert one(sections, "Service", "EnvironmentFile") == "/etc/ndif-celery/env"
    # Its own supervisor: restarted whatever ended it, a worker that replaced
    # itself (ndif_celery.supervisor.REPLACE_EXIT_CODE) or exited 0 included.
    assert one(sections, "Service", "Restart") == "always"
    assert one(sections, "Service", "KillSignal") == "SIGTERM"
    assert one(sections, "Unit", "PartOf") == TARGET
    assert one(sections, "Install", "WantedBy") == TARGET

    argv = shlex.split(one(sections, "Service", "ExecStart"))
    assert argv[0] == INSTALLED_CLI
    expanded = []
    for word in argv[1:]:
        expanded.append(re.sub(r"%(.)", lambda m: {"i": "0", "H": "gpu-host", "%": "%"}[m.group(1)], word))
    ctx = parse_cli(expanded)
    assert ctx.command.name == SERVICE_UNITS[name]

    stop = systemd_seconds(one(sections, "Service", "TimeoutStopSec"))
    if SERVICE_UNITS[name] == "worker":
        # The template's instance is the GPU index, and names the worker.
        assert argv[argv.index("--gpus") + 1] == "%i" and "%i" in argv[argv.index("--name") + 1]
        timeout = load_settings(env_file(ENV_EXAMPLE), tmp_path / "home").execution_timeout_s
        assert stop > timeout, f"TimeoutStopSec={stop}s would kill a job inside its {timeout}s deadline"
        # Only the worker gets SIGTERM; an isolated job's processes are left to it.
        assert one(sections, "Service", "KillMode") == "mixed"


def test_the_target_is_started_at_boot():
    sections = unit(SYSTEMD / TARGET)
    assert one(sections, "Install", "WantedBy") == "multi-user.target"


def test_env_example_is_a_multi_host_configuration(tmp_path):
    settings = load_settings(env_file(ENV_EXAMPLE), tmp_path / "home")
    assert not settings.embedded_redis and settings.uses_s3 and settings.auth
    assert settings.database_url.startswith("postgresql+psycopg://")


def _verify(units: list[Path], unit_dir: Path) -> tuple[int, list[str]]:
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{unit_dir}:", "SYSTEMD_LOG_COLOR": "0"}
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *map(str, units)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    return result.returncode, (result.stdout + result.stderr).splitlines()


def _ours(lines: list[str], unit_dir: Path, names: list[str]) -> list[str]:
    """The lines about our units (anything else is about the host's own units)."""
    stems = [n.split("@")[0].removesuffix(".service").removesuffix(".target") for n in names]
    return [line for line in lines if str(unit_dir) in line or any(s in line for s in stems)]


def test_systemd_analyze_verifies_the_units(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd), so the units cannot be verified")
    cli = VENV_BIN / "ndif-celery"
    assert cli.is_file() and os.access(cli, os.X_OK), f"{cli} is not installed"
    unit_dir = tmp_path / "units"
    unit_dir.mkdir()
    names = sorted(p.name for p in SYSTEMD.iterdir() if p.suffix in (".service", ".target"))
    for name in names:
        text = (SYSTEMD / name).read_text()
        if name.endswith(".service"):
            assert f"ExecStart={INSTALLED_CLI} " in text, name
        (unit_dir / name).write_text(text.replace(INSTALLED_CLI, str(cli)))
    # The template is verified as instances, the way systemctl starts it.
    to_verify = [unit_dir / n for n in names if "@." not in n]
    to_verify += [unit_dir / "ndif-celery-worker@0.service", unit_dir / "ndif-celery-worker@1.service"]

    rc, lines = _verify(to_verify, unit_dir)
    problems = _ours(lines, unit_dir, names)
    assert rc == 0 and not problems, "\n".join(lines)

    # The same check on a broken copy must fail, or it proves nothing here.
    broken_dir = tmp_path / "broken"
    broken_dir.mkdir()
    template = (unit_dir / "ndif-celery-worker@.service").read_text()
    (broken_dir / "ndif-celery-worker@.service").write_text(
        template.replace(str(cli), str(tmp_path / "missing" / "ndif-celery")).replace("Restart=always", "Restart=sometimes")
    )
    rc, lines = _verify([broken_dir / "ndif-celery-worker@0.service"], broken_dir)
    problems = _ours(lines, broken_dir, ["ndif-celery-worker@.service"])
    assert rc != 0 and any("not executable" in line for line in problems), lines
    assert any("sometimes" in line for line in problems), lines


# --------------------------------------------------------------------------------
# Procfile
# --------------------------------------------------------------------------------


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


def _processes() -> dict[int, tuple[int, str, str, str]]:
    """pid -> (parent pid, state, start time, command line) of every process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        out[int(entry.name)] = (int(fields[1]), fields[0], fields[19], cmdline)
    return out


def _descendants(root: int) -> dict[int, tuple[str, str]]:
    """(start time, command line) of every live process below ``root``."""
    procs = _processes()
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, state, start, cmdline) in procs.items():
            if ppid == parent and pid not in found and state not in "ZX":
                found[pid] = (start, cmdline)
                frontier.append(pid)
    return found


def _marked(mark: str) -> dict[int, tuple[str, str]]:
    """Live processes whose environment carries ``mark`` (our farm's, whoever their parent now is)."""
    needle = f"DEPLOY_TEST_MARK={mark}".encode()
    found = {}
    for pid, (_, state, start, cmdline) in _processes().items():
        if state in "ZX":
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in environ:
            found[pid] = (start, cmdline)
    return found


def _still_alive(known: dict[int, tuple[str, str]]) -> dict[int, str]:
    procs = _processes()
    return {
        pid: cmdline for pid, (start, cmdline) in known.items()
        if pid in procs and procs[pid][2] == start and procs[pid][1] not in "ZX"
    }


def _tail(path: Path, lines: int = 80) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _wait_ready(proc, url: str, redis_url: str, flower_url: str, log: Path, timeout: float = 300) -> None:
    import httpx
    import redis

    from ndif_celery import registry

    pending = {"web": f"{url}/ping", "flower": f"{flower_url}/healthcheck", "worker": registry.WORKERS}
    deadline = time.monotonic() + timeout
    with contextlib.closing(redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)) as client, \
            httpx.Client(timeout=2, trust_env=False) as http:
        while pending:
            if proc.poll() is not None:
                raise AssertionError(f"honcho exited with {proc.returncode} while starting:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"not ready within {timeout}s, waiting for {sorted(pending)}:\n{_tail(log)}")
            for name, what in list(pending.items()):
                try:
                    ok = client.hlen(what) > 0 if name == "worker" else http.get(what).status_code == 200
                except (httpx.HTTPError, redis.RedisError, OSError):
                    ok = False
                if ok:
                    del pending[name]
            time.sleep(0.25)


@contextlib.contextmanager
def _client_at(url: str):
    import nnsight

    api = nnsight.CONFIG.API
    saved = api.HOST, api.APIKEY, api.COMPRESS
    api.HOST = url
    try:
        yield
    finally:
        api.HOST, api.APIKEY, api.COMPRESS = saved


@pytest.mark.e2e  # starts a stack in its body
def test_honcho_runs_the_procfile_as_a_working_farm_and_stops_all_of_it(tmp_path, hf_home, model):
    from conformance import assert_same, case_read_logits, case_zero_output
    from tests.remote import PollUntilDone

    honcho = VENV_BIN / "honcho"
    assert honcho.is_file(), f"{honcho} is missing: pip install -e '.[test]' (honcho is a test extra)"
    api, redis_port, flower_port = free_ports(3)
    farm_env = tmp_path / "farm.env"  # what an operator puts in .env
    farm_env.write_text(
        f"NDIF_HOME={tmp_path / 'home'}\nNDIF_API_PORT={api}\n"
        f"NDIF_EMBEDDED_REDIS_PORT={redis_port}\nNDIF_FLOWER_PORT={flower_port}\n"
    )
    mark = uuid.uuid4().hex
    env = {
        k: v for k, v in os.environ.items()
        if k not in _NOT_INHERITED and not k.startswith("NDIF_") and "proxy" not in k.lower()
    }
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        NO_PROXY="127.0.0.1,localhost", PYTHONUNBUFFERED="1", DEPLOY_TEST_MARK=mark,
    )
    log = tmp_path / "honcho.log"
    url = f"http://127.0.0.1:{api}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(honcho), "-f", str(PROCFILE), "-d", str(ROOT), "-e", str(farm_env), "--no-colour", "start"],
            cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    seen: dict[int, tuple[str, str]] = {}
    try:
        _wait_ready(proc, url, f"redis://127.0.0.1:{redis_port}/0", f"http://127.0.0.1:{flower_port}", log)
        seen.update(_descendants(proc.pid))
        running = " ".join(cmdline for _, cmdline in seen.values())
        for program in ("redis-server", "gunicorn", "celery"):
            assert program in running, f"no {program} under honcho: {running}"
        started = log.read_text(errors="replace")
        for name in procfile():
            assert f"{name}.1 started" in started and f"{name}.1 stopped" not in started, f"{name}:\n{_tail(log)}"

        with _client_at(url):
            local = case_zero_output(model, lambda m: {}, tmp_path)
            assert_same(case_zero_output(model, lambda m: {"remote": True}, tmp_path), local, "blocking")
            local = case_read_logits(model, lambda m: {}, tmp_path)
            assert_same(case_read_logits(model, lambda m: {"backend": PollUntilDone(m)}, tmp_path), local, "non-blocking")

        seen.update(_descendants(proc.pid))
        seen.update(_marked(mark))
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"honcho did not exit within 60 s of SIGTERM:\n{_tail(log)}") from None
        assert "SIGTERM received" in log.read_text(errors="replace")

        deadline = time.monotonic() + 15
        while True:
            left = {**_still_alive(seen), **{pid: c for pid, (_, c) in _marked(mark).items()}}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not left, f"left running after honcho stopped: {left}\n{_tail(log)}"
        for port in (api, redis_port, flower_port):
            assert not port_open(port), f"something still listens on {port}"
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        # honcho gives every service its own process group: kill what is left of ours.
        leftovers = {**_still_alive(seen), **{pid: c for pid, (_, c) in _marked(mark).items()}}
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                pgid = os.getpgid(pid)
                if pgid != os.getpgrp():
                    os.killpg(pgid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
