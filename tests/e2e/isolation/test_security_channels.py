"""Attacks on the way back: the pipe between an isolated child and its worker,
and the statuses any job (trusted too) makes the server publish and store.

Each test is an attack a user could really make with the real client: hang
the worker by closing the result pipe and sleeping, flood it with prints or
a huge exception message, forge frames on the result pipe (a trusted job's
statuses are bounded the same way: tests/e2e/api/test_output_bounds.py). Each must end
bounded (a clear ERROR naming the limit, or output cut with a note saying
so), nothing forged may reach the job's meta, what Redis keeps for the job
stays small, and the worker keeps serving, exactly right
(``still_serving_after``, once per isolation mode).
"""

from __future__ import annotations

import json
import os
import re
import struct
import time

import nnsight
import pytest
import redis
from nnsight.intervention.backends.remote import RemoteError

from tests.support import pace
from tests.support.cases.jail_fixtures import jail, still_serving_after, worker_pid  # noqa: F401
from tests.support.clients.remote import kill_stuck
from tests.support.stacks.stack_pool import JAIL_TIMEOUT_S
from tests.support.stacks.status_feed import STORED_LIMIT, logs_of, published, stored_status, the_job
from tests.support.cases.tiny_model import PROMPT

nnsight.register(__name__)  # the helpers below ship with the blocks, by value

def the_worker(stack) -> str:
    (name,) = stack.farm()["cluster"]["workers"]
    return name


def writable_pipes():
    """The fds of this process that are the write end of a pipe: an isolated
    child keeps only its result pipe."""
    import fcntl
    import stat

    found = []
    for fd in range(3, 1024):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY:
                found.append(fd)
        except OSError:
            pass
    return found


def close_everything_and_sleep():
    for fd in range(3, 1024):
        try:
            os.close(fd)
        except OSError:
            pass
    time.sleep(600)


def forge_frames(frames):
    """Write raw frames (kind, body) to every result pipe found."""
    pipes = writable_pipes()
    for fd in pipes:
        for kind, body in frames:
            os.write(fd, kind + struct.pack(">Q", len(body)) + body)
    return len(pipes)


def announce_and_sleep(kind, length):
    for fd in writable_pipes():
        os.write(fd, kind + struct.pack(">Q", length) + b"only the start")
    time.sleep(600)


# --- 3: a child that hangs its parent ------------------------------------------------------


def test_a_child_that_closes_its_pipe_and_sleeps_times_out(jail, model):
    with model.trace(PROMPT, remote=True):  # the model and its zygote are up: time only the attack
        model.transformer.h[0].output.save()
    started = time.monotonic()
    with pytest.raises(RemoteError, match=f"exceeded the execution timeout of {JAIL_TIMEOUT_S}s"):
        with model.trace(PROMPT, remote=True):
            out = model.transformer.h[0].output.save()  # noqa: F841
            close_everything_and_sleep()
    assert time.monotonic() - started < JAIL_TIMEOUT_S + pace.bound(5), "the worker waited past the deadline for a child that hung"


def test_an_operator_kill_ends_a_child_that_closed_its_pipe(jail, model):
    """Cancelled by the operator (not timed out: the deadline is JAIL_TIMEOUT_S
    away), and at once, though the worker waits on the child's exit: 1 s after
    RUNNING the child has closed its pipe."""
    kill_stuck(jail, model, close_everything_and_sleep, settle_s=1.0)


# --- 4: floods through the side channels -------------------------------------------------


