"""The real nnsight 0.8.0 client against a farm's 0.8.0 runtime.

0.8.0 speaks the 0.8.1 wire but differs in what a block pushes back to the
caller's frame, so the farm serves it from its own runtime (``NDIF_RUNTIMES``).
The 0.8.0 client, in its environment from the package index, runs every case
of the 0.8.1 conformance catalogue (``tests/support/cases/conformance.py``, the
same API) once locally and once on the farm, trusted and jailed, and must get
exactly its local values.
"""

from __future__ import annotations

import json

import pytest
import redis

from ndif_celery.accounts import ledger
from tests.support.cases import conformance
from tests.support.cases.tiny_model import REPO_ID
from tests.support.clients import client_envs
from tests.support.paths import ROOT

VERSION = "0.8.0"

CASES_BOTH_WAYS = """
import json, os, pathlib, sys, tempfile
sys.path.insert(0, sys.argv[2])
import nnsight
from nnsight import CONFIG
from tests.support.cases import conformance
from tests.support.cases.tiny_model import client_model
CONFIG.API.HOST, CONFIG.API.APIKEY = sys.argv[1], os.environ["CLIENT_API_KEY"]
CONFIG.APP.REMOTE_LOGGING = False
model = client_model(sys.argv[3])
for case in conformance.CASES:
    report = {"case": conformance.case_id(case), "version": nnsight.__version__}
    try:
        local = case(model, lambda m: {}, pathlib.Path(tempfile.mkdtemp()))
        remote = case(model, lambda m: {"remote": True}, pathlib.Path(tempfile.mkdtemp()))
        report["diff"] = conformance.diff(local, remote)
    except Exception as error:
        report["error"] = f"{type(error).__name__}: {error}"[-3000:]
    print(json.dumps(report), flush=True)
"""


@pytest.fixture(scope="module")
def farm(tmp_path_factory, hf_home):
    runtime = client_envs.shared(VERSION)
    with client_envs.runtimes_stack(tmp_path_factory.mktemp("farm-080"), hf_home, [runtime],
                                    {"NDIF_ISOLATION": "zygote"}) as stack:
        yield {"stack": stack, "python": runtime.interpreter}


@pytest.mark.parametrize("who", ["trusted", "untrusted"])
def test_every_conformance_case_equals_the_080_clients_local_run(farm, who):
    stack = farm["stack"]
    email = f"{who}-080@example.org"
    key = stack.create_key(email, trusted=who == "trusted")
    reports = client_envs.run_all(farm["python"], CASES_BOTH_WAYS, stack.url, str(ROOT), REPO_ID,
                                  timeout_s=900, env={"CLIENT_API_KEY": key})
    assert [report["case"] for report in reports] == [conformance.case_id(case) for case in conformance.CASES]
    for report in reports:
        assert report["version"] == VERSION and "error" not in report and report["diff"] is None, report
    # The 0.8.0 runtime's worker ran them, in a jailed child for the untrusted key.
    client = redis.Redis.from_url(stack.redis_url)
    stack.until(lambda: not client.llen(ledger.PENDING), "the ledger's pending entries to be written")
    rows = json.loads(stack.cli("jobs", "--json", "--user", email, "--limit", "500", check=True).stdout)
    assert rows and all(f"nnsight{VERSION}@" in (row["worker"] or "") for row in rows), rows
    assert {row["isolated"] for row in rows} == {who == "untrusted"}
