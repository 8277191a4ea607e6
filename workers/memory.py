"""A worker's memory budget for models, measured without touching CUDA.

CUDA must not be initialised in a process that will fork (the isolation path
forks per request), so GPU memory is read from ``nvidia-smi``, not torch.
"""

from __future__ import annotations

import shutil
import subprocess

from ndif_celery import config


def budget_bytes(settings: config.Settings) -> int:
    if settings.worker_memory_bytes > 0:
        return settings.worker_memory_bytes
    gpus = [g.strip() for g in settings.worker_gpus.split(",") if g.strip()]
    if gpus:
        measured = gpu_memory_bytes(gpus)
        if measured:
            return measured
    return host_memory_bytes() // 2


def gpu_memory_bytes(gpus: list[str]) -> int:
    """Total memory of the given GPUs per ``nvidia-smi`` (0 when it is not there)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return 0
    total = 0
    for line in out.splitlines():
        index, _, mib = line.partition(",")
        if index.strip() in gpus:
            total += int(float(mib)) * 1024 * 1024
    return total


def host_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def cached_repos() -> list[str]:
    """Model repos in this host's Hugging Face cache: COLD in ``/status``."""
    try:
        from huggingface_hub import scan_cache_dir

        return sorted(repo.repo_id for repo in scan_cache_dir().repos if repo.repo_type == "model")
    except Exception:  # noqa: BLE001 - no cache yet is not an error
        return []
