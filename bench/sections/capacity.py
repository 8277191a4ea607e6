"""The capacity section: ``bench/capacity.py`` run as a process of its own,
its table printed in this run and its JSON (with its checks) kept in this
run's, so its targets join the PASS/FAIL lines (``checks``).

A module of its own because it measures nothing itself: the capacity bench
holds thousands of sockets and raises its open-files limit, which this
process must not share.
"""

from __future__ import annotations

import json
import subprocess
import sys

from bench.plan import ROOT


class CapacitySection:
    """Mixin of ``bench.core.Bench``: ``capacity()``."""

    def capacity(self) -> None:
        """``bench/capacity.py`` (N waiting /subscribe sockets on a stack of its
        own: N = 1,000 / 5,000 / 10,000, 200 with --smoke), run as a process of
        its own (it raises its open-files limit and holds thousands of sockets);
        its table is printed here and its targets join this run's."""
        out = self.json_path.with_name(self.json_path.stem + "-capacity.json")
        command = [sys.executable, str(ROOT / "bench" / "capacity.py"), "--out", str(out), "--hf-home", str(self.hf_home)]
        command += ["--smoke"] if self.args.smoke else []
        for item in self.args.stack_env:
            command += ["--stack-env", item]
        self.emit("\n== capacity: waiting /subscribe sockets held on one web host (bench/capacity.py)")
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        self.emit("\n".join(line for line in proc.stdout.splitlines() if not line.startswith(("JSON:", "\x1b", "\r"))))
        if proc.returncode != 0 or not out.exists():
            self.out["workloads"]["capacity"] = {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
            return
        self.out["workloads"]["capacity"] = json.loads(out.read_text())
