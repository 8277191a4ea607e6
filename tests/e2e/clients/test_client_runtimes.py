"""The real nnsight 0.5.15, 0.6.3, 0.7.0 and 0.8.1 clients against one farm at the same time.

One stack (auth on, jailed children from per-model zygotes) runs its own
workers and, through ``NDIF_RUNTIMES``, one worker per runtime; each older
client lives in its own environment made from the package index, which is
also the runtime its worker runs (``tests/support/clients/client_envs.py``). Each
client runs the conformance cases written in its own API
(``tests/support/cases/old_client_cases.py``; the 0.8.1 client's are
``tests/support/cases/conformance.py``) once locally and once on the farm, and must
get exactly its local values: with a trusted key (the worker's own process)
and with an untrusted one (a jailed child), all three clients at once.
``nnsight.status()`` and ``nnsight.compare()`` work from each client on its
runtime's own port (``NDIF_RUNTIME_PORTS``). A 0.5 payload is bytecode: the
0.5.15 client runs with the cloudpickle pip resolves today (3.1.3, whose code
objects the farm repairs) and with 3.1.1, and one on a Python minor no worker
runs reads why it is refused.
"""

from __future__ import annotations

import json
import platform
import threading

import pytest
import redis

from ndif_celery.accounts import ledger
from ndif_celery.policy import client_versions
from tests.support.clients import client_envs
from tests.support.cases import conformance
from tests.support.cases import old_client_cases
from tests.support.clients.remote import client_pointed_at
from tests.support.stacks.servers import free_ports
from tests.support.cases.tiny_model import PROMPT, REPO_ID

OLD = ("0.5.15", "0.6.3", "0.7.0")
# The 0.8.1 client's cases that run beside the older clients' (every case runs on every
# execution path in test_conformance_remote): reads, an edit inside .source, a session,
# a generation step by step, gradients and a cache.
MAIN_CASES = (conformance.case_read_outputs, conformance.case_source_edit, conformance.case_session,
              conformance.case_generate_iter, conformance.case_grad_single, conformance.case_cache_all)


@pytest.fixture(scope="module")
def farm(tmp_path_factory, hf_home):
    runtimes = [client_envs.shared(version) for version in OLD]
    ports = dict(zip(OLD, free_ports(len(OLD))))
    env = {"NDIF_ISOLATION": "zygote",
           "NDIF_RUNTIME_PORTS": ",".join(f"{version}={port}" for version, port in ports.items())}
    with client_envs.runtimes_stack(tmp_path_factory.mktemp("runtimes-farm"), hf_home, runtimes, env) as stack:
        keys = {who: stack.create_key(f"{who}@example.org", trusted=who == "trusted") for who in ("trusted", "untrusted")}
        yield {"stack": stack, "pythons": {runtime.version: runtime.interpreter for runtime in runtimes},
               "ports": ports, "keys": keys}


def _port_url(farm, version: str) -> str:
    return f"http://127.0.0.1:{farm['ports'][version]}"


def _old_client_runs(farm, who: str, mode: str, cases: dict) -> dict:
    """Each older client's reports of ``cases[version]``, the clients running at once (threads)."""
    reports: dict = {}

    def run(version):
        try:
            reports[version] = old_client_cases.run_cases(farm["pythons"][version], farm["stack"].url, cases[version], mode,
                                                   env={"CLIENT_API_KEY": farm["keys"][who]})
        except BaseException as error:  # noqa: BLE001 - reported by the test
            reports[version] = error

    threads = [threading.Thread(target=run, args=(version,)) for version in OLD]
    for thread in threads:
        thread.start()
    return {"threads": threads, "reports": reports}


def _assert_each_equal(runs: dict, cases: dict) -> None:
    for thread in runs["threads"]:
        thread.join(timeout=900)
    for version in OLD:
        reports = runs["reports"][version]
        if isinstance(reports, BaseException):
            raise reports
        assert [report["case"] for report in reports] == list(cases[version]), reports
        for report in reports:
            assert report.get("equal") is True and report["version"] == version, json.dumps(report, default=str)[:6000]


