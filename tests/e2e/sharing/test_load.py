"""The short load test: 50 real clients at once against one stack, each with
its own prompts; nothing lost, duplicated or mixed up. (``bench/load.py`` runs
the long one: 50 clients x 20 requests.)"""

from __future__ import annotations

from tests.support.clients.load import run_load


def test_fifty_concurrent_clients_each_get_their_own_answers(on_fs_stack, model):
    report = run_load(model, clients=50, requests_each=2)
    print(report.summary())
    assert report.failed == [], report.failed[:5]
    assert report.wrong == [], report.wrong[:5]
    assert len(report.latencies_s) == report.expected
    assert None not in report.job_ids and report.duplicated == 0
