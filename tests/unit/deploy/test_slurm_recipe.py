"""``deploy/slurm/ndif-worker.sbatch`` checked offline: valid bash, the worker
started with arguments the CLI takes, named as the launcher finds it, told
before its time limit, and given the time to finish its job. The script runs
for real on a one-node cluster in ``tests/e2e/farm/test_slurm.py``."""

from __future__ import annotations

import re
import subprocess

from ndif_celery.farm import elastic
from tests.support.stacks.deploy_recipes import ROOT, parse_cli

SCRIPT = ROOT / "deploy" / "slurm" / "ndif-worker.sbatch"


def test_the_script_is_valid_bash_and_executable():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    assert SCRIPT.stat().st_mode & 0o111


def test_the_worker_runs_with_arguments_the_cli_takes():
    text = SCRIPT.read_text()
    assert re.search(r'^exec "\$FARM_CLI" worker "\$@"$', text, re.M), "the worker is the job's process"
    assert parse_cli(["worker", "--nnsight", "0.7.0"]).params["nnsight_version"] == "0.7.0"  # what a launch passes


def test_the_worker_is_named_as_the_launcher_finds_it_and_gets_the_allocated_gpus():
    text = SCRIPT.read_text()
    name = re.search(r'NDIF_WORKER_NAME="(slurm)\$\{SLURM_JOB_ID\}@', text)
    assert name and elastic.worker_of("42", name.group(1), {"slurm42@node7": {}}) == "slurm42@node7"
    assert 'NDIF_WORKER_GPUS="${CUDA_VISIBLE_DEVICES:-}"' in text


def test_the_time_limit_ends_in_a_warm_shutdown():
    text = SCRIPT.read_text()
    warned = re.search(r"^#SBATCH --signal=B:TERM@(\d+)$", text, re.M)
    assert warned and int(warned.group(1)) >= 60, "SIGTERM to the batch shell, a while before the limit"
