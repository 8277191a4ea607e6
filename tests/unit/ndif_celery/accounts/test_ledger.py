"""The job ledger's pure parts: the error line of a traceback, and pruning
past the retention. ``--since`` is tests/unit/ndif_celery/accounts/test_ledger_queries.py;
the ledger against real stacks and the real client is tests/e2e/accounts/test_ledger.py.
"""

from __future__ import annotations

import time

from ndif_celery.accounts import ledger, ledger_queries


def test_the_error_line_is_the_exception_of_a_traceback():
    assert ledger.first_line("Traceback (most recent call last):\n  File \"x\", line 1\nKeyError: 'k'\n") == "KeyError: 'k'"
    assert ledger.first_line("Could not deploy x: no room.\nmore") == "Could not deploy x: no room."
    assert ledger.first_line("") == ""
    assert len(ledger.first_line("x" * 2000)) == ledger.ERROR_CHARS


def test_rows_past_their_retention_are_pruned(tmp_path):
    """NDIF_LEDGER_RETENTION_DAYS: the beat's cleanup deletes older rows only."""
    from ndif_celery.accounts import db
    from ndif_celery.state.jobs import Job

    engine = db.engine_for(f"sqlite:///{tmp_path / 'ledger.db'}")
    now = time.time()
    for job_id, age_days in (("a" * 32, 100), ("b" * 32, 10)):
        job = Job(id=job_id, model_key='x:{"repo_id": "r"}', received_at=now - age_days * 86400)
        ledger._insert(engine, [ledger.summary(job, "COMPLETED", "done", {}, now=now - age_days * 86400)])
    assert ledger.prune(engine, 0) == 0  # 0 keeps everything
    assert ledger.prune(engine, 90) == 1
    assert [row["job_id"] for row in ledger_queries.recent(engine)] == ["b" * 32]
    assert ledger.prune(engine, 90) == 0
