"""``ndif-celery version``: what this host has installed, one line each.

Python, ndif-celery, nnsight, torch (with its CUDA build and whether CUDA is
usable, asked through NVML so no CUDA context is made), transformers, celery,
flask, redis-py and the ``redis-server`` binary the embedded Redis would run.
The doctor's checks (``ndif_celery.host.doctor``) read the same facts, so the two
commands never disagree. Never raises: anything missing is reported as None.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from typing import Optional

from .embedded_redis import RedisServerNotFound, redis_server_binary

_DISTRIBUTIONS = (
    ("ndif-celery", "ndif-celery"), ("nnsight", "nnsight"), ("torch", "torch"),
    ("transformers", "transformers"), ("celery", "celery"), ("flask", "flask"), ("redis-py", "redis"),
)


def dist_version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def redis_server_version() -> tuple[Optional[str], str]:
    """(version, binary) of the ``redis-server`` the embedded Redis would run;
    version None (and the reason in place of the binary) when there is none."""
    try:
        binary = redis_server_binary()
    except RedisServerNotFound as exc:
        return None, str(exc)
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{binary}: {exc}"
    match = re.search(r"\bv=(\S+)", out)
    return (match.group(1) if match else out.strip() or "unknown"), binary


def cuda_available(torch) -> bool:
    """``torch.cuda.is_available()`` through NVML, which creates no CUDA context."""
    saved = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken driver is "not available" here
        return False
    finally:
        if saved is None:
            os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = saved


def versions() -> dict:
    """What ``ndif-celery version`` prints: each component's version, None if missing."""
    report: dict = {"python": sys.version.split()[0]}
    for label, dist in _DISTRIBUTIONS:
        report[label] = dist_version(dist)
    report["cuda"] = None
    report["cuda_available"] = False
    try:
        import torch  # here only: `ndif-celery version` must answer without torch, and fast

        report["cuda"] = torch.version.cuda
        report["cuda_available"] = cuda_available(torch) if torch.version.cuda else False
    except Exception:  # noqa: BLE001 - reported as torch's own check in doctor
        pass
    report["redis-server"], report["redis-server-binary"] = redis_server_version()
    if report["redis-server"] is None:
        report["redis-server-binary"] = None
    return report


def render_versions(report: dict) -> str:
    lines = []
    for name, value in report.items():
        if name in ("cuda_available", "redis-server-binary"):
            continue
        if name == "cuda":
            value = f"{value} ({'available' if report['cuda_available'] else 'not available'})" if value \
                else "none (CPU build of torch)"
        elif name == "redis-server" and value:
            value = f"{value} ({report['redis-server-binary']})"
        lines.append(f"{name:<14}{value or 'not installed'}")
    return "\n".join(lines)
