"""``ndif-celery runtime add|list|remove``, run for real: nnsight 0.7.0 from
the package index into its own environment under a temporary NDIF_HOME,
beside the farm's own nnsight, holding the farm's torch and transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

from tests.support.clients import client_envs
from tests.support.stacks.stack import ROOT

OLD = "0.7.0"


def _cli(home, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NDIF_")}
    env["NDIF_HOME"] = str(home)
    result = subprocess.run([sys.executable, "-m", "ndif_celery.cli", "runtime", *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    assert (result.returncode == 0) == ok, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("runtimes")


def test_a_runtime_is_added_checked_and_listed_beside_the_farms_own(home):
    said = _cli(home, "add", OLD).stdout
    torch, transformers = metadata.version("torch"), metadata.version("transformers")
    assert f"nnsight {OLD}: ready at {home}/runtimes/nnsight-{OLD}" in said
    assert f"torch {torch}, transformers {transformers}" in said
    python = home / "runtimes" / f"nnsight-{OLD}" / "bin" / "python"
    seen = subprocess.run([str(python), "-c", "import json, nnsight, torch, transformers, ndif_celery; "
                           "print(json.dumps([nnsight.__version__, torch.__version__, transformers.__version__, "
                           "torch.__file__]))"], capture_output=True, text=True, timeout=300, check=True)
    nnsight_version, torch_version, transformers_version, torch_file = json.loads(seen.stdout)
    assert (nnsight_version, torch_version, transformers_version) == (OLD, torch, transformers)
    assert not torch_file.startswith(str(home)), "the farm's torch, not a copy in the runtime"
    rows = json.loads(_cli(home, "list", "--json").stdout)
    assert [(r["version"], r["main"], r["ok"]) for r in rows] == [(metadata.version("nnsight"), True, True),
                                                                 (OLD, False, True)]
    assert rows[1]["packages"] == {"nnsight": OLD, "torch": torch, "transformers": transformers}
    assert "the farm's own" in _cli(home, "list").stdout
    assert "ready" in _cli(home, "add", OLD).stdout, "adding it again keeps the good one"


def test_what_is_not_a_runtime_is_refused_by_name(home):
    assert "is the farm's own" in _cli(home, "add", metadata.version("nnsight"), ok=False).stderr
    assert "one exact nnsight release such as 0.7.0, got '0.7'" in _cli(home, "add", "0.7", ok=False).stderr
    assert "Install nnsight 0.5.0 or later" in _cli(home, "add", "0.4.11", ok=False).stderr
    failed = _cli(home, "add", "0.5.999", ok=False).stderr
    assert "could not install nnsight==0.5.999" in failed
    assert not (home / "runtimes" / "nnsight-0.5.999").exists(), "nothing half-made is left"
    broken = home / "runtimes" / "nnsight-0.6.3"
    broken.mkdir(parents=True)
    assert "BROKEN" in _cli(home, "list").stdout
    assert "removed" in _cli(home, "remove", "0.6.3").stdout and not broken.exists()


def test_a_runtime_is_removed(home):
    assert f"nnsight {OLD}: removed" in _cli(home, "remove", OLD).stdout
    assert [r["version"] for r in json.loads(_cli(home, "list", "--json").stdout)] == [metadata.version("nnsight")]
    assert "no nnsight 0.7.0 runtime on this host" in _cli(home, "remove", OLD, ok=False).stderr


def test_another_interpreter_is_asked_its_minor_and_used_only_for_a_bytecode_client(home):
    assert "cannot run the interpreter '/nonexistent/python3.12'" in _cli(
        home, "add", "0.5.15", "--python", "/nonexistent/python3.12", ok=False).stderr
    assert "is not a Python interpreter" in _cli(home, "add", "0.5.15", "--python", "/bin/false", ok=False).stderr
    other = client_envs.other_python()
    if other is None:
        pytest.skip("no interpreter of another Python minor on this host")
    said = _cli(home, "add", "0.6.3", "--python", other, ok=False).stderr
    assert "nnsight 0.6.3 clients send source, which runs on any Python" in said, said
    assert not list((home / "runtimes").glob("nnsight-0.6.3*")), "nothing is made"