@pytest.mark.parametrize("who", ["trusted", "untrusted"])
def test_each_client_gets_its_own_local_values_all_at_once(farm, who, model, local_results, tmp_path):
    cases = {version: old_client_cases.SUPPORTED[version] for version in OLD}
    runs = _old_client_runs(farm, who, "blocking", cases)
    with client_pointed_at(farm["stack"].url):
        import nnsight

        nnsight.CONFIG.API.APIKEY = farm["keys"][who]
        for case in MAIN_CASES:  # the farm's own client, meanwhile
            conformance.assert_same(case(model, lambda m: {"remote": True}, tmp_path), local_results(case))
        with model.trace(PROMPT, remote=True) as tracer:
            model.output.logits.save()
        assert tracer.backend.meta["isolated"] is (who == "untrusted")
    _assert_each_equal(runs, cases)
    # Each runtime's worker ran its client's jobs, in a jailed child for the untrusted key (the ledger says).
    rows = _ledger_rows(farm["stack"], f"{who}@example.org")
    for version in OLD:
        ran = [row for row in rows if f"nnsight{version}@" in (row["worker"] or "")]
        assert len(ran) >= len(cases[version]) and {row["isolated"] for row in ran} == {who == "untrusted"}, ran


def _ledger_rows(stack, email: str) -> list:
    client = redis.Redis.from_url(stack.redis_url)
    stack.until(lambda: not client.llen(ledger.PENDING), "the ledger's pending entries to be written")
    result = stack.cli("jobs", "--json", "--user", email, "--limit", "500", check=True)
    return json.loads(result.stdout)


def test_the_older_clients_poll_for_their_values(farm):
    cases = {version: ["read_outputs", "source_edit", "session", "generate_iter", "gradients"] for version in OLD}
    _assert_each_equal(_old_client_runs(farm, "trusted", "non-blocking", cases), cases)


STATUS_AND_ENV = """
import io, json, sys, contextlib, types
import huggingface_hub
import nnsight
from nnsight import CONFIG, ndif
CONFIG.API.HOST = sys.argv[1]
# is_model_running asks the hub for the repo's canonical id; the hub is out of reach here, and the id is the repo's.
huggingface_hub.HfApi.model_info = lambda self, repo_id, **kwargs: types.SimpleNamespace(id=repo_id)
shown = io.StringIO()
with contextlib.redirect_stdout(shown):
    ndif.compare()
print(json.dumps({"version": nnsight.__version__, "status": nnsight.status(),
                  "running": nnsight.is_model_running(sys.argv[2]),
                  "remote_env": ndif.get_remote_env(), "compared": shown.getvalue()}, default=str))
"""


@pytest.mark.parametrize("version", [version for version in OLD if version != "0.5.15"])
def test_status_and_compare_on_the_runtimes_own_port(farm, version):
    said = client_envs.run(farm["pythons"][version], STATUS_AND_ENV, _port_url(farm, version), REPO_ID)
    assert said["version"] == version
    # The earlier tests deployed the model for every runtime: this port shows its own.
    assert said["running"] is True, said
    assert "RUNNING" in str(said["status"][REPO_ID]["state"]), said
    assert said["remote_env"]["packages"]["nnsight"] == version  # what compare() holds the client against
    assert "nnsight" in said["compared"]
    on_main = client_envs.run(farm["pythons"][version], STATUS_AND_ENV, farm["stack"].url, REPO_ID)
    assert on_main["remote_env"]["packages"]["nnsight"] == client_versions.MAIN


def test_status_and_compare_from_the_farms_own_client(farm):
    import nnsight
    from nnsight import ndif

    with client_pointed_at(farm["stack"].url):
        status = nnsight.status()
        assert ndif.get_remote_env()["packages"]["nnsight"] == client_versions.MAIN
        ndif.compare()
    assert REPO_ID in str(status)


