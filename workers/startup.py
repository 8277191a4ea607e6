"""The worker process's first steps, at Celery's ``worker_init``, in order.

1. :func:`set_environment`: this worker's GPUs (``CUDA_VISIBLE_DEVICES``) and
   torch's thread count (``OMP_NUM_THREADS``, inherited by isolated children),
   set before anything imports torch;
2. :func:`start_fork_server` (``NDIF_ISOLATION=fork``): the fork server forked
   while the process is still clean: no Redis, store or database client
   opened, no job run, no CUDA (``workers.isolation.forkserver``).

Done here rather than when ``workers.tasks`` is imported: beat and Flower
import that module too, and an import should not edit the environment.
This module imports no torch (the fork server's module, which does, is
imported only when there is a fork server to start).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from ndif_celery import config

log = logging.getLogger("ndif_celery.worker")


def untrusted_jobs_possible(settings: config.Settings) -> bool:
    """Auth on (keys not tagged trusted), or every request untrusted."""
    return settings.auth or not settings.default_trusted


def set_environment(settings: config.Settings) -> None:
    """What torch reads from the environment, before it is imported."""
    if settings.worker_gpus:
        # Before anything imports torch: this process sees only its own GPUs.
        os.environ["CUDA_VISIBLE_DEVICES"] = settings.worker_gpus
    if settings.torch_threads:
        # Before torch starts its thread pools (isolated children inherit it too).
        os.environ["OMP_NUM_THREADS"] = str(settings.torch_threads)


def start_fork_server(settings: config.Settings) -> Optional[Any]:
    """NDIF_ISOLATION=fork, when untrusted jobs can come: fork the fork server
    now, from the main thread. Its zygotes fork the isolated children. Without
    it, untrusted jobs are refused. Returns it, or None."""
    if settings.isolation != "fork" or not untrusted_jobs_possible(settings):
        return None
    # Imported only now, after set_environment: it imports torch (through the zygote's child side).
    from .isolation import forkserver
    from .isolation.zygote import ENV_KEEP

    try:
        return forkserver.start(settings.secrets(), ENV_KEEP)
    except Exception:  # noqa: BLE001 - untrusted jobs will say so; trusted ones still run
        log.exception("could not start the fork server; untrusted jobs will be refused")
        return None


def stop_fork_server(server: Optional[Any]) -> None:
    """Stop the fork server :func:`start_fork_server` started, if any."""
    if server is None:
        return
    from .isolation import forkserver

    forkserver.stop()
