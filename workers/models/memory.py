"""A worker's memory budget for models, measured without touching CUDA; what its model cache holds.

CUDA must not be initialised in a process that will fork (the isolation path
forks per request), so GPU memory is read from ``nvidia-smi``, not torch.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from ndif_celery import config


def budget_bytes(settings: config.Settings) -> int:
    """NDIF_WORKER_MEMORY_GIB, else this worker's share of its GPUs' memory, or of half the RAM."""
    if settings.worker_memory_bytes > 0:
        return settings.worker_memory_bytes
    share = min(1.0, settings.worker_memory_share)
    gpus = [g.strip() for g in settings.worker_gpus.split(",") if g.strip()]
    if gpus:
        measured = gpu_memory_bytes(gpus)
        if measured:
            return int(measured * share)
    return int(host_memory_bytes() // 2 * share)


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


def cached_repos(settings: config.Settings | None = None) -> list[str]:
    """Models in this host's Hugging Face cache that a user could run: COLD in ``/status``.

    Only real models (a snapshot whose ``config.json`` names a model type: a
    PEFT adapter or a dataset is not one), and with ``NDIF_MODELS`` set only
    those it allows, so ``/status`` never offers what the farm would refuse."""
    from ndif_celery.policy import model_policy

    policy = model_policy.ModelPolicy.from_settings(settings) if settings is not None else model_policy.ModelPolicy()
    try:
        from huggingface_hub import scan_cache_dir

        repos = scan_cache_dir().repos
    except Exception:  # noqa: BLE001 - no cache yet is not an error
        return []
    runnable = set()
    for repo in repos:
        if repo.repo_type != "model" or (policy.models and not model_policy.matches(repo.repo_id, policy.models)):
            continue
        if any(model_policy.is_model_snapshot(revision.snapshot_path) for revision in repo.revisions):
            runnable.add(repo.repo_id)
    return sorted(runnable)


def cached_refs(repo_id: str) -> dict:
    """``repo_id``'s branches and tags in this host's model cache -> the commit
    each points at (``refs/main``, ``refs/v1``, ``refs/pr/1``): how the web
    knows two revisions name the same weights (``registry.record_refs``)."""
    from huggingface_hub import constants, file_download

    from ndif_celery.policy.model_policy import COMMIT

    root = os.path.join(constants.HF_HUB_CACHE, file_download.repo_folder_name(repo_id=repo_id, repo_type="model"),
                        "refs")
    refs = {}
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                with open(os.path.join(folder, name)) as f:
                    sha = f.read().strip()
            except OSError:
                continue
            if COMMIT.fullmatch(sha):
                refs[os.path.relpath(os.path.join(folder, name), root)] = sha
    return refs