def test_a_client_on_another_runtimes_port_is_told_where_to_go(farm):
    other = {"0.6.3": "0.7.0", "0.7.0": "0.6.3"}
    version = "0.6.3"
    said = old_client_cases.run_cases(farm["pythons"][version], _port_url(farm, other[version]), ["read_outputs"],
                               "blocking", env={"CLIENT_API_KEY": farm["keys"]["trusted"]})[-1]
    assert said.get("error") == "ConnectionError", said
    assert said["said"] == (f"This port serves nnsight {other[version]} clients, and yours is nnsight {version}: "
                            f"use the farm's API port ({farm['stack'].api_port}).")


HOOKS_LEFT = """
import json, os, sys
import nnsight
from nnsight import CONFIG, LanguageModel
from nnsight.modeling import huggingface
CONFIG.API.HOST, CONFIG.API.APIKEY = sys.argv[1], os.environ["CLIENT_API_KEY"]
huggingface.ID_CACHE[sys.argv[2]] = sys.argv[2]
model = LanguageModel(sys.argv[2])

def hooks_on_the_farms_model():
    with model.trace(sys.argv[3], remote=True):
        counts = nnsight.save([len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model._module.modules()])
    return counts

before = hooks_on_the_farms_model()
with model.trace(sys.argv[3], remote=True) as tracer:
    cache = tracer.cache().save()
print(json.dumps({"before": before, "after": hooks_on_the_farms_model(), "cached": len(cache)}))
"""


def test_a_cache_leaves_no_hook_on_the_resident_model(farm):
    # nnsight 0.7.0's tracer.cache() leaves its hooks on the modules after the trace: on a
    # worker's resident model they would record every later user's values into it.
    said = client_envs.run(farm["pythons"]["0.7.0"], HOOKS_LEFT, farm["stack"].url, REPO_ID, PROMPT,
                           env={"CLIENT_API_KEY": farm["keys"]["trusted"]})
    assert said["cached"] > 0 and said["before"] == said["after"], said


LOCAL_BLOCK = """
import json, linecache, os, sys
# nnsight reads a block's source with inspect: give this -c program's text a file's place.
_SOURCE = sys.orig_argv[sys.orig_argv.index("-c") + 1]
linecache.cache["<string>"] = (len(_SOURCE), None, _SOURCE.splitlines(keepends=True), "<string>")
import nnsight
from nnsight import CONFIG, LanguageModel
from nnsight.modeling import huggingface
CONFIG.API.HOST, CONFIG.API.APIKEY = sys.argv[1], os.environ["CLIENT_API_KEY"]
huggingface.ID_CACHE[sys.argv[2]] = sys.argv[2]
model = LanguageModel(sys.argv[2])
try:
    with model.session(remote=True) as session:
        with model.trace(sys.argv[3]):
            hidden = model.transformer.h[0].output.save()
        with session.local():
            print(hidden.shape)
    print(json.dumps({"ran": True}))
except Exception as error:
    print(json.dumps({"error": type(error).__name__, "said": str(error)}))
"""


def test_a_block_streamed_back_mid_job_is_refused_with_a_sentence(farm):
    said = client_envs.run(farm["pythons"]["0.7.0"], LOCAL_BLOCK, farm["stack"].url, REPO_ID, PROMPT,
                           env={"CLIENT_API_KEY": farm["keys"]["trusted"]})
    assert "ran" not in said, said
    assert ("tracer.local() / session.local() (values sent to your machine in the middle of a job) is not served "
            "by this farm: save the values, and run that code after the session ends.") in said["said"], said


STATUS_05 = """
import json, sys, types
import huggingface_hub
import nnsight
from nnsight import CONFIG
CONFIG.API.HOST = sys.argv[1]
huggingface_hub.HfApi.model_info = lambda self, repo_id, **kwargs: types.SimpleNamespace(id=repo_id)
print(json.dumps({"version": nnsight.__version__, "status": nnsight.ndif_status(),
                  "running": nnsight.is_model_running(sys.argv[2])}, default=str))
"""


