"""``deploy/systemd/`` checked against the code it runs, offline: each unit's
command parsed by the real CLI under the farm's target, ``env.example`` a
multi-host configuration, and ``systemd-analyze verify`` over the units.
Shared helpers: ``tests/deploy_recipes``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from ndif_celery.host.services import SERVICES
from tests.support.stacks.deploy_recipes import ENV_EXAMPLE, INSTALLED_CLI, SYSTEMD, TARGET, VENV_BIN, load_settings, parse_cli


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
    # itself (ndif_celery.exit_codes.REPLACE_EXIT_CODE) or exited 0 included.
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


def test_the_web_unit_allows_a_file_descriptor_per_waiting_client():
    """Each waiting blocking client holds one websocket, one fd, in the web
    (a crowd of clients waits at once): the unit's hard limit covers a web worker's connections."""
    from ndif_celery import config

    limit = int(one(unit(SYSTEMD / "ndif-celery-web.service"), "Service", "LimitNOFILE"))
    assert limit >= config.load({}).web_connections + 1024
