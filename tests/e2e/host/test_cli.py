"""The ``ndif-celery`` CLI, run for real: subprocesses, a temporary NDIF_HOME,
free loopback ports, the real embedded Redis, gunicorn web, Celery worker and
Flower. Nothing here needs a Redis, PostgreSQL or RabbitMQ of the machine.
One detached stack serves `up`, `status`, `doctor` (healthy, then with its
Redis frozen), `logs` and, last, `down`. The pieces that need no stack are
tests/inprocess/ndif_celery/cli/test_cli.py and tests/inprocess/ndif_celery/host/test_doctor.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import redis

from ndif_celery.state import registry
from tests.support import pace
from tests.support.stacks.doctor import checks
from tests.support.stacks.servers import port_open
from tests.support.stacks.stack import ROOT, Stack
from tests.support.waiting import wait_until

SERVICES = ("redis", "web", "worker", "beat", "flower")


def running(pid: int) -> bool:
    """Whether a process runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2] not in "ZX"


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group (gunicorn's workers share the master's)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if fields[2] == str(pgid) and fields[0] not in "ZX":
                members.append(int(entry.name))
    return members


def assert_all_gone(stack: Stack, pids: dict[str, int]) -> None:
    for service, pid in pids.items():
        assert not running(pid), f"{service} (pid {pid}) still runs"
        assert not group_members(pid), f"{service}'s process group {pid} still has {group_members(pid)}"
    for port in (stack.api_port, stack.redis_port, stack.flower_port):
        assert not port_open(port), f"port {port} still accepts connections"
    assert not (stack.home / "run" / "stack.json").exists()


# -- one detached stack, shared by the tests below in order (the last stops it) --


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("cli") / "home", full=True)
    stack.start()
    yield stack
    stack.discard()


def test_up_detach_answers_ping(stack):
    response = httpx.get(f"{stack.url}/ping", timeout=10)
    assert response.status_code == 200, response.text


def test_a_worker_registered_before_up_returned(stack):
    client = redis.Redis.from_url(stack.redis_url)
    try:
        assert client.hlen(registry.WORKERS) >= 1
    finally:
        client.close()


def test_status_lists_every_service_running(stack):
    result = stack.cli("status")
    assert result.returncode == 0, result.stderr
    pids = stack.pids()
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    for service in SERVICES:
        assert service in lines, result.stdout
        assert str(pids[service]) in lines[service] and "running" in lines[service], result.stdout
    assert "answers" in lines["api"] and "not answering" not in lines["api"], result.stdout


def test_flower_answers_http(stack):
    assert httpx.get(f"{stack.flower_url}/healthcheck", timeout=10).status_code == 200
    assert httpx.get(f"{stack.flower_url}/", timeout=30).status_code == 200


def test_up_twice_refuses_and_leaves_the_stack_alone(stack):
    before = stack.pids()
    result = stack.cli("up", "--detach")
    assert result.returncode != 0
    assert "already running; run `ndif-celery down`" in result.stderr
    assert stack.pids() == before
    assert all(running(pid) for pid in before.values())
    assert httpx.get(f"{stack.url}/ping", timeout=10).status_code == 200


# `doctor` and `logs` on the same running stack (their cases without one:
# tests/inprocess/ndif_celery/host/test_doctor.py).


def test_doctor_passes_on_a_healthy_stack(stack):
    result = stack.cli("doctor")
    assert result.returncode == 0, result.stdout + result.stderr + stack.logs()
    found = checks(result.stdout)
    assert not [name for name, (status, _, _) in found.items() if status == "FAIL"], result.stdout
    assert found["redis"][0] == "OK" and "answers PING" in found["redis"][1], result.stdout
    assert found["api port"][0] == "OK" and "answered by this stack's web" in found["api port"][1], result.stdout
    assert found["redis port"][0] == "OK" and "this stack's Redis" in found["redis port"][1], result.stdout
    assert found["flower port"][0] == "OK" and "this stack's Flower" in found["flower port"][1], result.stdout
    assert found["object store"][0] == "OK" and found["NDIF_HOME"][0] == "OK"
    assert found["HF cache"][0] == "OK" and "HF_HUB_OFFLINE set" in found["HF cache"][1], result.stdout