def test_status_from_the_05_client_on_its_runtimes_port(farm):
    # 0.5 has no /env and no compare(): its status and is_model_running read /status.
    said = client_envs.run(farm["pythons"]["0.5.15"], STATUS_05, _port_url(farm, "0.5.15"), REPO_ID)
    assert said["version"] == "0.5.15" and said["running"] is True, said
    assert "RUNNING" in str(said["status"][REPO_ID]["state"]), said


#: What a 0.5 payload must survive: the frame it is pushed into, sessions, generation, gradients, caches.
BYTECODE_CASES = ["read_outputs", "zero_output", "session", "generate_iter", "gradients", "cache_modules",
                  "invoke_isolation"]


@pytest.mark.parametrize("who", ["trusted", "untrusted"])
def test_a_05_client_with_cloudpickle_311_gets_its_local_values(farm, who):
    python = client_envs.client_only("nnsight-0.5.15-cloudpickle-3.1.1", ["nnsight==0.5.15", "cloudpickle==3.1.1"])
    shown = client_envs.run(python, "import cloudpickle, json; print(json.dumps({'v': cloudpickle.__version__}))")
    assert shown["v"] == "3.1.1"
    reports = old_client_cases.run_cases(python, farm["stack"].url, BYTECODE_CASES, "blocking",
                                         env={"CLIENT_API_KEY": farm["keys"][who]})
    assert [report["case"] for report in reports] == BYTECODE_CASES
    for report in reports:
        assert report.get("equal") is True and report["version"] == "0.5.15", json.dumps(report, default=str)[:6000]


OTHER_MINOR = """
import json, sys
import nnsight
from nnsight import CONFIG, LanguageModel
from nnsight.intervention.backends import remote
CONFIG.API.HOST, CONFIG.API.APIKEY = sys.argv[1], sys.argv[3]
# The header this client sends from a Python 3.12 interpreter: sys.version there.
remote.python_version = "3.12.1 (main, Jan  1 2026, 00:00:00) [GCC 12.2.0]"
# 0.5 reads a module-level block's source with inspect: give this -c program's text a file's place.
import linecache
_SOURCE = sys.orig_argv[sys.orig_argv.index("-c") + 1]
linecache.cache["<string>"] = (len(_SOURCE), None, _SOURCE.splitlines(keepends=True), "<string>")
import types, huggingface_hub
huggingface_hub.HfApi.model_info = lambda self, repo_id, *args, **kwargs: types.SimpleNamespace(id=repo_id)
model = LanguageModel(sys.argv[2])
try:
    with model.trace("hello", remote=True):
        out = model.transformer.h[0].output.save()
    print(json.dumps({"ran": True}))
except Exception as error:
    print(json.dumps({"error": type(error).__name__, "said": str(error)}))
"""


def test_a_05_client_on_a_python_minor_no_worker_runs_reads_why(farm):
    # Its bytecode would not run on this farm's 3.11: refused before the body is read, with the way out.
    minor = ".".join(platform.python_version_tuple()[:2])
    said = client_envs.run(farm["pythons"]["0.5.15"], OTHER_MINOR, farm["stack"].url, REPO_ID, farm["keys"]["trusted"])
    assert said.get("error") == "ConnectionError", said
    assert said["said"] == (
        f"This farm serves nnsight 0.5.15 on Python {minor} only, and your client runs Python 3.12: an nnsight "
        "0.5.15 request carries its code as Python bytecode, which runs only on the Python minor version that "
        f"made it. Run your client on Python {minor}, or ask the farm's operator to add a runtime on your Python "
        "(`ndif-celery runtime add 0.5.15 --python /path/to/python3.12`) and start a worker of it."), said
