"""The backoff rules of ``ndif-celery up``'s supervisor: a service that keeps
dying is restarted after 1 s, 2 s, 4 s ... up to its cap, back to 1 s once it
stayed up; a worker that replaced itself is restarted at once. The supervisor
against real killed services is tests/e2e/host/test_supervision.py.
"""

from __future__ import annotations

import signal
import time

from ndif_celery import config
from ndif_celery.host import supervisor


def _keeper(tmp_path) -> supervisor.Supervisor:
    settings = config.load({"NDIF_HOME": str(tmp_path)})
    (tmp_path / "logs").mkdir()
    entry = {"pid": 0, "started_at": "2020-01-01T00:00:00+00:00"}
    keeper = supervisor.Supervisor(settings, {"worker": dict(entry)}, lambda line: None)
    keeper.state["worker"]["started_at"] = _now_iso()
    return keeper


def _now_iso() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def test_backoff_doubles_to_its_cap_and_a_replacement_is_at_once(tmp_path):
    keeper = _keeper(tmp_path)
    delays = []
    for _ in range(7):
        before = time.monotonic()
        keeper.died("worker", -signal.SIGKILL)
        delays.append(round(keeper.services["worker"]["restart_at"] - before))
    assert delays == [1, 2, 4, 8, 16, 30, 30]
    assert keeper.services["worker"]["last_exit"]["signal"] == "SIGKILL"
    before = time.monotonic()
    keeper.died("worker", supervisor.REPLACE_EXIT_CODE)
    assert keeper.services["worker"]["restart_at"] - before < 0.1
    assert keeper.services["worker"]["last_exit"]["reason"].startswith("replaced itself")
    assert "replaced itself" in (tmp_path / "logs" / "worker.log").read_text()
    record = supervisor.read(keeper.settings)
    assert record["alive"] and record["services"]["worker"]["last_exit"]["code"] == supervisor.REPLACE_EXIT_CODE


def test_a_service_that_stayed_up_starts_its_backoff_over(tmp_path):
    keeper = _keeper(tmp_path)
    for _ in range(4):
        keeper.died("worker", 1)
    keeper.state["worker"]["started_at"] = "2020-01-01T00:00:00+00:00"  # it ran for years
    before = time.monotonic()
    keeper.died("worker", 1)
    assert round(keeper.services["worker"]["restart_at"] - before) == 1
    assert supervisor.exit_reason(1) == "exited with status 1"
    assert supervisor.exit_reason(-15) == "killed by SIGTERM"
