"""Environments for older nnsight clients, made from the package index once per test session.

A client of another version is made exactly as a runtime is
(``ndif_celery.host.runtimes.add``): its own nnsight (and what it needs, such
as python-socketio for 0.6/0.7) over this project's torch and transformers.
Its script runs in a subprocess with that interpreter, against the tests'
offline model cache, and prints one JSON line of what happened.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from ndif_celery.host import runtimes


def make(root: Path, version: str) -> Path:
    """The interpreter of a client environment with nnsight ``version``."""
    return runtimes.add(root, version, log=lambda line: None).interpreter


def run(python: Path, script: str, *args: str, timeout_s: float = 180) -> dict:
    """Run ``script`` under ``python`` with the offline cache; its last stdout line, as JSON."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NDIF_")}
    done = subprocess.run([str(python), "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    lines = [line for line in done.stdout.strip().splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise AssertionError(f"the client script failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])
