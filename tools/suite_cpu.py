"""Where a command's CPU goes, by the kind of process that spent it.

Why: ``make test`` is CPU-bound on a 2-core machine (its time is the cores'
time), so cutting it starts with knowing which processes burn the
cores: the stacks' workers, webs, zygotes, the pytest processes, the CLI. The
per-test times of ``--durations`` cannot say that: a test's seconds include
waiting, and the other pytest process's load.

    python tools/suite_cpu.py [--every 0.25] [--out cpu.json] -- make test

Runs the command, and every ``--every`` seconds reads ``/proc``: each of
the command's processes has its CPU time (user + system) since the last look
added to its kind
(:func:`kind`, from its command line as it is *now*, since a service is
forked by the CLI before it execs; what forks without exec, the worker's
fork server and the zygotes and jailed children forked from it, counts as
the worker). The command's processes are those whose environment holds
this run's ``SUITE_CPU_RUN`` mark (it survives forks, execs and daemons
that detach) and those whose parent is one of them when first seen (a
zygote or a jailed child, started with a cleaned environment); so other
work on the machine does not count. At the end (or on Ctrl-C) it prints
the command's CPU seconds, each kind's share, and the machine's busy
seconds from ``/proc/stat`` over the same wall time; the gap is other work
and what no look saw (a process that lived and died between two looks, or
the CPU a process spent after its last look), and the machine's speed
before and after (the CPU-s of ``python -c "sum(range(10**8))"``: a
command's CPU-s grow on a slower or busier host, so two figures compare only
beside their calibrations). Linux only.
The command's exit status is this script's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from typing import Optional

HZ = os.sysconf("SC_CLK_TCK")

# (what the command line holds, the kind): the first match wins.
KINDS = (
    (("gunicorn",), "web"),
    (("celery", " beat"), "beat"),
    (("celery", " flower"), "flower"),  # before the worker: Flower's app is workers.tasks too
    (("celery", " worker"), "worker"),
    (("tests.support.stacks.launcher",), "worker"),  # the tests' warm launcher and the workers it forks
    (("workers.isolation.zygote",), "zygote"),
    (("redis-server",), "redis"),
    (("ndif_celery.cli",), "cli"),
    (("ndif-celery",), "cli"),
    (("bench/",), "bench"),
    (("moto",), "moto"),
    (("chrom",), "chromium"),
    (("pytest",), "pytest"),
    (("-c", "import sys;exec(eval(sys.stdin.readline()))"), "pytest"),  # a pytest-xdist process
    (("postgres",), "postgres"),
    (("python",), "other python"),
)


def kind(cmdline: str) -> str:
    """The kind of a process, by its command line (arguments joined by spaces)."""
    for needles, name in KINDS:
        if all(needle in cmdline for needle in needles):
            return name
    return "other"


def _busy_s() -> float:
    """The machine's busy CPU seconds since boot (all but idle and iowait)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / HZ


MARK = "SUITE_CPU_RUN"


def _marked(pid: str, mark: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            return mark in environ.read().split(b"\0")
    except OSError:
        return False


def _look() -> dict:
    """(pid, start time) -> (CPU seconds, command line, parent pid) of every process now."""
    seen = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as stat:
                raw = stat.read()
            with open(f"/proc/{pid}/cmdline", "rb") as cmd:
                cmdline = cmd.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) "
        seen[(pid, fields[19])] = ((int(fields[11]) + int(fields[12])) / HZ, cmdline, fields[1])
    return seen


class Sampler:
    """Adds up the CPU of the processes that carry ``mark`` or descend from one."""

    def __init__(self, mark: str) -> None:
        self.mark = mark.encode()
        self.by_kind: collections.Counter = collections.Counter()
        self.ours: dict = {}  # (pid, start time) -> whether it is the command's
        self.last: dict = {}
        self.busy0, self.wall0 = _busy_s(), time.monotonic()

    def _is_ours(self, key: tuple, ppid: str, now: dict) -> bool:
        if key not in self.ours:
            parents = [k for k in now if k[0] == ppid]
            self.ours[key] = _marked(key[0], self.mark) or any(self.ours.get(k, False) for k in parents)
        return self.ours[key]

    def look(self) -> None:
        now = _look()
        # parents first, so that a child seen in the same look as its parent is judged after it
        for key in sorted(now, key=lambda k: int(k[1])):
            cpu, cmdline, ppid = now[key]
            if self._is_ours(key, ppid, now):
                self.by_kind[kind(cmdline)] += cpu - self.last.get(key, 0.0)
        self.last = {key: cpu for key, (cpu, _, _) in now.items()}
        self.ours = {key: ours for key, ours in self.ours.items() if key in now}

    def report(self) -> dict:
        seen = sum(self.by_kind.values())
        busy = _busy_s() - self.busy0
        return {"wall_s": round(time.monotonic() - self.wall0, 1), "busy_s": round(busy, 1),
                "cores": os.cpu_count(), "total_s": round(seen, 1), "unseen_s": round(max(0.0, busy - seen), 1),
                "by_kind": {name: round(cpu, 1) for name, cpu in self.by_kind.most_common()}}


CALIBRATION = "sum(range(10**8))"


def calibration_s() -> float:
    """CPU seconds of ``python -c "sum(range(10**8))"`` in a fresh interpreter:
    this machine's speed now (a busy or slower host takes longer for the same
    work, and so would the measured command)."""
    code = f"import os; t = os.times(); {CALIBRATION}; u = os.times(); print(u.user - t.user + u.system - t.system)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return round(float(out), 2)


def table(report: dict) -> str:
    total = report["total_s"] or 1.0
    lines = [f"wall {report['wall_s']:.0f} s, the command's CPU {report['total_s']:.0f} s; the machine busy "
             f"{report['busy_s']:.0f} CPU-s of {report['wall_s'] * report['cores']:.0f} on {report['cores']} cores"]
    if "calibration_s" in report:
        before, after = report["calibration_s"]
        lines.append(f"calibration (python -c \"{CALIBRATION}\"): {before:.2f} CPU-s before, {after:.2f} after")
    for name, cpu in report["by_kind"].items():
        lines.append(f"{cpu:9.1f} CPU-s {100 * cpu / total:5.1f} %  {name}")
    lines.append(f"{report['unseen_s']:9.1f} CPU-s          "
                 "(no look counted it: other work on the machine, short-lived processes, kernel)")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=0.25, help="seconds between two looks at /proc")
    parser.add_argument("--out", help="also write the report as JSON here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    before = calibration_s()  # not the command's: it carries no mark
    mark = f"{os.getpid()}-{time.time_ns()}"
    sampler = Sampler(f"{MARK}={mark}")
    proc = subprocess.Popen(command, env={**os.environ, MARK: mark})
    try:
        while proc.poll() is None:
            time.sleep(args.every)
            sampler.look()
    except KeyboardInterrupt:
        proc.wait()
    report = sampler.report()
    report["calibration_s"] = [before, calibration_s()]
    print(table(report), file=sys.stderr)
    if args.out:
        with open(args.out, "w") as out:
            json.dump(report, out, indent=1)
    return proc.returncode if proc.returncode is not None else 1


if __name__ == "__main__":
    sys.exit(main())
