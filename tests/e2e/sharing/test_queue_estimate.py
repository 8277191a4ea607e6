"""A waiting researcher is told about how long the wait is, and it is about right.

One worker, jobs one at a time (``NDIF_COBATCH_MAX=1``: a co-batch would run
jobs together and the wait would be another question). Three jobs of ~2 s run
first, so the model has recent run times; then one runs while three more wait.
Each waiting job's first QUEUED, as ``GET /response`` shows it, says its place
and "about N s" (the dashboard's queue row says when the last starts); the test measures when each really starts (RUNNING) and holds
the estimate within half of the real wait either way.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.support.clients.remote import poll, slow_job, wait_status
from tests.support.stacks.stack import client_on_stack

STEPS = 40  # x 50 ms: a ~2 s job
WAITING = 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory, hf_home):
    with client_on_stack(tmp_path_factory.mktemp("queue-estimate"), hf_home, {"NDIF_COBATCH_MAX": "1"}) as stack:
        yield stack


def _latest(stack, job_id: str) -> dict:
    return httpx.get(f"{stack.url}/response/{job_id}", timeout=10).json()


def test_the_queued_estimate_is_within_half_of_the_real_wait(stack, model):
    for _ in range(3):  # the model's recent run times
        poll(slow_job(model, STEPS), timeout_s=60)
    running = slow_job(model, STEPS)
    wait_status(stack.url, running.job_id, "RUNNING")
    waiting = []
    for _ in range(WAITING):
        backend = slow_job(model, STEPS)
        sent = time.monotonic()
        waiting.append((backend, sent, _latest(stack, backend.job_id)))
    page = httpx.get(f"{stack.url}/dashboard", timeout=10).text
    queues_table = page[page.index('<table id="queues">'):].split("</table>")[0]
    assert re.search(r'<td class="num">about \d+ s</td>', queues_table), queues_table  # when the last starts
    started = {}
    deadline = time.monotonic() + 120
    while len(started) < WAITING and time.monotonic() < deadline:
        for backend, _, _ in waiting:
            if backend.job_id not in started and _latest(stack, backend.job_id)["status"] in ("RUNNING", "COMPLETED"):
                started[backend.job_id] = time.monotonic()
        time.sleep(0.05)
    assert len(started) == WAITING, "not every waiting job started"
    for place, (backend, sent, first) in enumerate(waiting, 1):
        assert first["status"] == "QUEUED", first
        told = re.search(r"\(position (\d+), about (\d+) (s|min)\)", first["description"])
        assert told is not None, first["description"]
        estimate_s = int(told.group(2)) * (60 if told.group(3) == "min" else 1)
        real_s = started[backend.job_id] - sent
        print(f"position {told.group(1)}: told about {estimate_s} s, waited {real_s:.1f} s")
        assert int(told.group(1)) == place
        assert abs(estimate_s - real_s) <= 0.5 * real_s, (first["description"], f"waited {real_s:.1f} s")
    for backend, _, _ in waiting:
        poll(backend, timeout_s=60)
    poll(running, timeout_s=60)
