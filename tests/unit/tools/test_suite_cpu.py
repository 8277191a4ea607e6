"""``tools/suite_cpu.py``, the account of a command's CPU by kind of process
(it shows what to cut from a CPU-bound suite): it names every service by the
command line ``ndif-celery up`` really gives it, it sees the CPU a child of
the command burns, it hands the command's exit status on, and it states
the machine's speed beside the figures."""

from __future__ import annotations

import json
import subprocess
import sys

from ndif_celery import config
from ndif_celery.host import services
from tests.support.paths import ROOT

sys.path.insert(0, str(ROOT / "tools"))

import suite_cpu  # noqa: E402


def test_each_service_is_known_by_its_real_command_line(tmp_path):
    settings = config.load({"NDIF_HOME": str(tmp_path)})
    kinds = {service: suite_cpu.kind(" ".join(services.command(settings, service)))
             for service in ("web", "worker", "beat", "flower")}
    assert kinds == {"web": "web", "worker": "worker", "beat": "beat", "flower": "flower"}
    assert suite_cpu.kind(f"{sys.executable} -m ndif_celery.cli up --detach") == "cli"
    assert suite_cpu.kind(f"{sys.executable} -m workers.isolation.zygote 5 -1") == "zygote"
    assert suite_cpu.kind(f"{sys.executable} -m pytest -q -n 2") == "pytest"


def test_the_cpu_a_child_burns_is_counted_and_its_exit_status_kept(tmp_path):
    burn = "import sys, time\nstart = time.process_time()\nwhile time.process_time() - start < 1.0: pass\nsys.exit(3)"
    out = tmp_path / "cpu.json"
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "suite_cpu.py"), "--every", "0.1", "--out", str(out),
                             "--", sys.executable, "-c", burn], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stderr
    report = json.loads(out.read_text())
    # The child's second of CPU, less what ran after the last look before it exited (<= 0.1 s).
    assert report["by_kind"].get("other python", 0) >= 0.8, report
    assert report["busy_s"] >= 0.8 and report["wall_s"] >= 1.0, report
    assert "other python" in result.stderr and "busy" in result.stderr
    # The machine's speed, before and after; its own CPU is not the command's.
    before, after = report["calibration_s"]
    assert before > 0 and after > 0 and "calibration" in result.stderr, result.stderr
    assert report["by_kind"]["other python"] < 1.0 + 0.5 * min(before, after), report
