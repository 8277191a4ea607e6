"""``deploy/docker-compose.yml`` checked against the code it runs, offline (no
Docker daemon): every service's command parsed by the real CLI, the farm's
services agreeing on broker, store, bucket and database, GPUs, health-gated
dependencies, restart policies, volumes. Shared helpers: ``tests/deploy_recipes``.
"""

from __future__ import annotations

import re
import shlex
from urllib.parse import urlparse

import click
import pytest
import yaml

from ndif_celery import config
from ndif_celery.host.services import SERVICES
from tests.support.stacks.deploy_recipes import (
    COMPOSE_FILE,
    DOCKERFILE,
    ROOT,
    dockerfile,
    dockerfile_env,
    exec_form,
    load_settings,
    parse_cli,
    words,
)

_VAR = re.compile(r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?P<sep>:?-|:\?)?(?P<default>[^}]*)\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


# What an operator puts in deploy/.env: the secrets the file requires (``${VAR:?...}``).
OPERATOR_ENV = {
    "MINIO_ROOT_USER": "operator-root", "MINIO_ROOT_PASSWORD": "operator-root-password",
    "STORE_ACCESS_KEY": "farm-store-user", "STORE_SECRET_KEY": "farm-store-secret",
    "POSTGRES_PASSWORD": "operator-postgres-password",
}


def interpolate(value):
    """Compose's interpolation with every ``${VAR:-default}`` at its default
    and every required ``${VAR:?message}`` from :data:`OPERATOR_ENV` (what a
    run with the operator's .env gets); ``$$`` is a literal ``$``."""
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if not isinstance(value, str):
        return value

    def one(match):
        if match.group("bare") or not match.group("sep"):
            raise AssertionError(f"{match.group(0)} in {value!r}: give it a default (${{VAR:-default}}) "
                                 "or require it (${VAR:?message})")
        if match.group("sep") == ":?":
            assert match.group("braced") in OPERATOR_ENV, f"{match.group(0)}: a required variable the test's .env lacks"
            return OPERATOR_ENV[match.group("braced")]
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
    # The farm's own MinIO user (test_the_farm_uses_a_minio_user_allowed_only_its_bucket), not the root.
    assert (web.object_store_access_key, web.object_store_secret_key) == (
        OPERATOR_ENV["STORE_ACCESS_KEY"], OPERATOR_ENV["STORE_SECRET_KEY"]
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
    that replaced itself (ndif_celery.exit_codes.REPLACE_EXIT_CODE)."""
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


def test_the_web_service_allows_a_file_descriptor_per_waiting_client(compose):
    """Each waiting blocking client holds one websocket, one fd, in the web
    (a crowd of clients waits at once): the container's nofile limit covers a web worker's connections."""
    from ndif_celery import config

    nofile = compose["services"]["web"]["ulimits"]["nofile"]
    assert int(nofile["soft"]) == int(nofile["hard"]) >= config.load({}).web_connections + 1024


# --- secure by default -----------------------------------------------------------------


def test_secrets_have_no_default_values():
    """A farm started without the operator's .env stops at once, naming the
    variable (``${VAR:?message}``), instead of running with a password
    anyone can read here."""
    found = []
    for part in COMPOSE_FILE.read_text().split("$$"):  # $$: a literal $, for the shell
        for match in _VAR.finditer(part):
            name = match.group("braced") or match.group("bare")
            if re.search(r"PASSWORD|SECRET|ACCESS_KEY|ROOT_USER", name):
                found.append(name)
                assert match.group("sep") == ":?", f"{match.group(0)}: a secret is the operator's, not a default"
                assert name in match.group("default"), f"{match.group(0)}: the message names the variable"
    assert {"MINIO_ROOT_PASSWORD", "STORE_SECRET_KEY", "POSTGRES_PASSWORD"} <= set(found), found


def _minio_init_commands(compose) -> list[list[str]]:
    service = services(compose)[by_image(compose, "minio/mc")]
    argv = words(service.get("entrypoint")) + words(service.get("command"))
    return shell_commands(argv[2], environment(service))


def test_the_farm_uses_a_minio_user_allowed_only_its_bucket(compose, image_env, tmp_path):
    """The web and workers hold the farm's own MinIO user, made by minio-init
    with a policy on the results bucket alone: a leaked key reads and writes
    results, not other buckets, users or MinIO's settings."""
    import json

    web = settings_of("web", compose, image_env, tmp_path)
    minio_env = environment(services(compose)[by_image(compose, "minio/minio")])
    assert web.object_store_access_key != minio_env["MINIO_ROOT_USER"], "the farm holds MinIO's root"
    assert web.object_store_secret_key != minio_env["MINIO_ROOT_PASSWORD"], "the farm holds MinIO's root password"

    commands = _minio_init_commands(compose)
    added = [c for c in commands if c[:4] == ["mc", "admin", "user", "add"]]
    assert [c[5:7] for c in added] == [[web.object_store_access_key, web.object_store_secret_key]], added
    attached = [c for c in commands if c[:4] == ["mc", "admin", "policy", "attach"]]
    assert len(attached) == 1 and attached[0][attached[0].index("--user") + 1] == web.object_store_access_key
    policy = attached[0][5]
    (created,) = [c for c in commands if c[:4] == ["mc", "admin", "policy", "create"] and c[5] == policy]
    (written,) = [c for c in commands if c[:1] == ["printf"] and c[-2:] == [">", created[6]]]
    document = json.loads(written[1] % tuple(written[2:-2]))
    bucket = web.object_store_bucket
    for statement in document["Statement"]:
        assert statement["Effect"] == "Allow"
        assert set(statement["Resource"]) <= {f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"}, statement
        assert all(a.startswith("s3:") and "*" not in a for a in statement["Action"]), statement
    allowed = {a for statement in document["Statement"] for a in statement["Action"]}
    assert {"s3:GetObject", "s3:PutObject", "s3:DeleteObject"} <= allowed, allowed
    # minio-init fails (and the farm waits) unless the policy is really attached.
    checked = [c for c in commands if c[:4] == ["mc", "admin", "user", "info"]]
    assert checked and checked[0][5] == web.object_store_access_key


def test_minio_publishes_only_the_s3_api_for_presigned_downloads(compose):
    published = ports_of(services(compose)[by_image(compose, "minio/minio")])
    assert [target for _, _, target in published] == [9000], published  # not the console (9001)
