"""The 0.5.15 client on two Python minors, each on its own runtime of one farm.

A 0.5 payload is CPython bytecode: it runs only on the minor that made it.
The farm runs a 0.5.15 runtime on its own Python and one built on another
interpreter (``runtime add 0.5.15 --python ...``, named ``0.5.15+py3.12``);
each client's requests go to the runtime of its minor, and each gets exactly
its local values, trusted and jailed. A runtime on another minor holds its own
copy of the farm, with the farm's torch build: where the package index has no
such build for that minor (a CPU torch is only on this host's disk, for its
own Python), the module skips and says so.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from importlib import metadata

import pytest
import redis

from ndif_celery.accounts import ledger
from tests.support.cases import old_client_cases
from tests.support.clients import client_envs

VERSION = "0.5.15"
CASES = ["read_outputs", "zero_output", "source_edit", "generate_iter", "gradients", "session"]


def _why_no_torch(python: str) -> str:
    """Why the farm's torch build does not install on ``python`` ("" when it does)."""
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run([python, "-m", "pip", "download", "--no-deps", "-q", "-d", folder,
                               f"torch=={metadata.version('torch')}"], capture_output=True, text=True, timeout=900)
    errors = [line for line in (done.stderr or done.stdout).splitlines() if line.startswith("ERROR")]
    return "" if done.returncode == 0 else (errors[0] if errors else f"pip exited {done.returncode}")


@pytest.fixture(scope="module")
def farm(tmp_path_factory, hf_home):
    other = client_envs.other_python()
    if other is None:
        pytest.skip("no interpreter of another Python minor on this host")
    why = _why_no_torch(other)
    if why:
        pytest.skip(f"the farm's torch {metadata.version('torch')} has no build for {other} from this host's "
                    f"package index ({why}); a runtime on another minor needs it")
    runtimes = [client_envs.shared(VERSION), client_envs.shared(VERSION, python=other)]
    names = [runtime.version for runtime in runtimes]
    assert names[1].startswith(f"{VERSION}+py") and names[1] != f"{VERSION}+py{sys.version_info[0]}.{sys.version_info[1]}"
    with client_envs.runtimes_stack(tmp_path_factory.mktemp("minors-farm"), hf_home, runtimes,
                                    {"NDIF_ISOLATION": "zygote"}, timeout_s=300) as stack:
        yield {"stack": stack, "runtimes": runtimes}


@pytest.mark.parametrize("who", ["trusted", "untrusted"])
def test_each_minor_runs_on_its_own_runtime_exact_to_its_local_run(farm, who):
    stack = farm["stack"]
    email = f"{who}-minors@example.org"
    key = stack.create_key(email, trusted=who == "trusted")
    for runtime in farm["runtimes"]:
        reports = old_client_cases.run_cases(runtime.interpreter, stack.url, CASES, "blocking",
                                             env={"CLIENT_API_KEY": key})
        assert [report["case"] for report in reports] == CASES, reports
        for report in reports:
            assert report.get("equal") is True and report["version"] == VERSION, json.dumps(report, default=str)[:4000]
    client = redis.Redis.from_url(stack.redis_url)
    stack.until(lambda: not client.llen(ledger.PENDING), "the ledger's pending entries to be written")
    rows = json.loads(stack.cli("jobs", "--json", "--user", email, "--limit", "500", check=True).stdout)
    for runtime in farm["runtimes"]:
        ran = [row for row in rows if f"nnsight{runtime.version}@" in (row["worker"] or "")]
        assert len(ran) >= len(CASES) and {row["isolated"] for row in ran} == {who == "untrusted"}, rows