def test_doctor_fails_when_the_stacks_redis_is_gone(stack):
    # The stack's record says Redis runs, but it no longer answers: a FAIL that
    # points at its log. (Frozen with SIGSTOP, thawed right after.)
    pids = stack.pids()
    os.kill(pids["redis"], signal.SIGSTOP)
    try:
        result = stack.cli("doctor")
    finally:
        os.kill(pids["redis"], signal.SIGCONT)
    assert result.returncode == 1, result.stdout
    status, detail, fix = checks(result.stdout)["redis"]
    assert status == "FAIL" and "embedded Redis" in detail and "ndif-celery logs redis" in fix, result.stdout


def test_logs_prints_the_tail(stack):
    path = stack.logs_dir / "web.log"
    result = stack.cli("logs", "web", "-n", "5")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert 1 <= len(lines) <= 5
    text = path.read_text(errors="replace").splitlines()
    # Contiguous lines of the log, ending at (or just before, if the web wrote meanwhile) its end.
    # Searched from the end: the health checks' /ping lines repeat word for word within a second.
    found = [start for start in range(len(text) - len(lines), -1, -1) if text[start:start + len(lines)] == lines]
    assert found, (lines, text[-10:])
    whole = stack.cli("logs", "web", "-n", "100000")
    assert whole.returncode == 0 and whole.stdout.startswith("==== "), whole.stdout[:200]
    assert "ndif-celery starts web" in whole.stdout.splitlines()[0]
    for service in SERVICES:
        assert stack.cli("logs", service, "-n", "1").returncode == 0, service


def test_logs_of_an_unknown_service_lists_what_exists(stack):
    result = stack.cli("logs", "nosuch")
    assert result.returncode != 0
    assert "unknown service 'nosuch'" in result.stderr
    assert "redis, web, worker, beat, flower" in result.stderr
    for service in SERVICES:
        assert service in result.stderr.split("logs in", 1)[1], result.stderr


def test_logs_follow_prints_what_is_appended_until_interrupted(stack, tmp_path):
    path = stack.logs_dir / "beat.log"
    out = tmp_path / "follow.out"
    with open(out, "wb") as sink:
        # Ctrl-C's SIGINT as at a terminal: a test run started in the background
        # (`make test &`, a CI runner) hands its children SIGINT ignored, and
        # Python then never raises KeyboardInterrupt.
        proc = subprocess.Popen([sys.executable, "-m", "ndif_celery.cli", "logs", "beat", "-n", "0", "-f"],
                                cwd=ROOT, env=stack.env, stdout=sink, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # -n 0 prints nothing of the past: whatever shows up was followed.
        deadline = time.monotonic() + 30
        written = 0
        while "follow-marker" not in out.read_text():
            assert proc.poll() is None, out.read_text()
            assert time.monotonic() < deadline, "nothing followed within 30 s"
            with open(path, "a") as log:
                log.write(f"follow-marker {written}\n")
            written += 1
            time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0, out.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    markers = [int(m) for m in re.findall(r"follow-marker (\d+)", out.read_text())]
    assert markers and markers == sorted(markers) and markers == list(range(markers[0], markers[-1] + 1))
    assert "Traceback" not in out.read_text() and "Aborted" not in out.read_text()


def test_down_stops_every_service_and_the_supervisor(stack):
    pids = stack.pids()
    assert set(pids) == set(SERVICES)
    keeper = json.loads((stack.home / "run" / "supervisor.json").read_text())["pid"]
    assert running(keeper)
    result = stack.stop()
    assert result.returncode == 0, result.stderr
    assert "supervisor: stopped" in result.stdout, result.stdout
    assert not running(keeper), "`down` left the detached `up` (the supervisor) running"
    for service in SERVICES:
        assert f"{service}: stopped" in result.stdout, result.stdout
    assert_all_gone(stack, pids)

    status = stack.cli("status")
    assert status.returncode == 0
    for service in SERVICES:
        assert any(line.startswith(service) and "stopped" in line for line in status.stdout.splitlines())
    assert "not answering" in status.stdout
    again = stack.cli("down")
    assert again.returncode == 0 and "not running" in again.stdout


# -- the foreground `up` --


@contextlib.contextmanager
def _foreground_up(tmp_path: Path) -> Iterator[tuple[Stack, subprocess.Popen, Path]]:
    """A stack under a foreground `up` (its output in ``up.out``), ready;
    afterwards `up` and everything of the stack killed, however the test ended."""
    stack = Stack(tmp_path / "home", full=True)
    out = tmp_path / "up.out"
    with open(out, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "ndif_celery.cli", "up"], cwd=ROOT, env=stack.env,
                                stdout=f, stderr=subprocess.STDOUT)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"`up` exited {proc.returncode}:\n{out.read_text()}\n{stack.logs()}")
        return "is up at" in out.read_text()

    try:
        wait_until(ready, 180, "`ndif-celery up` to report ready")
        yield stack, proc, out
    finally:
        if proc.poll() is None:
            proc.kill()
        stack.discard()


