"""The client version gate (NDIF_MIN_NNSIGHT_VERSION, NDIF_MIN_PYTHON_VERSION):
each check at its edges and the web refusing before it touches Redis (Flask's
test client). The real client against a stack at the gate is tests/e2e/access/test_limits.py.
"""

from __future__ import annotations

import io
import json
import sys
import time

import pytest

from ndif_celery import config
from ndif_celery.policy import client_versions
from ndif_celery.state import registry
from tests.support.stacks.servers import free_port

NOT_PROVIDED = (
    "Client nnsight version was not provided. This usually means an outdated nnsight; "
    "please `pip install --upgrade nnsight` and retry."
)


def refusal(check, *args) -> str:
    with pytest.raises(client_versions.VersionRefused) as caught:
        check(*args)
    assert caught.value.status == 400
    return caught.value.detail


# -- nnsight --


@pytest.mark.parametrize("client", ["0.8.1", "0.8.1.post1", "0.8.2", "0.9.0", "0.10.0", "1.0"])
def test_nnsight_at_or_above_the_minimum_passes(client):
    client_versions.check_nnsight(client, "0.8.1")


@pytest.mark.parametrize("client", ["0.8.0", "0.8.1rc1", "0.8.1.dev0", "0.7.99", "0.1"])
def test_nnsight_below_the_minimum_is_refused_with_ndifs_message(client):
    assert refusal(client_versions.check_nnsight, client, "0.8.1") == (
        f"Client nnsight version {client} is below the minimum supported 0.8.1. "
        "Please `pip install --upgrade nnsight`."
    )


def test_versions_compare_as_versions_not_strings():
    # "0.10.0" < "0.9.0" as strings; as versions it is newer.
    client_versions.check_nnsight("0.10.0", "0.9.0")
    refusal(client_versions.check_nnsight, "0.9.0", "0.10.0")


@pytest.mark.parametrize("client", ["", None])
def test_missing_nnsight_version_is_refused(client):
    # A source-tree nnsight sends "", an old one no header at all.
    assert refusal(client_versions.check_nnsight, client, "0.8.1") == NOT_PROVIDED


@pytest.mark.parametrize("client", ["not-a-version", "0.8.x", "latest"])
def test_malformed_nnsight_version_is_refused(client):
    assert refusal(client_versions.check_nnsight, client, "0.8.1") == f"Malformed nnsight version '{client}'."


@pytest.mark.parametrize("client", ["", None, "garbage", "0.0.1"])
def test_no_minimum_no_nnsight_gate(client):
    client_versions.check_nnsight(client, "")


# -- python --

PY39 = "3.9.18 (main, Aug 24 2023, 21:19:58) [GCC 12.2.0]"
PY310 = "3.10.0 (default, Oct  4 2021, 00:00:00) [GCC 11.2.0]"
PY312 = "3.12.3 (main, Apr 10 2024, 05:33:47) [GCC 13.2.0]"


def test_python_below_the_minimum_is_refused_on_major_minor():
    assert refusal(client_versions.check_python, PY39, "3.10") == (
        "Client python version 3.9 is below the minimum supported 3.10. Please update python."
    )


@pytest.mark.parametrize("client", [PY310, PY312, "3.10.12", "3.10", "4.0.0 (x)"])
def test_python_at_or_above_the_minimum_passes(client):
    client_versions.check_python(client, "3.10")


def test_python_patch_of_the_minimum_is_ignored():
    # major.minor only: any 3.10.x meets a minimum of 3.10.5; 3.9 still does not.
    client_versions.check_python(PY310, "3.10.5")
    assert "3.9 is below the minimum supported 3.10.5" in refusal(client_versions.check_python, PY39, "3.10.5")


def test_python_missing_or_malformed_is_refused():
    assert refusal(client_versions.check_python, "", "3.10").startswith("Client python version was not provided.")
    assert refusal(client_versions.check_python, None, "3.10").startswith("Client python version was not provided.")
    assert refusal(client_versions.check_python, "CPython", "3.10") == "Malformed python version 'CPython'."


def test_no_minimum_no_python_gate():
    client_versions.check_python(PY39, "")
    client_versions.check_python(None, "")


def test_check_client_reads_both_headers_nnsight_first():
    headers = {"nnsight-version": "0.8.0", "python-version": PY39}
    assert "nnsight version 0.8.0" in refusal(client_versions.check_client, headers, "0.8.1", "3.10")
    headers["nnsight-version"] = "0.8.1"
    assert "python version 3.9" in refusal(client_versions.check_client, headers, "0.8.1", "3.10")
    client_versions.check_client(headers, "0.8.1", "3.9")
    client_versions.check_client({}, "", "")


# -- configuration --


