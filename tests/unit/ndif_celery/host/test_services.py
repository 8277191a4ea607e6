"""Which services a single-host stack runs, and their command lines, from settings alone."""

from __future__ import annotations

import re

import pytest

from ndif_celery import config
from ndif_celery.host import services


def test_flower_port_0_leaves_flower_out(tmp_path):
    on = config.load({"NDIF_HOME": str(tmp_path)})
    off = config.load({"NDIF_HOME": str(tmp_path), "NDIF_FLOWER_PORT": "0"})
    assert services.default_services(on)[-1] == "flower"
    assert "flower" not in services.default_services(off)
    assert services.default_services(off)[:2] == ["redis", "web"]
    assert on.flower_url.endswith(":5555") and off.flower_url == ""  # the dashboard shows no link
    with pytest.raises(services.StackError, match="NDIF_FLOWER_PORT=0"):
        services.command(off, "flower")


def test_each_runtime_of_ndif_runtimes_gets_a_worker_of_its_own(tmp_path):
    settings = config.load({"NDIF_HOME": str(tmp_path), "NDIF_RUNTIMES": "0.7.0, 0.6.3",
                            "NDIF_WORKER_NAME": "gpu0@host"})
    listed = services.default_services(settings)
    assert listed[listed.index("worker"):listed.index("beat")] == ["worker", "worker-nnsight0.7.0",
                                                                     "worker-nnsight0.6.3"]
    # Each worker takes a third of the measured memory, and names its runtime.
    env = services.child_env(settings, base={}, service="worker-nnsight0.7.0")
    assert env["NDIF_WORKER_NNSIGHT"] == "0.7.0" and float(env["NDIF_WORKER_MEMORY_SHARE"]) == 1 / 3
    assert float(services.child_env(settings, base={}, service="worker")["NDIF_WORKER_MEMORY_SHARE"]) == 1 / 3
    assert "NDIF_WORKER_NNSIGHT" not in services.child_env(settings, base={}, service="worker")
    # A runtime not added on this host: the worker is not started, and the error says how to add it.
    with pytest.raises(services.StackError, match=r"no nnsight 0.7.0 runtime on this host; add it with "
                                                  r"`ndif-celery runtime add 0.7.0`"):
        services.command(settings, "worker-nnsight0.7.0")
    # Added (the record is what `runtime add` writes last): its interpreter runs the worker, under its own name.
    folder = tmp_path / "runtimes" / "nnsight-0.7.0"
    (folder / "bin").mkdir(parents=True)
    (folder / "runtime.json").write_text('{"version": "0.7.0", "python": "3.11", "packages": {"nnsight": "0.7.0"}}')
    argv = services.command(settings, "worker-nnsight0.7.0")
    assert argv[0] == str(folder / "bin" / "python")
    assert "--hostname=gpu0-nnsight0.7.0@host" in argv
    assert "--hostname=gpu0@host" in services.command(settings, "worker")


def test_ndif_runtimes_takes_exact_releases_only(tmp_path):
    for wrong in ("0.7", "0.5.15+py3", "0.5.15+cpu"):
        with pytest.raises(ValueError, match=f"NDIF_RUNTIMES lists runtimes by their exact nnsight release such as "
                                             f"0.7.0 .* got '{re.escape(wrong)}'"):
            config.load({"NDIF_HOME": str(tmp_path), "NDIF_RUNTIMES": wrong})
    said = config.load({"NDIF_HOME": str(tmp_path), "NDIF_RUNTIMES": "0.5.15,0.5.15+py3.12"})
    assert said.runtimes == ("0.5.15", "0.5.15+py3.12")
    assert [s for s in services.default_services(said) if s.startswith("worker-")] == [
        "worker-nnsight0.5.15", "worker-nnsight0.5.15+py3.12"]
    with pytest.raises(ValueError, match="NDIF_RUNTIME_PORTS lists VERSION=PORT pairs"):
        config.load({"NDIF_HOME": str(tmp_path), "NDIF_RUNTIME_PORTS": "0.7.0:8007"})
