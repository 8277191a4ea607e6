"""``ndif-celery doctor`` and ``logs`` against a real stack, run for real as
subprocesses: doctor passes on a healthy stack and fails while its Redis is
stopped; ``logs`` prints a service's tail, names the services there are, and
follows what is appended. No mocks. ``version`` and the cases without a stack
are tests/inprocess/test_doctor.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.support.doctor import checks
from tests.support.stack import ROOT, Stack

SERVICES = ("redis", "web", "worker", "beat", "flower")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("doctor") / "home", full=True)
    try:
        stack.start()
        yield stack
    finally:
        stack.discard()


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
