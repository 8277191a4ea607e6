"""Usage from the job ledger (``ndif_celery.accounts.usage``) in the fast tier: ended jobs
drained from a real embedded Redis into a real SQLite ledger, each with the
GPUs of the worker that ran it; the per-key and per-model report; the
bounded per-key series in ``/metrics``; an older ledger database gaining the
``devices`` and ``probe`` columns; the health probes' jobs kept apart. Usage
of jobs a real farm ran is tests/e2e/farm/test_operations.py.
"""

from __future__ import annotations

import sqlite3
import time

import pytest

from ndif_celery.accounts import db, ledger, ledger_queries, usage
from ndif_celery.monitoring import metrics, probes
from ndif_celery.state import registry

#: The ledger's table as the first release made it: the columns added since are each test's to add.
OLD_LEDGER = ("CREATE TABLE job_ledger (job_id VARCHAR(64) PRIMARY KEY, owner VARCHAR(64), "
              "email VARCHAR(320), model VARCHAR(300), model_key TEXT, outcome VARCHAR(16), "
              "error_kind VARCHAR(32), error VARCHAR(500), worker VARCHAR(200), isolated BOOLEAN, "
              "attempt INTEGER, received_at DATETIME, started_at DATETIME, finished_at DATETIME, "
              "queue_ms FLOAT, deserialize_ms FLOAT, run_ms FLOAT, upload_ms FLOAT, "
              "payload_bytes BIGINT, result_bytes BIGINT")


def _summary(job_id: str, owner: str, worker: str, run_ms: float, outcome: str = "COMPLETED",
             model: str = "org/a", payload: int = 100, result: int = 1000) -> dict:
    return {
        "job_id": job_id, "owner": owner, "outcome": outcome, "worker": worker, "run_ms": run_ms,
        "model_key": f'nnsight.modeling.transformers.TransformersModel:{{"repo_id": "{model}", "revision": null, '
                     '"task": "text-generation"}',
        "error_kind": "user" if outcome == "ERROR" else None, "received_at": time.time() - 1,
        "finished_at": time.time(), "payload_bytes": payload, "result_bytes": result if outcome != "ERROR" else None,
    }


@pytest.fixture
def engine(tmp_path):
    return db.engine_for(f"sqlite:///{tmp_path / 'ledger.db'}")


def _drain(client, engine, *summaries) -> None:
    pipe = client.pipeline()
    for entry in summaries:
        ledger.push(pipe, entry)
    pipe.execute()
    assert ledger.drain(client, engine) == len(summaries)


def test_the_report_counts_jobs_errors_gpu_seconds_and_bytes_per_key_and_model(redis_client, engine):
    registry.register_worker(redis_client, {"name": "two-gpus", "pid": 1, "gpus": ["0", "1"]})
    registry.register_worker(redis_client, {"name": "cpu", "pid": 2, "gpus": []})
    _drain(redis_client, engine,
           _summary("j1", "key:1", "two-gpus", 1500.0),
           _summary("j2", "key:1", "two-gpus", 500.0, outcome="ERROR", model="org/b"),
           _summary("j3", "key:2", "cpu", 4000.0, payload=7, result=9))
    report = usage.report(engine)
    keys = {row["owner"]: row for row in report["keys"]}
    assert keys["key:1"] == {"owner": "key:1", "email": None, "jobs": 2, "errors": 1, "gpu_seconds": 4.0,
                             "run_seconds": 2.0, "bytes_in": 200, "bytes_out": 1000}
    assert keys["key:2"]["gpu_seconds"] == 0.0 and keys["key:2"]["run_seconds"] == 4.0, "a CPU worker has no GPUs"
    models = {row["model"]: row for row in report["models"]}
    assert models["org/a"]["jobs"] == 2 and models["org/b"]["errors"] == 1
    assert report["total"] == {"jobs": 3, "errors": 1, "gpu_seconds": 4.0, "run_seconds": 6.0,
                               "bytes_in": 207, "bytes_out": 1009}
    assert usage.report(engine, owner="key:2")["total"]["jobs"] == 1
    assert [r["devices"] for r in ledger_queries.recent(engine, limit=10) if r["job_id"] == "j1"] == [2]