def test_minimums_are_read_in_config(tmp_path):
    settings = config.load({"NDIF_HOME": str(tmp_path)})
    assert settings.min_nnsight_version == "" and settings.min_python_version == ""
    empty = config.load({"NDIF_HOME": str(tmp_path), "NDIF_MIN_NNSIGHT_VERSION": "", "NDIF_MIN_PYTHON_VERSION": " "})
    assert empty.min_nnsight_version == "" and empty.min_python_version == ""
    set_ = config.load({"NDIF_HOME": str(tmp_path), "NDIF_MIN_NNSIGHT_VERSION": "0.8.1", "NDIF_MIN_PYTHON_VERSION": "3.10"})
    assert set_.min_nnsight_version == "0.8.1" and set_.min_python_version == "3.10"
    with pytest.raises(ValueError, match="NDIF_MIN_NNSIGHT_VERSION must be a version"):
        config.load({"NDIF_HOME": str(tmp_path), "NDIF_MIN_NNSIGHT_VERSION": "newest"})
    with pytest.raises(ValueError, match="NDIF_MIN_PYTHON_VERSION must be a version"):
        config.load({"NDIF_HOME": str(tmp_path), "NDIF_MIN_PYTHON_VERSION": "three"})


# -- the web, without a stack --


def _web(tmp_path, **env):
    """The Flask app with its broker on a closed port: anything that reaches
    Redis answers 503, so a 400 proves the gate answered first."""
    from web.app import create_app

    base = {"NDIF_HOME": str(tmp_path), "NDIF_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
            "NDIF_REDIS_OUTAGE_S": "0"}
    return create_app(config.load({**base, **env})).test_client()


def _submit(client, headers):
    key = 'nnsight.modeling.transformers.TransformersModel:{"repo_id": "x/y", "revision": null, "task": "text-generation"}'
    envelope = json.dumps({"model_key": key, "session_id": "", "compress": False, "env": {}})
    return client.post("/request", data={"data": envelope, "blob": (io.BytesIO(b"x"), "request")},
                       headers=headers)


def test_web_refuses_before_touching_anything(tmp_path):
    client = _web(tmp_path, NDIF_MIN_NNSIGHT_VERSION="0.8.2", NDIF_MIN_PYTHON_VERSION="3.10")
    response = _submit(client, {"nnsight-version": "0.8.1", "python-version": sys.version})
    assert response.status_code == 400
    assert response.get_json() == {"detail": "Client nnsight version 0.8.1 is below the minimum supported 0.8.2. "
                                             "Please `pip install --upgrade nnsight`."}
    response = _submit(client, {"python-version": sys.version})
    assert response.status_code == 400 and response.get_json()["detail"] == NOT_PROVIDED
    # The farm's own nnsight (another version meets the runtime gate first, which may read Redis).
    response = _submit(_web(tmp_path, NDIF_MIN_PYTHON_VERSION="3.10"),
                       {"nnsight-version": client_versions.MAIN, "python-version": PY39})
    assert response.status_code == 400
    assert response.get_json()["detail"] == "Client python version 3.9 is below the minimum supported 3.10. Please update python."


def test_web_without_minimums_lets_any_client_through(tmp_path):
    # Past the gate, the request needs the broker, which is down here: 503, not 400.
    response = _submit(_web(tmp_path), {"nnsight-version": "", "python-version": "junk"})
    assert response.status_code == 503, response.get_json()
    assert "broker" in response.get_json()["detail"]


# -- the real client against real stacks --


# -- the runtimes served --


def test_another_version_is_refused_naming_it_and_the_versions_served():
    said = refusal(client_versions.check_runtime, "0.7.0", "0.8.1", lambda: {"0.8.1", "0.6.3"})
    assert said == ("This farm does not serve nnsight 0.7.0: a request runs only under the client's own nnsight "
                    "version, and this farm serves nnsight 0.6.3, 0.8.1. Install one of those "
                    "(`pip install nnsight==0.8.1`), or ask the farm's operator to add 0.7.0 "
                    "(`ndif-celery runtime add 0.7.0`).")
    asked = []
    client_versions.check_runtime("0.8.1", "0.8.1", lambda: asked.append(1) or set())
    client_versions.check_runtime("", "0.8.1", lambda: asked.append(1) or set())
    assert asked == [], "the farm's own version (or a source tree's empty one) reads nothing"
    client_versions.check_runtime("0.6.3", "0.8.1", lambda: {"0.8.1", "0.6.3"})
    # Its runtime added on this host, but no worker of it live: start one, not add it again.
    said = refusal(client_versions.check_runtime, "0.7.0", "0.8.1", lambda: {"0.8.1"}, lambda: {"0.7.0"})
    assert said.endswith("or ask the farm's operator to start a worker of it: its runtime is added but no worker "
                         "of it runs (`ndif-celery worker --nnsight 0.7.0`, or NDIF_RUNTIMES).") and \
        "runtime add" not in said, said