def test_printing_50_mb_and_100k_lines_is_cut_and_rate_limited(jail, model):
    with published(jail) as messages:
        with model.trace(PROMPT, remote=True):
            print("x" * 50_000_000)
            for i in range(100_000):
                print(i)
            out = model.transformer.h[0].output.save()
    assert out.shape[0] == 1  # the job itself completed
    job_id = the_job(messages)
    logs = logs_of(messages)
    assert re.fullmatch(r"x{1000,}\.\.\. \[truncated: 49\.9 MB more\]", logs[0]), logs[0][-80:]
    assert len(logs[0]) <= 64 * 1024
    notes = [line for line in logs if line.startswith("LOG output suppressed:")]
    assert notes, logs[-3:]
    dropped = sum(int(re.match(r"LOG output suppressed: (\d+) lines dropped", n).group(1)) for n in notes)
    printed = [line for line in logs[1:] if line not in notes]
    numbers = [int(line) for line in printed]
    assert numbers[:1000] == list(range(1000)), "the first burst was not let through as printed"
    assert numbers == sorted(set(numbers)), "lines were reordered or repeated"
    assert len(printed) + dropped == 100_000
    assert len(printed) < 3000, "the LOG rate limit let the flood through"
    assert "NDIF_LOG_LINES_PER_S" in notes[-1]
    assert len(stored_status(jail, job_id)) < STORED_LIMIT


def test_an_exception_with_a_50_mb_message_is_cut(jail, model):
    with published(jail) as messages, pytest.raises(RemoteError) as raised:
        with model.trace(PROMPT, remote=True):
            out = model.transformer.h[0].output.save()  # noqa: F841
            raise ValueError("y" * 50_000_000)
    message = str(raised.value)
    assert "ValueError: yyyy" in message and re.search(r"\.\.\. \[truncated: 49\.9 MB more\]", message), message[-200:]
    assert len(message) < 70 * 1024
    latest = stored_status(jail, the_job(messages))
    assert len(latest) < STORED_LIMIT
    assert json.loads(latest)["status"] == "ERROR"


def test_forged_meta_frames_do_not_reach_the_jobs_meta(jail, model):
    forged = json.dumps({"worker": "evil", "job_id": "forged", "result_bytes": 10**18, "queue_ms": -5,
                         "run_ms": 1e300, "isolated": False, "filler": "z" * 10_000}).encode()
    deep = b"[" * 8000 + b"]" * 8000  # nested past the JSON parser's recursion limit
    with published(jail) as messages:
        with model.trace(PROMPT, remote=True) as tracer:
            pipes = nnsight.save(forge_frames([(b"M", forged), (b"M", deep), (b"M", b"not json")]))
            out = model.transformer.h[0].output.save()
    assert pipes == 1, "the block did not find its result pipe"
    assert out.shape[0] == 1
    job_id = the_job(messages)
    stored = json.loads(stored_status(jail, job_id))
    for meta in (tracer.backend.meta, stored["meta"]):
        assert meta["worker"] == the_worker(jail)
        assert meta["job_id"] == job_id
        assert meta["isolated"] is True
        assert 0 < meta["result_bytes"] < 10**9
        assert meta["queue_ms"] >= 0 and meta["run_ms"] < 60_000
        assert "filler" not in meta
        assert set(meta.get("child", {})) <= {"deserialize_ms", "run_ms", "encode_ms"}
    metrics = redis.Redis.from_url(jail.redis_url).hgetall("ndif:metrics:bytes")
    assert int(metrics.get(b"result", 0)) < 10**15, metrics


@pytest.mark.parametrize("kind, named", [(b"L", "announced 4.61 EB in one LOG frame, over the 65.5 KB"),
                                         (b"E", "announced 4.61 EB in one ERROR frame"),
                                         (b"R", "over this server's limit"),
                                         (b"Z", "frame of unknown kind")])
def test_a_frame_header_over_its_kinds_limit_stops_the_child(jail, model, kind, named):
    started = time.monotonic()
    with published(jail) as messages, pytest.raises(RemoteError, match=re.escape(named)):
        with model.trace(PROMPT, remote=True):
            out = model.transformer.h[0].output.save()  # noqa: F841
            announce_and_sleep(kind, 2**62)
    # Waiting for the body would have run into the deadline (its error is not the one matched above).
    assert time.monotonic() - started < min(pace.bound(5), JAIL_TIMEOUT_S), "the worker waited for the announced body"
    assert len(stored_status(jail, the_job(messages))) < STORED_LIMIT


# --- the trusted path: the same bounds on statuses ---------------------------------------
