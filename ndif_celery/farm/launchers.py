"""Launchers: how the farm asks a cluster's scheduler for a worker.

A launcher does three things: submit one worker, say what the scheduler
says of its launches, cancel one. SLURM is the one built; a Kubernetes or
cloud launcher is another class with the same three methods. When to launch
is not theirs to decide (``ndif_celery.farm.elastic``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

from ndif_celery import config
from ndif_celery.state.launches import ENDED, PENDING, RUNNING

#: The name every launched worker's job carries: the launcher lists its own by it.
JOB_NAME = "ndif-worker"
#: The states squeue may still list a job in after it ended.
FINISHED = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
                      "DEADLINE", "OUT_OF_MEMORY", "SPECIAL_EXIT"})
SCHEDULER_TIMEOUT_S = 30.0


class LaunchRefused(Exception):
    """The scheduler refused a launch; the message is its own words."""


@dataclass(frozen=True)
class LaunchState:
    state: str  # PENDING, RUNNING or ENDED
    reason: str = ""  # the scheduler's reason: why it waits, or how it ended


class Launcher(Protocol):
    name: str

    def submit(self, worker_args: list[str]) -> str: ...

    def states(self, launch_ids: list[str]) -> dict[str, LaunchState]: ...

    def cancel(self, launch_id: str) -> None: ...


def for_settings(settings: config.Settings) -> Launcher:
    if settings.launcher == "slurm":
        return SlurmLauncher(settings)
    raise ValueError(f"no launcher named {settings.launcher!r}")


class SlurmLauncher:
    """Workers as SLURM batch jobs of ``NDIF_SLURM_SCRIPT`` (``deploy/slurm/``)."""

    name = "slurm"

    def __init__(self, settings: config.Settings) -> None:
        self.settings = settings

    def submit(self, worker_args: list[str]) -> str:
        settings = self.settings
        if not Path(settings.slurm_script).is_file():
            raise LaunchRefused(f"NDIF_SLURM_SCRIPT {settings.slurm_script} is not a file")
        self._log("").parent.mkdir(parents=True, exist_ok=True)
        argv = ["sbatch", "--parsable", f"--job-name={JOB_NAME}", f"--time={settings.slurm_time_limit}",
                f"--output={self._log('%j')}"]
        if settings.slurm_partition:
            argv.append(f"--partition={settings.slurm_partition}")
        if settings.slurm_account:
            argv.append(f"--account={settings.slurm_account}")
        if settings.launch_gpus:
            argv.append(f"--gpus={settings.launch_gpus}")
        argv += [str(settings.slurm_script), *worker_args]
        out = self._run(argv, self._worker_env())
        if out.returncode != 0:
            raise LaunchRefused(_said(out) or f"sbatch exited {out.returncode}")
        return out.stdout.strip().split(";")[0]

    def states(self, launch_ids: list[str]) -> dict[str, LaunchState]:
        """Each launch as ``squeue`` lists it; one it no longer lists has ended
        (``scontrol`` says how while SLURM remembers it)."""
        if not launch_ids:
            return {}
        out = self._run(["squeue", "--noheader", f"--name={JOB_NAME}", "--format=%i|%T|%r"])
        if out.returncode != 0:
            raise LaunchRefused(_said(out) or f"squeue exited {out.returncode}")
        listed = {}
        for line in out.stdout.splitlines():
            job_id, _, rest = line.strip().partition("|")
            state, _, reason = rest.partition("|")
            if state not in FINISHED:  # squeue lists a finished job for a moment: scontrol says how
                listed[job_id] = LaunchState(PENDING if state == "PENDING" else RUNNING, _reason(reason))
        return {job_id: listed.get(job_id) or self._ended(job_id) for job_id in launch_ids}

    def cancel(self, launch_id: str) -> None:
        out = self._run(["scancel", launch_id])
        if out.returncode != 0:
            raise LaunchRefused(_said(out) or f"scancel exited {out.returncode}")

    def _ended(self, job_id: str) -> LaunchState:
        """How it ended, as SLURM remembers it (``MinJobAge``), and where its log is."""
        out = self._run(["scontrol", "show", "job", job_id, "--oneliner"])
        fields = dict(part.split("=", 1) for part in out.stdout.split() if "=" in part)
        state, reason = fields.get("JobState", ""), fields.get("Reason", "")
        said = " ".join(part for part in (state, _reason(reason)) if part)
        return LaunchState(ENDED, f"{said or 'ended'} (its log: {self._log(job_id)})")

    def _log(self, job_id: str) -> Path:
        return self.settings.home / "logs" / f"slurm-{job_id}.log"

    def _worker_env(self) -> dict:
        """What a launched worker starts with: ``sbatch`` exports its own environment to the job."""
        env = {k: v for k, v in os.environ.items() if k not in ("NDIF_WORKER_NAME", "NDIF_WORKER_GPUS")}
        env["NDIF_WORKER_IDLE_EXIT_S"] = repr(self.settings.launch_idle_s)
        env["NDIF_HOME"] = str(self.settings.home)
        env["NDIF_REDIS_URL"] = self.settings.redis_url
        # The worker runs the farm's own CLI, beside this interpreter.
        cli = Path(sys.executable).parent / "ndif-celery"
        env.setdefault("FARM_CLI", str(cli) if cli.exists() else "ndif-celery")
        return env

    def _run(self, argv: list[str], env: Optional[dict] = None) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=SCHEDULER_TIMEOUT_S)
        except FileNotFoundError:
            raise LaunchRefused(f"{argv[0]} is not on this host's PATH: the beat runs where SLURM's "
                                f"commands are") from None
        except subprocess.TimeoutExpired:
            raise LaunchRefused(f"{argv[0]} gave no answer within {SCHEDULER_TIMEOUT_S:.0f} s") from None


def _reason(raw: str) -> str:
    """SLURM's reason field, empty where it has none."""
    return "" if raw in ("None", "(null)") else raw


def _said(out: subprocess.CompletedProcess) -> str:
    """The scheduler's last error line, as it wrote it."""
    lines = [line.strip() for line in (out.stderr or out.stdout or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""
