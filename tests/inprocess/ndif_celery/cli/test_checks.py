"""``up`` and ``doctor`` against settings ``up`` refuses, run for real: the CLI in a
fresh interpreter, on a bare host (an empty ``NDIF_HOME``, free ports), no stack.

A malformed ``NDIF_ALERT_WEBHOOK_URL`` stops ``up`` before anything starts and
fails ``doctor``, named with what is wrong and never with its path or query; a
bad ``NDIF_DEPLOYMENTS`` fails ``doctor`` as it stops ``up``. The checks
themselves are tests/unit/ndif_celery/test_config.py and
tests/inprocess/ndif_celery/farm/test_deployments.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.stacks.doctor import checks
from tests.support.stacks.servers import free_ports
from tests.support.stacks.stack import ROOT

BAD_URL = "htp://hooks.example.org/services/secret-token?key=also-secret"


def _env(tmp_path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NDIF_") and "proxy" not in k.lower()}
    api, redis_port = free_ports(2)
    env.update(NDIF_HOME=str(tmp_path / "home"), NDIF_API_PORT=str(api), NDIF_EMBEDDED_REDIS_PORT=str(redis_port),
               NDIF_FLOWER_PORT="0", NDIF_WORKER_METRICS_PORT="0")
    env.update(extra)
    return env


def _cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ndif_celery.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)


def test_up_refuses_a_malformed_webhook_url_before_starting_anything(tmp_path):
    result = _cli(_env(tmp_path, NDIF_ALERT_WEBHOOK_URL=BAD_URL), "up", "--detach", "--timeout", "30")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "NDIF_ALERT_WEBHOOK_URL must begin with http:// or https://" in result.stderr
    said = result.stdout + result.stderr
    assert "secret-token" not in said and "also-secret" not in said and "htp:" not in said
    assert not (tmp_path / "home" / "logs").exists(), "nothing was started"


def test_doctor_fails_a_malformed_webhook_url_and_a_bad_deployments_setting(tmp_path):
    env = _env(tmp_path, NDIF_ALERT_WEBHOOK_URL="http:///services/secret-token?key=also-secret",
               NDIF_DEPLOYMENTS="[{repo: org/a, pin: maybe}]")
    result = _cli(env, "doctor")
    assert result.returncode == 1, result.stdout + result.stderr
    found = checks(result.stdout)
    status, detail, fix = found["alert webhook"]
    assert status == "FAIL" and detail.startswith("NDIF_ALERT_WEBHOOK_URL names no host"), found
    assert "NDIF_ALERT_WEBHOOK_URL" in fix
    status, detail, _ = found["deployments"]
    assert status == "FAIL" and "NDIF_DEPLOYMENTS" in detail and "pin" in detail, found
    assert "alert webhook" in result.stderr and "deployments" in result.stderr, "named among the failed checks"
    said = result.stdout + result.stderr
    assert "secret-token" not in said and "also-secret" not in said

    up = _cli(env, "up", "--detach", "--timeout", "30")
    assert up.returncode == 1 and "NDIF_ALERT_WEBHOOK_URL names no host" in up.stderr, up.stderr


def test_doctor_shows_a_good_webhook_by_scheme_and_host_only(tmp_path):
    env = _env(tmp_path, NDIF_ALERT_WEBHOOK_URL="https://hooks.example.org:8443/services/secret-token?key=also",
               NDIF_DEPLOYMENTS="[{repo: org/a, pin: true}]")
    result = _cli(env, "doctor")
    found = checks(result.stdout)
    assert found["alert webhook"][:2] == ("OK", "https://hooks.example.org:8443/..."), found
    assert found["deployments"][0] == "OK", found
    assert "secret-token" not in result.stdout + result.stderr
