"""A job's one final status (``workers.job.channel.FinalChannel``) against a real embedded Redis.

Its two authors in the worker (the job's thread, the deadline's watchdog):
the first sends, the other's is dropped; an author in another process that
claimed first in Redis wins over both. The watchdog driving it is
tests/inprocess/workers/job/test_deadline.py.
"""

from __future__ import annotations

import json
import time

from ndif_celery import statuses, wire
from ndif_celery.state import jobs
from workers.job.channel import DEADLINE, ELSEWHERE, JOB, FinalChannel


def _channel(client) -> FinalChannel:
    job = jobs.Job(id=f"job-{time.time_ns()}", model_key="test-model")
    return FinalChannel(client, job, 60)


def _latest(client, channel: FinalChannel) -> dict:
    return json.loads(client.get(jobs.status_key(channel.job.id)))


def test_the_jobs_own_answer_first_drops_the_watchdogs(redis_client):
    channel = _channel(redis_client)
    channel.send(wire.RUNNING, "running")  # not final: claims nothing
    assert channel.answered_by is None
    channel.send(wire.COMPLETED, "done")
    assert channel.answered_by == JOB
    assert channel.answer(wire.ERROR, "too late", None, "timeout") is False
    assert _latest(redis_client, channel)["status"] == wire.COMPLETED


def test_the_watchdogs_answer_first_drops_the_jobs_late_result(redis_client):
    channel = _channel(redis_client)
    assert channel.answer(wire.ERROR, "past its deadline", None, "timeout") is True
    assert channel.answered_by == DEADLINE
    channel.send(wire.COMPLETED, "done late")
    assert channel.send_binary(b"frame", wire.response_json(channel.job.id, wire.COMPLETED, "")) is True
    latest = _latest(redis_client, channel)
    assert (latest["status"], latest["description"]) == (wire.ERROR, "past its deadline")


def test_an_author_in_another_process_that_claimed_first_wins(redis_client):
    channel = _channel(redis_client)
    # The beat's watchdog or `ndif-celery kill` (statuses.answer_for_worker) claims with a token of its own.
    assert statuses.StatusChannel(redis_client, channel.job, 60).claim_final("kill@elsewhere")
    channel.send(wire.COMPLETED, "done")
    assert channel.answer(wire.ERROR, "past its deadline", None, "timeout") is False
    assert channel.answered_by == ELSEWHERE
    assert redis_client.get(jobs.status_key(channel.job.id)) is None, "neither author sent anything"
