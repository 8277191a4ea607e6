"""Nobody left hanging: a worker killed mid-job, a client that goes away, and
fuzzed requests. Each test waits on a real job with the real client."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nnsight.intervention.backends.remote import RemoteBackend

from tests.support import pace
from tests.support.paths import ROOT
from tests.support.clients.remote import blocking_client_in_background, poll, slow_job, wait_status
from tests.support.stacks.stack import client_on_stack
from tests.support.cases.tiny_model import PROMPT, build_tiny_gpt2, client_model
from tests.support.waiting import wait_until

REPO = "reliability/tiny"
W0, W1, W2 = "gpu0@reliability", "gpu1@reliability", "gpu2@reliability"
GRACE_S = 2  # NDIF_DISCONNECT_GRACE_S: how long a blocking job outlives its client


@pytest.fixture(scope="module")
def farm(tmp_path_factory, hf_home):
    build_tiny_gpt2(hf_home, REPO, n_layer=2, seed=40)
    env = {"NDIF_WORKER_NAME": W0, "NDIF_WORKER_GPUS": "0", "NDIF_REPLICA_WAIT_S": "3600",
           "NDIF_DISCONNECT_GRACE_S": str(GRACE_S)}
    workers = [(W1, "1", 1), (W2, "2", 1)]
    with client_on_stack(tmp_path_factory.mktemp("reliability"), hf_home, env, workers) as stack:
        yield stack


def _local(model):
    with model.trace(PROMPT):
        out = model.transformer.h[1].output.save()
    return out


def test_a_job_whose_worker_is_killed_runs_again_elsewhere(farm):
    model = client_model(REPO)
    with model.trace(PROMPT, remote=True) as tracer:  # deploy it somewhere
        model.transformer.h[1].output.save()
    first = tracer.backend.meta["worker"]
    backend = slow_job(model, 100, layer=1)  # 5 s: long enough to be killed in the middle
    wait_status(farm.url, backend.job_id, "RUNNING")
    os.kill(farm.farm()["cluster"]["workers"][first]["pid"], signal.SIGKILL)
    killed = time.monotonic()
    result = poll(backend, timeout_s=60)
    assert time.monotonic() - killed < pace.bound(30), "the lost job took longer than 30 s to come back"
    assert torch.equal(result["out"], _local(model))
    latest = httpx.get(f"{farm.url}/response/{backend.job_id}").json()
    # W0 is the stack's own worker, which `up` restarts under its name: the
    # re-run may land on it again (a new process); the added workers stay dead.
    assert latest["meta"]["worker"] != first or first == W0


class GoesAway(RemoteBackend):
    """A blocking client that hangs up right after submitting."""

    def __init__(self, model) -> None:
        super().__init__(model.to_model_key(), env=model._remoteable_get_env())

    def request(self, request, tracer):
        import websocket

        blob = self._serialize(tracer)
        connection = websocket.create_connection(f"{self.ws_host}/subscribe")
        request.session_id = json.loads(connection.recv())["session_id"]
        self.job_id = self._post(request, blob).id
        connection.close()
        return None


def test_a_client_that_went_away_can_still_poll_its_result(farm):
    model = client_model(REPO)
    backend = GoesAway(model)
    with model.trace(PROMPT, backend=backend):
        out = model.transformer.h[1].output.save()  # noqa: F841
        for _ in range(20):
            time.sleep(0.05)  # still running when the client leaves
    poller = RemoteBackend(model.to_model_key(), blocking=False, job_id=backend.job_id)
    result = poll(poller)
    assert torch.equal(result["out"], _local(model))


# A researcher's script: one blocking trace whose block sleeps ``steps`` x 50 ms.
CLIENT = """
import sys, time
sys.path.insert(0, sys.argv[4])
import nnsight
from tests.support.cases.tiny_model import PROMPT, client_model
nnsight.CONFIG.API.HOST = sys.argv[1]
nnsight.CONFIG.APP.REMOTE_LOGGING = True  # the test reads its status lines; a user's config file may turn them off
model = client_model(sys.argv[2])
steps = int(sys.argv[3])  # here: the block itself runs on the server
with model.trace(PROMPT, remote=True):
    out = model.transformer.h[1].output.save()
    for _ in range(steps):
        time.sleep(0.05)
