"""What a job's steps use of their worker, and nothing more.

The steps (``life``, ``gather``) take a :class:`JobContext`, not the whole
``workers.worker.WorkerState``: a reader following one job sees here every
member it may touch, and the steps never import the module that runs them.
``WorkerState`` is the one implementation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import redis
    from celery import Celery

    from ndif_celery import config
    from ndif_celery.state import jobs
    from ndif_celery.store import Store
    from workers.models.resident import ResidentModels

    from .current import CurrentJob
    from .deliveries import Deliveries
    from .executors import InProcess


class JobContext(Protocol):
    """The worker as a job's steps see it: connections, models, the job slot."""

    name: str
    settings: config.Settings
    app: Celery
    redis: redis.Redis
    store: Store
    models: ResidentModels
    in_process: InProcess  # a co-batch runs there
    deliveries: Deliveries  # results sent while the next job runs
    slot: CurrentJob  # the job it runs now, its co-batch, kills' ERROR texts

    def executor_for(self, job: jobs.Job) -> Any:
        """In this process for a trusted key; a jailed child for an untrusted one."""
