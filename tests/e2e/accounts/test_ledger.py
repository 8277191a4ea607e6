"""The job ledger against real stacks and the real client: ended jobs land in
the database (through Redis, written by the ledger's drainer) and
``ndif-celery jobs`` lists them with their outcome, timings and sizes; a
database outage leaves them waiting in Redis, and they land once it is back. The pure parts are tests/unit/ndif_celery/accounts/test_ledger.py."""

from __future__ import annotations

import datetime
import json
import time

import pytest
import redis

from ndif_celery.accounts import ledger
from tests.support.clients.remote import final_status
from tests.support.stacks.stack import client_on_stack
from tests.support.cases.tiny_model import PROMPT, REPO_ID


def _ok_job(model) -> dict:
    """A blocking job that completes; its meta (job id, timings, sizes).

    Returns once its final status is stored: an inline result reaches the
    client just before the worker records the end (and queues the summary)."""
    import nnsight

    with model.trace(PROMPT, remote=True) as tracer:
        model.transformer.h[0].output.save()
    meta = tracer.backend.meta
    assert final_status(nnsight.CONFIG.API.HOST, meta["job_id"])["status"] == "COMPLETED"
    return meta


def _error_job(url: str, model) -> str:
    """A non-blocking job whose code fails on the worker; its id once it ended."""
    with model.trace(PROMPT, remote=True, blocking=False) as tracer:
        hidden = model.transformer.h[0].output  # noqa: F841
        missing = {}["no-such-key"]  # the user's bug  # noqa: F841
    job_id = tracer.backend.job_id
    assert final_status(url, job_id)["status"] == "ERROR"
    return job_id


def _jobs(stack, *args) -> list[dict]:
    result = stack.cli("jobs", "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _wait_drained(client: redis.Redis, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.llen(ledger.PENDING):
        assert time.monotonic() < deadline, f"{client.llen(ledger.PENDING)} ledger entries still waiting in Redis"
        time.sleep(0.1)


def test_ended_jobs_are_listed_with_outcome_timings_and_bytes(on_fs_stack, model):
    stack = on_fs_stack
    meta = _ok_job(model)
    error_id = _error_job(stack.url, model)
    ok_id = meta["job_id"]
    _wait_drained(redis.Redis.from_url(stack.redis_url))  # the drainer wrote them

    rows = {row["job_id"]: row for row in _jobs(stack, "--limit", "500")}
    ok, failed = rows[ok_id], rows[error_id]
    assert ok["outcome"] == "COMPLETED" and ok["error_kind"] is None and ok["error"] is None
    assert ok["model"] == REPO_ID and REPO_ID in ok["model_key"]
    assert ok["owner"] == "anonymous" and ok["email"] is None
    assert ok["worker"] == meta["worker"] and ok["isolated"] is False and ok["attempt"] == 1
    for key in ("queue_ms", "deserialize_ms", "run_ms", "payload_bytes", "result_bytes"):
        assert ok[key] == meta[key], (key, ok[key], meta[key])
    assert ok["upload_ms"] is None and meta["inline"] is True
    received, started, finished = (datetime.datetime.fromisoformat(ok[k]) for k in
                                   ("received_at", "started_at", "finished_at"))
    assert received <= started <= finished
    assert ok["duration_s"] == pytest.approx((finished - received).total_seconds(), abs=0.002)
    assert ok["duration_s"] * 1000 >= ok["run_ms"] > 0

    assert failed["outcome"] == "ERROR" and failed["error_kind"] == "user"
    assert failed["error"] == "KeyError: 'no-such-key'", failed["error"]
    assert failed["queue_ms"] is not None and failed["deserialize_ms"] is not None
    assert failed["result_bytes"] is None and failed["payload_bytes"] > 0

    # Filters: newest first, by user, by time, by count.
    newest = _jobs(stack, "--limit", "1")
    assert [row["job_id"] for row in newest] == [error_id]
    assert {ok_id, error_id} <= {row["job_id"] for row in _jobs(stack, "--user", "anonymous", "--since", "10m")}
    assert _jobs(stack, "--user", "nobody@example.org") == []
    later = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=5)).isoformat()
    assert _jobs(stack, "--since", later) == []
    text = stack.cli("jobs", "--limit", "5")
    assert text.returncode == 0 and ok_id in text.stdout and error_id in text.stdout
    assert "KeyError: 'no-such-key'" in text.stdout
    bad = stack.cli("jobs", "--since", "yesterday")
    assert bad.returncode != 0 and "--since" in bad.stderr


