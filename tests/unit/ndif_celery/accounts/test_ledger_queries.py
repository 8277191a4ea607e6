"""The job ledger's queries, their pure part: ``--since`` spans and ISO times.
The queries against a real database are tests/inprocess/ndif_celery/accounts/test_usage.py.
"""

from __future__ import annotations

import datetime

import pytest

from ndif_celery.accounts import ledger_queries


def test_since_takes_spans_and_iso_times():
    now = datetime.datetime(2026, 1, 2, 12, 0, tzinfo=datetime.timezone.utc)
    assert ledger_queries.parse_since("90m", now) == now - datetime.timedelta(minutes=90)
    assert ledger_queries.parse_since("2d", now) == now - datetime.timedelta(days=2)
    assert ledger_queries.parse_since("2026-01-01T00:00:00+02:00", now).utcoffset() == datetime.timedelta(hours=2)
    assert ledger_queries.parse_since("2026-01-01", now).tzinfo == datetime.timezone.utc
    with pytest.raises(ValueError, match="--since"):
        ledger_queries.parse_since("soon", now)