"""


class ClientProcess:
    """The real client in a process of its own, whose status lines are read as it prints them."""

    def __init__(self, farm, steps: int) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # no user config of the host's: tests/conftest.py
        self.proc = subprocess.Popen([sys.executable, "-c", CLIENT, farm.url, REPO, str(steps), str(ROOT)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        self.out = b""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for chunk in iter(lambda: self.proc.stdout.read1(4096), b""):
            self.out += chunk

    def job_at(self, status: str) -> str:
        """The id of its job, once the client printed that it reached ``status``."""
        found = wait_until(lambda: re.search(rb"\[([0-9a-f]{32})\] " + status.encode(), self.out),
                           pace.bound(60), f"the client to print {status}", report=lambda: self.out[-2000:].decode(
                               errors="replace"))
        return found.group(1).decode()

    def interrupt(self) -> None:
        """Ctrl-C, and the process gone (its websocket closed with it). A client
        still exiting after that (a loaded machine: its close handshake, the
        interpreter's exit with torch loaded) is killed: the server sees the same
        closed socket, which is what the tests are about."""
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=pace.bound(15))
        except subprocess.TimeoutExpired:
            print(f"the client took over {pace.bound(15):.0f} s to exit on Ctrl-C; killed ({pace.describe()})")
            self.proc.kill()
            self.proc.wait(timeout=30)


def test_a_client_interrupted_mid_job_frees_the_model(farm):
    """Ctrl-C of a researcher's blocking trace: its running job is cancelled
    NDIF_DISCONNECT_GRACE_S after its websocket closed, and the next user's job
    starts; a job of a client that left while it waited never runs. (Nobody
    polls the two jobs during the grace: a poll by their key would keep them.)"""
    model = client_model(REPO)
    farm.cli("deploy", REPO)  # one replica: the jobs below queue behind each other
    first = ClientProcess(farm, steps=4000)  # 200 s
    running = first.job_at("RUNNING")
    second = ClientProcess(farm, steps=1)
    waiting = second.job_at("QUEUED")
    after = slow_job(model, 20, layer=1)  # the next user's (1 s: long enough to be seen RUNNING), in line behind them
    second.interrupt()
    first.interrupt()
    left = time.monotonic()
    wait_status(farm.url, after.job_id, "RUNNING")
    freed = time.monotonic() - left
    assert freed < GRACE_S + pace.bound(1), f"the model was held {freed:.1f} s after the client left; {pace.describe()}"
    assert torch.equal(poll(after)["out"], _local(model))
    for job_id in (running, waiting):
        latest = httpx.get(f"{farm.url}/response/{job_id}", timeout=10).json()
        assert latest["status"] == "ERROR" and "its client went away" in latest["description"], latest
    assert "worker" not in (httpx.get(f"{farm.url}/response/{waiting}", timeout=10).json().get("meta") or {}), \
        "the waiting job ran"


def test_a_web_restart_loses_no_queued_job_and_strands_no_blocking_client(farm):
    model = client_model(REPO)
    farm.cli("deploy", REPO)  # one replica: the jobs below queue behind each other
    running = slow_job(model, 60, layer=1)
    wait_status(farm.url, running.job_id, "RUNNING")
    queued = [slow_job(model, 1, layer=1) for _ in range(2)]

    def blocking_trace():
        with model.trace(PROMPT, remote=True):
            model.transformer.h[1].output.save()
        return "completed"

    client, blocked = blocking_client_in_background(blocking_trace)
    time.sleep(1.0)  # it is waiting on its websocket now
    os.killpg(farm.pids()["web"], signal.SIGKILL)
    client.join(timeout=15)
    assert not client.is_alive(), "a blocking client hung when the web died"
    assert blocked.get("out") != "completed", blocked
    farm.wait_answers()  # `up`'s supervisor restarts the web (tests/e2e/host/test_supervision.py)
    local = _local(model)
    for backend in [running, *queued]:
        assert torch.equal(poll(backend)["out"], local)


def test_sigterm_lets_the_running_job_finish(farm):
    model = client_model(REPO)
    backend = slow_job(model, 40, layer=1)
    wait_status(farm.url, backend.job_id, "RUNNING")
    deadline = time.monotonic() + 10
    while not (holders := [(n, i) for n, i in farm.operator_farm()["cluster"]["workers"].items()
                           if i["current_job"] == backend.job_id]):
        assert time.monotonic() < deadline, "no worker reports the job"
        time.sleep(0.1)
    (name, info), = holders
    os.kill(info["pid"], signal.SIGTERM)
    assert torch.equal(poll(backend)["out"], _local(model))
    deadline = time.monotonic() + 30
    while name in farm.farm()["cluster"]["workers"]:
        assert time.monotonic() < deadline, "the worker did not leave after SIGTERM"
        time.sleep(0.2)


ENVELOPE = st.one_of(
    st.none(),
    st.text(max_size=200),
    st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
    st.dictionaries(
        st.sampled_from(["model_key", "session_id", "compress", "env", "trusted", "x"]),
        st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=60), st.lists(st.integers(), max_size=3),
                  st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2)),
        max_size=5,
    ).map(json.dumps),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    envelope=ENVELOPE,
    blob=st.one_of(st.none(), st.binary(max_size=300), st.just(b"\x28\xb5\x2f\xfd" + b"\x00" * 20)),
    key=st.one_of(st.none(), st.from_regex(r"[!-~]{1,40}", fullmatch=True)),  # what a header can carry
)
def test_fuzzed_requests_get_a_4xx_with_a_detail(farm, envelope, blob, key):
    files = {"blob": ("request", blob, "application/octet-stream")} if blob is not None else None
    headers = {"ndif-api-key": key} if key else None
    response = httpx.post(
        f"{farm.url}/request", data={"data": envelope} if envelope is not None else None,
        files=files, headers=headers, timeout=10,
    )
    if response.status_code == 200:
        # Only a well-formed envelope naming an nnsight model gets this far; the
        # worker then refuses the payload or the model with an ERROR.
        assert json.loads(envelope)["model_key"].startswith("nnsight.modeling.")
        return
    assert 400 <= response.status_code < 500, response.text
    assert isinstance(response.json()["detail"], str)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(job_id=st.text(min_size=1, max_size=80).filter(lambda t: "/" not in t and t.isprintable()))
def test_fuzzed_response_ids_get_a_404_with_a_detail(farm, job_id):
    response = httpx.get(f"{farm.url}/response/{job_id}", timeout=10)
    assert response.status_code in (404, 400), response.text
    assert isinstance(response.json()["detail"], str)


def test_the_stack_keeps_serving_after_the_fuzzing(farm):
    model = client_model(REPO)
    with model.trace(PROMPT, remote=True):
        out = model.transformer.h[1].output.save()
    assert torch.equal(out, _local(model))
