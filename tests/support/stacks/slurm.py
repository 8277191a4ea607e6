"""A one-node SLURM cluster on this machine, started by the test that needs it.

Debian's ``slurm-wlm`` and ``munge`` (``.ci/run`` installs them when missing):
a ``munged`` on its own socket and key, a ``slurmctld`` and a ``slurmd`` on
free loopback ports, all under one folder with their own ``slurm.conf``. A
process finds this cluster through ``SLURM_CONF`` (:attr:`SlurmCluster.env`),
so the machine's own SLURM setup, if any, is never touched. Root is needed:
``slurmd`` runs jobs as their user.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.support.stacks.servers import free_ports

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "squeue", "scancel", "scontrol", "sinfo")


def missing() -> str:
    """What this host lacks to run the cluster ("" when nothing)."""
    if os.geteuid() != 0:
        return "not root (slurmd runs jobs as their user)"
    absent = [name for name in DAEMONS + COMMANDS if not shutil.which(name)]
    return f"no {', '.join(absent)} on the PATH (Debian: slurm-wlm, munge)" if absent else ""


class SlurmCluster:
    def __init__(self, folder: Path, partition: str = "farm") -> None:
        self.folder = Path(folder)
        self.partition = partition
        self.conf = self.folder / "slurm.conf"
        self.node = socket.gethostname().split(".")[0]

    @property
    def env(self) -> dict:
        """What a process sets to use this cluster's commands."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self, timeout_s: float = 60) -> "SlurmCluster":
        folder = self.folder
        for sub in ("state", "spool", "log"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        key = folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        subprocess.run(["munged", "--force", f"--socket={folder / 'munge.sock'}", f"--key-file={key}",
                        f"--log-file={folder / 'log' / 'munged.log'}", f"--pid-file={folder / 'munged.pid'}",
                        f"--seed-file={folder / 'munged.seed'}"], check=True, capture_output=True, timeout=30)
        controller_port, node_port = free_ports(2)
        memory_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.8)
        self.conf.write_text("\n".join([
            "ClusterName=ndiftest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={controller_port}",
            f"SlurmdPort={node_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={folder / 'munge.sock'}",
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool'}",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'slurmd.pid'}",
            f"SlurmctldLogFile={folder / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={folder / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "ReturnToService=2",
            "SchedulerType=sched/backfill",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "InactiveLimit=0",
            "KillWait=10",
            "MinJobAge=300",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={memory_mb} State=UNKNOWN",
            f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n")
        env = {**os.environ, **self.env}
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([daemon, "-f", str(self.conf)], check=True, capture_output=True, env=env, timeout=30)
        deadline = time.monotonic() + timeout_s
        while self.run("sinfo", "--noheader", "--format=%t").stdout.strip() not in ("idle", "mix", "alloc"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the SLURM node did not come up within {timeout_s:.0f} s\n{self.logs()}")
            time.sleep(0.5)
        return self

    def run(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), capture_output=True, text=True, env={**os.environ, **self.env}, timeout=30)

    def queue(self) -> list[str]:
        """The jobs ``squeue`` lists: ``id|name|state``."""
        out = self.run("squeue", "--noheader", "--format=%i|%j|%T")
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]

    def until_empty(self, timeout_s: float = 90) -> None:
        """Until ``squeue`` lists nothing (an allocation ended, jobs cancelled)."""
        deadline = time.monotonic() + timeout_s
        while self.queue():
            if time.monotonic() > deadline:
                raise AssertionError(f"SLURM still lists {self.queue()} after {timeout_s:.0f} s\n{self.logs()}")
            time.sleep(0.5)

    def logs(self) -> str:
        return "\n".join(f"==> {path.name} <==\n{path.read_text(errors='replace')[-3000:]}"
                         for path in sorted((self.folder / "log").glob("*.log")))

    def stop(self) -> None:
        """Every job cancelled, then the daemons killed."""
        self.run("scancel", "--full", f"--partition={self.partition}")
        time.sleep(1)
        for name in ("slurmd", "slurmctld", "munged"):
            pid_file = self.folder / f"{name}.pid"
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