def test_a_job_is_written_once_and_a_malformed_entry_does_not_block(on_fs_stack, model):
    stack = on_fs_stack
    client = redis.Redis.from_url(stack.redis_url)
    ok_id = _ok_job(model)["job_id"]
    _wait_drained(client)
    # The same job offered again (say, a duplicated final status), and garbage.
    again = {"job_id": ok_id, "owner": "anonymous", "model_key": "x:y", "outcome": "ERROR", "finished_at": time.time()}
    client.rpush(ledger.PENDING, b"not json", json.dumps(again))
    _wait_drained(client)
    rows = [row for row in _jobs(stack, "--limit", "500") if row["job_id"] == ok_id]
    assert len(rows) == 1 and rows[0]["outcome"] == "COMPLETED", rows
    assert _ok_job(model)["job_id"] in {row["job_id"] for row in _jobs(stack, "--limit", "5")}


def test_a_database_outage_keeps_ended_jobs_in_redis_until_it_is_back(tmp_path_factory, hf_home, model):
    """PostgreSQL behind a proxy the test cuts: jobs keep running and ending
    while it is down, their summaries wait in Redis (nothing lost, one warning
    in the worker's log), and they land once it is back, without a restart."""
    from sqlalchemy import create_engine, text

    from tests.support.stacks.servers import TcpProxy, postgres_database

    url, drop = postgres_database()
    proxy = TcpProxy("127.0.0.1", 5432).start()
    proxied = url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    direct = create_engine(url)

    def in_database(*job_ids) -> set:
        with direct.connect() as conn:
            rows = conn.execute(text("SELECT job_id FROM job_ledger WHERE job_id = ANY(:ids)"), {"ids": list(job_ids)})
            return {row[0] for row in rows}

    try:
        env = {"NDIF_DATABASE_URL": proxied}
        with client_on_stack(tmp_path_factory.mktemp("ledger-outage"), hf_home, env) as stack:
            client = redis.Redis.from_url(stack.redis_url)
            first = _ok_job(model)["job_id"]
            _wait_drained(client)
            assert in_database(first) == {first}

            proxy.stop()
            during_ok = _ok_job(model)["job_id"]  # jobs still run and end
            during_error = _error_job(stack.url, model)
            time.sleep(4)  # several drainer passes and retries
            assert client.llen(ledger.PENDING) == 2
            waiting = {json.loads(raw)["job_id"] for raw in client.lrange(ledger.PENDING, 0, -1)}
            assert waiting == {during_ok, during_error}
            down = stack.cli("jobs", "--json")
            assert down.returncode != 0 and "cannot be reached" in down.stderr, down
            assert client.llen(ledger.PENDING) == 2, "a failed CLI drain must leave the entries"
            log = (stack.logs_dir / "worker.log").read_text()
            assert log.count("ledger: the database cannot be reached") == 1, "warn once per outage"

            proxy.start()
            _wait_drained(client, timeout_s=30)
            assert in_database(during_ok, during_error) == {during_ok, during_error}
            rows = {row["job_id"]: row for row in _jobs(stack, "--limit", "10")}
            assert rows[during_ok]["outcome"] == "COMPLETED"
            assert rows[during_error]["outcome"] == "ERROR" and rows[during_error]["error_kind"] == "user"
            assert "ledger: the database is back" in (stack.logs_dir / "worker.log").read_text()
    finally:
        proxy.stop()
        direct.dispose()
        drop()