@pytest.mark.parametrize("version, bytecode, codec", [
    ("0.5.0", True, "zlib"), ("0.5.15", True, "zlib"), ("0.6.0", False, "zstd"), ("0.6.3", False, "zstd"),
    ("0.7.0", False, "zstd"), ("0.8.1", False, "zstd"), ("", False, "zstd")])
def test_a_05_client_sends_bytecode_zlibd(version, bytecode, codec):
    assert client_versions.sends_bytecode(version) is bytecode
    assert client_versions.payload_codec(version) == codec


def test_a_05_request_runs_only_where_a_worker_of_its_runtime_runs_its_python_minor():
    workers = {"a": {"nnsight": "0.5.15", "python": "3.11"}, "b": {"nnsight": "0.5.14", "python": "3.12"},
               "c": {"nnsight": "0.8.1", "python": "3.12"}}
    minors = client_versions.python_minors(workers, "0.5.15")
    assert minors == {"3.11"}
    client_versions.check_python_minor("0.5.15", "3.11.9 (main) [GCC 12]", minors)
    client_versions.check_python_minor("0.6.3", "3.12.1 (main) [GCC 12]", set())  # source: any minor
    said = refusal(client_versions.check_python_minor, "0.5.15", "3.12.1 (main) [GCC 12]", minors)
    assert said == (
        "This farm serves nnsight 0.5.15 on Python 3.11 only, and your client runs Python 3.12: an nnsight 0.5.15 "
        "request carries its code as Python bytecode, which runs only on the Python minor version that made it. "
        "Run your client on Python 3.11, or ask the farm's operator to add a runtime on your Python "
        "(`ndif-celery runtime add 0.5.15 --python /path/to/python3.12`) and start a worker of it.")
    assert "a Python version it did not say" in refusal(client_versions.check_python_minor, "0.5.15", "", minors)


@pytest.mark.parametrize("version", ["0.4.11", "0.3.7"])
def test_a_client_older_than_any_adapter_is_told_no_runtime_serves_it(version):
    said = refusal(client_versions.check_served_at_all, version)
    assert said.startswith(f"This farm does not serve nnsight {version}: clients before 0.5.0") and \
        "runtime add" not in said, said
    for served in ("0.5.0", "0.8.1", "", None):
        client_versions.check_served_at_all(served)


def test_the_versions_served_are_the_farms_and_each_live_workers(redis_client, embedded_settings):
    from web.app import create_app

    web = create_app(embedded_settings).test_client()
    headers = {"nnsight-version": "0.7.0", "python-version": sys.version}
    response = _submit(web, headers)
    assert response.status_code == 400
    assert response.get_json()["detail"].startswith(
        f"This farm does not serve nnsight 0.7.0: a request runs only under the client's own nnsight version, "
        f"and this farm serves nnsight {client_versions.MAIN}.")
    registry.register_worker(redis_client, {"name": "w7", "pid": 1, "nnsight": "0.7.0", "last_seen": time.time()})
    assert client_versions.served(registry.live_workers(redis_client), client_versions.MAIN) == {client_versions.MAIN, "0.7.0"}
    response = _submit(web, headers)
    assert response.status_code != 400 or "does not serve" not in response.get_json()["detail"], response.get_json()


def test_a_05_request_goes_to_the_runtime_of_its_python_minor(redis_client, embedded_settings):
    from ndif_celery import intake

    now = time.time()
    registry.register_worker(redis_client, {"name": "on311", "pid": 1, "nnsight": "0.5.15", "python": "3.11",
                                            "last_seen": now})
    registry.register_worker(redis_client, {"name": "on312", "pid": 2, "nnsight": "0.5.15+py3.12",
                                            "python": "3.12", "last_seen": now})

    def routed(nnsight: str, python: str) -> str:
        return intake.check_runtime(redis_client, embedded_settings,
                                    {"nnsight-version": nnsight, "python-version": f"{python} (main) [GCC 12]"})

    assert routed("0.5.15", "3.11.7") == "0.5.15"
    assert routed("0.5.15", "3.12.1") == "0.5.15+py3.12"
    said = refusal(routed, "0.5.15", "3.13.0")
    assert said.startswith("This farm serves nnsight 0.5.15 on Python 3.11, 3.12 only, and your client runs "
                           "Python 3.13"), said
    # A source payload runs on any minor: a 0.6 client ignores the minor runtimes.
    assert client_versions.runtime_for(registry.live_workers(redis_client), "0.6.3", "3.12.1") == "0.6.3"
    assert client_versions.served(registry.live_workers(redis_client), client_versions.MAIN) == {
        client_versions.MAIN, "0.5.15"}
    # Only the minor's own runtime is live: the plain one is not required.
    registry.unregister_worker(redis_client, "on311")
    assert routed("0.5.15", "3.12.1") == "0.5.15+py3.12"