def test_foreground_up_restarts_a_service_that_dies_and_stops_everything_on_sigterm(tmp_path):
    """The foreground `up` is the supervisor (ndif_celery.host.supervisor): a worker
    killed is started again and said so; SIGTERM (as Ctrl-C) stops every service.
    `down` from elsewhere ending a supervisor: test_down_stops_every_service_and_the_supervisor."""
    with _foreground_up(tmp_path) as (stack, proc, out):
        pids = stack.pids()
        assert set(pids) == set(SERVICES)
        assert httpx.get(f"{stack.url}/ping", timeout=10).status_code == 200
        os.kill(pids["worker"], signal.SIGKILL)
        wait_until(lambda: stack.pids().get("worker") not in (None, pids["worker"]), 30, "the worker restarted")
        # The supervisor records the new pid before it says so: wait for its line too.
        wait_until(lambda: "worker restarted" in out.read_text(), 30, "the supervisor to report the restart")
        text = out.read_text()
        assert "worker (pid" in text and "killed by SIGKILL" in text and "worker restarted" in text, text
        assert proc.poll() is None, text
        new = stack.pids()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, out.read_text()
        assert "stopped" in out.read_text().splitlines()[-1], out.read_text()
        assert_all_gone(stack, {**pids, **{f"new-{k}": v for k, v in new.items()}})


def test_a_service_dying_while_starting_fails_fast_with_its_log(tmp_path):
    # gunicorn reads extra arguments from GUNICORN_CMD_ARGS; a bad one makes
    # only the web exit, right away.
    stack = Stack(tmp_path / "home", env={"GUNICORN_CMD_ARGS": "--no-such-option"}, full=True)
    started = time.monotonic()
    result = stack.cli("up", "--detach", "--timeout", "120")
    assert result.returncode != 0
    assert time.monotonic() - started < min(pace.bound(60), 110), "waited for the timeout instead of failing fast"
    assert "web" in result.stderr and "exited while starting" in result.stderr, result.stderr
    assert "no-such-option" in result.stderr, "the tail of web.log is missing:\n" + result.stderr
    assert not (stack.home / "run" / "stack.json").exists()
    for port in (stack.redis_port, stack.flower_port):
        assert not port_open(port)


def test_not_ready_in_time_stops_what_it_started(tmp_path):
    stack = Stack(tmp_path / "home", full=True)
    result = stack.cli("up", "--detach", "--timeout", "0.5")
    assert result.returncode != 0
    assert "not ready within" in result.stderr and "still waiting for" in result.stderr, result.stderr
    assert not (stack.home / "run" / "stack.json").exists()
    for port in (stack.api_port, stack.redis_port, stack.flower_port):
        assert not port_open(port)


# -- failures that start nothing --


def test_taken_api_port_is_named_with_its_variable(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        stack = Stack(tmp_path / "home", env={"NDIF_API_PORT": str(port)}, full=True)
        result = stack.cli("up", "--detach")
    assert result.returncode != 0
    assert str(port) in result.stderr and "NDIF_API_PORT" in result.stderr, result.stderr
    assert not (stack.home / "run" / "stack.json").exists()
    assert not port_open(stack.redis_port), "started Redis although the web could never listen"


def test_down_and_status_when_nothing_runs(tmp_path):
    stack = Stack(tmp_path / "home", full=True)
    down = stack.cli("down")
    assert down.returncode == 0 and "not running" in down.stdout

    # A state file left by a stack that died with its host: stale, not "running".
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
    state = stack.home / "run" / "stack.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"web": {"pid": int(finished.stdout), "command": ["x"], "started_at": "x"}}))
    status = stack.cli("status")
    assert status.returncode == 0
    assert "stopped" in status.stdout and "running" not in status.stdout, status.stdout
    assert "not answering" in status.stdout
    assert stack.cli("down").returncode == 0
    assert not state.exists()