def test_the_series_keep_the_top_keys_and_sum_the_rest_as_other(redis_client, engine):
    registry.register_worker(redis_client, {"name": "gpu", "pid": 1, "gpus": ["0"]})
    _drain(redis_client, engine, *[_summary(f"j{i}", f"key:{i}", "gpu", 1000.0 * i) for i in range(1, 5)])
    shown = usage.series(redis_client, top_n=2)
    assert list(shown) == ["key:4", "key:3", "other"]
    assert shown["other"]["gpu_seconds"] == 3.0 and shown["other"]["jobs"] == 2
    text = metrics.render(redis_client, top_keys=2).decode()
    assert 'ndif_usage_gpu_seconds_total{key="key:4"} 4.0' in text
    assert 'ndif_usage_jobs_total{key="other"} 2.0' in text
    assert 'key="key:1"' not in text, "cardinality is bounded: key:1 is in other"
    # To a reader who may not see keys (anonymous, with auth on): the farm's series, no key's.
    hidden = metrics.render(redis_client, top_keys=2, per_key=False).decode()
    assert "ndif_usage_" not in hidden and "key:" not in hidden, hidden
    assert "ndif_jobs_total" in hidden or "# TYPE ndif_jobs counter" in hidden


def test_an_older_ledger_database_gains_the_devices_column(tmp_path):
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as old:
        old.execute(OLD_LEDGER + ")")
    engine = db.engine_for(f"sqlite:///{path}")
    db.engine_for(f"sqlite:///{path}")  # a second process finds it there
    with sqlite3.connect(path) as upgraded:
        columns = [row[1] for row in upgraded.execute("PRAGMA table_info(job_ledger)")]
    assert "devices" in columns
    assert usage.report(engine)["total"]["jobs"] == 0


def _ids(rows) -> list[str]:
    return sorted(row["job_id"] for row in rows)


def test_the_probes_jobs_are_marked_and_left_out_unless_asked(redis_client, engine):
    """The web records the probe key's owner (``probes.OWNER``); the drain marks that
    owner's rows ``probe``, and the readers leave them out unless asked."""
    assert ledger.PROBE_OWNER == probes.OWNER
    redis_client.set(probes.OWNER, "key:9")
    registry.register_worker(redis_client, {"name": "gpu", "pid": 1, "gpus": ["0"]})
    pipe = redis_client.pipeline()
    for entry in (_summary("user1", "key:1", "gpu", 1000.0), _summary("probe1", "key:9", "gpu", 10.0),
                  _summary("probe2", "key:9", "gpu", 10.0)):
        ledger.push(pipe, entry)
    pipe.execute()
    # Still waiting in Redis (the dashboard's first rows).
    assert _ids(ledger_queries.waiting(redis_client)) == ["user1"]
    assert _ids(ledger_queries.waiting(redis_client, probes=True)) == ["probe1", "probe2", "user1"]

    assert ledger.drain(redis_client, engine) == 3
    assert _ids(ledger_queries.recent(engine)) == ["user1"]
    both = ledger_queries.recent(engine, probes=True)
    assert {row["job_id"]: row["probe"] for row in both} == {"user1": False, "probe1": True, "probe2": True}
    assert ledger_queries.recent(engine, user="key:9") == [], "asked by owner, still only with probes"
    report = usage.report(engine)
    assert report["total"]["jobs"] == 1 and [row["owner"] for row in report["keys"]] == ["key:1"]
    assert usage.report(engine, probes=True)["total"]["jobs"] == 3
    # /metrics counts every key's jobs, the probe's too.
    assert usage.series(redis_client, top_n=5)["key:9"]["jobs"] == 2


def test_an_older_ledger_database_gains_the_probe_column_and_its_probe_rows_are_marked(redis_client, tmp_path):
    """A database written before the ``probe`` column: its rows are NULL there and shown,
    until the drainer, knowing the probe's owner, marks them once."""
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as old:
        old.execute(OLD_LEDGER + ", devices INTEGER)")
        for job_id, owner in (("olduser", "key:1"), ("oldprobe", "key:9")):
            old.execute("INSERT INTO job_ledger (job_id, owner, model, model_key, outcome, attempt, finished_at) "
                        "VALUES (?, ?, 'org/a', 'k', 'COMPLETED', 1, '2026-01-01 00:00:00.000000')", (job_id, owner))
    url = f"sqlite:///{path}"
    engine = db.engine_for(url)
    assert _ids(ledger_queries.recent(engine)) == ["oldprobe", "olduser"], "not marked yet: shown"

    redis_client.set(probes.OWNER, "key:9")
    pipe = redis_client.pipeline()
    ledger.push(pipe, _summary("new", "key:1", "gpu", 5.0))
    pipe.execute()
    drainer = ledger.Drainer("w0", redis_client, url)
    assert drainer.tick() == 1
    assert _ids(ledger_queries.recent(engine)) == ["new", "olduser"]
    assert _ids(ledger_queries.recent(engine, probes=True)) == ["new", "oldprobe", "olduser"]
    assert usage.report(engine)["total"]["jobs"] == 2
