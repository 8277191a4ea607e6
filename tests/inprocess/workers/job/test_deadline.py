"""The deadline watchdog in-process (fast tier, a real embedded Redis).

What ``workers.job.deadline`` promises, without a stack: the ERROR is published at
the limit by the watchdog, even while the job's thread sleeps in C; it is the
job's only final status (the thread's late COMPLETED is dropped); a thread
that unwinds from the interruption keeps its worker, and one that does not is
reported stuck after the grace period (``on_stuck``, which exits a real worker).
The end-to-end cases, with the real client, are in ``tests/e2e/isolation/test_deadlines.py``.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import redis

from ndif_celery import wire
from ndif_celery.state import jobs
from tests.support import pace
from tests.support.stacks.servers import embedded_redis
from workers.job import deadline
from workers.job.channel import DEADLINE, FinalChannel
from workers.job.executors import JobCancelled, JobTimedOut


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with embedded_redis(tmp_path_factory.mktemp("watchdog")) as settings:
        client = redis.Redis.from_url(settings.redis_url)
        yield client
        client.close()


def _job(client, name: str):
    job = jobs.Job(id=f"job-{name}-{time.time_ns()}", model_key="test-model")
    return job, FinalChannel(client, job, 60)


def _latest(client, job) -> dict:
    return json.loads(client.get(jobs.status_key(job.id)))


def _run_in_thread(watchdog, job, channel, seconds, body):
    """``body`` inside a watch, in a thread of its own (as the pool thread runs a job); what it raised."""
    outcome = {}

    def target():
        try:
            with watchdog.watch(job.id, channel, {"job_id": job.id}, seconds):
                body()
            channel.send(wire.COMPLETED, "done")  # the job's own, late answer
            outcome["returned"] = True
        except BaseException as error:  # noqa: BLE001
            outcome["raised"] = type(error)
            channel.send(wire.ERROR, "the job's own ERROR")

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def test_a_thread_sleeping_in_c_gets_its_error_at_the_limit_and_is_reported_stuck(client):
    stuck = []
    watchdog = deadline.DeadlineWatchdog(0.5, 0.5, (JobTimedOut, JobCancelled), lambda job_id, why: stuck.append(job_id))
    job, channel = _job(client, "stuck")
    started = time.monotonic()
    thread, outcome = _run_in_thread(watchdog, job, channel, 0.5, lambda: time.sleep(3))
    while client.get(jobs.status_key(job.id)) is None:
        assert time.monotonic() - started < pace.bound(2.5), "no ERROR while the thread sleeps"
        time.sleep(0.02)
    latest = _latest(client, job)
    assert latest["status"] == wire.ERROR and "exceeded the execution timeout of 0.5s" in latest["description"]
    assert thread.is_alive(), "the ERROR waited for the sleep to end"  # it came at the limit, not after
    while not stuck:
        assert time.monotonic() - started < pace.bound(2.8), "the stuck thread was not reported"
        time.sleep(0.02)
    assert stuck == [job.id]
    thread.join(5)  # the sleep ends; the interruption lands; its own ERROR is dropped
    assert outcome == {"raised": JobTimedOut}
    assert _latest(client, job)["description"] == latest["description"]
    assert client.zscore(jobs.ENDED, job.id) is not None


def test_a_thread_that_unwinds_keeps_its_worker_and_sends_one_final_status(client):
    stuck = []
    watchdog = deadline.DeadlineWatchdog(0.3, 1.0, (JobTimedOut, JobCancelled), lambda job_id, why: stuck.append(job_id))
    job, channel = _job(client, "unwinds")

    def python_loop():
        while True:
            time.sleep(0.01)

    thread, outcome = _run_in_thread(watchdog, job, channel, 0.3, python_loop)
    thread.join(3)
    assert outcome == {"raised": JobTimedOut}
    assert channel.answered_by == DEADLINE
    assert "execution timeout" in _latest(client, job)["description"]
    time.sleep(1.2)
    assert stuck == []


def test_a_kill_answers_at_once_and_a_late_result_is_dropped(client):
    watchdog = deadline.DeadlineWatchdog(60, 5, (JobTimedOut, JobCancelled), lambda job_id, why: None)
    job, channel = _job(client, "killed")
    thread, outcome = _run_in_thread(watchdog, job, channel, 60, lambda: [time.sleep(0.01) for _ in range(300)])
    time.sleep(0.2)
    assert not watchdog.kill("another-job")
    started = time.monotonic()
    assert watchdog.kill(job.id)
    assert time.monotonic() - started < pace.bound(0.5)
    assert _latest(client, job)["description"] == deadline.CANCELLED
    thread.join(3)
    assert outcome == {"raised": JobCancelled}
    assert _latest(client, job)["description"] == deadline.CANCELLED


def test_a_job_that_answers_first_is_not_interrupted(client):
    watchdog = deadline.DeadlineWatchdog(0.3, 0.3, (JobTimedOut, JobCancelled), lambda job_id, why: None)
    job, channel = _job(client, "quick")
    thread, outcome = _run_in_thread(watchdog, job, channel, 0.3, lambda: None)
    thread.join(2)
    time.sleep(0.5)
    assert outcome == {"returned": True}
    assert _latest(client, job)["status"] == wire.COMPLETED


def _batch_in_thread(watchdog, members, seconds, body):
    """``body`` inside one watch for a co-batch (``members``: (job, channel) each, the lead first)."""
    (lead, lead_channel), *others = members
    outcome = {}

    def target():
        try:
            with watchdog.watch(lead.id, lead_channel, {}, seconds, [(j.id, c, {}) for j, c in others]):
                body()
            outcome["returned"] = True
        except BaseException as error:  # noqa: BLE001
            outcome["raised"] = type(error)
        for _, channel in members:  # each job's own, late answer
            channel.send(wire.COMPLETED, "done")

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def test_a_co_batch_past_its_deadline_gets_every_jobs_error_once(client):
    watchdog = deadline.DeadlineWatchdog(0.5, 2.0, (JobTimedOut, JobCancelled), lambda job_id, why: None)
    members = [_job(client, f"batch{i}") for i in range(3)]
    thread, outcome = _batch_in_thread(watchdog, members, 0.5, lambda: [time.sleep(0.05) for _ in range(100)])
    thread.join(5)
    assert outcome == {"raised": JobTimedOut}
    for job, _ in members:
        latest = _latest(client, job)
        assert latest["status"] == wire.ERROR and "exceeded the execution timeout" in latest["description"], job.id
        assert client.zscore(jobs.DEADLINES, job.id) is None  # every deadline cleared for the beat


def test_a_kill_of_one_job_of_a_co_batch_answers_it_alone(client):
    watchdog = deadline.DeadlineWatchdog(30, 2.0, (JobTimedOut, JobCancelled), lambda job_id, why: None)
    members = [_job(client, f"kill{i}") for i in range(3)]
    release = threading.Event()
    thread, outcome = _batch_in_thread(watchdog, members, 30, lambda: release.wait(10))
    while client.zscore(jobs.DEADLINES, members[2][0].id) is None:
        time.sleep(0.01)  # armed, every job's deadline recorded
    assert watchdog.kill(members[1][0].id)
    assert _latest(client, members[1][0])["description"] == deadline.CANCELLED
    assert not watchdog.kill(members[1][0].id), "killed twice"
    release.set()
    thread.join(5)
    assert outcome == {"returned": True}, "the batch's thread was interrupted"
    assert [_latest(client, job)["status"] for job, _ in members] == [wire.COMPLETED, wire.ERROR, wire.COMPLETED]
    assert _latest(client, members[1][0])["description"] == deadline.CANCELLED  # its late COMPLETED dropped


@pytest.mark.parametrize("handle_class", ["zygote", "fork server"])
def test_a_kill_lands_while_the_job_waits_for_its_isolation_process(handle_class):
    """The first untrusted job after a deploy waits (RUNNING already published)
    for its model's zygote, seconds of imports when exec'd: ``ndif-celery kill``
    raises JobCancelled into that thread (``Worker.cancel``), and it must land
    then, not once the zygote is ready (it landed ~3 s late: one ``Event.wait``
    in C runs no Python). The real ``wait_ready`` on a handle never made ready."""
    import ctypes
    import types

    from workers.isolation.forkserver import ForkServer, ForkServerError
    from workers.isolation.zygote import Zygote, ZygoteError

    wait_ready = {"zygote": Zygote, "fork server": ForkServer}[handle_class].wait_ready
    handle = types.SimpleNamespace(ready=threading.Event(), error=None)
    outcome = {}

    def target():
        try:
            wait_ready(handle, 30)
            outcome["returned"] = True
        except BaseException as error:  # noqa: BLE001
            outcome["raised"] = type(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    time.sleep(0.3)  # blocked in the wait
    started = time.monotonic()
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(JobCancelled))
    thread.join(2)
    assert not thread.is_alive(), "the kill did not land while the job waited for its isolation process"
    assert outcome == {"raised": JobCancelled} and time.monotonic() - started < pace.bound(1.0)
    # Not ready in time, or settled with an error: the handle's own error class says which.
    with pytest.raises(ZygoteError, match=f"{handle_class} did not become ready within 0.2 s"):
        wait_ready(types.SimpleNamespace(ready=threading.Event(), error=None), 0.2)
    failed = types.SimpleNamespace(ready=threading.Event(), error="no such interpreter")
    failed.ready.set()
    with pytest.raises(ZygoteError, match="no such interpreter") as raised:
        wait_ready(failed, 30)
    assert type(raised.value) is {"zygote": ZygoteError, "fork server": ForkServerError}[handle_class]
