"""What a job's steps use of their worker, and nothing more.

The steps (``life``, ``gather``) take a :class:`JobContext`, not the whole
``workers.worker.WorkerState``: a reader following one job sees here every
member it may touch, and the steps never import the module that runs them.
``WorkerState`` is the one implementation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:
    import redis
    from celery import Celery

    from ndif_celery import config
    from ndif_celery.state import jobs, queues
    from ndif_celery.store import Store
    from workers.models.resident import ResidentModels

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
    batch: tuple  # the running job's co-batch (job ids)
    cancel_texts: dict  # job id -> the ERROR a cancel landing in its thread sends

    def executor_for(self, job: jobs.Job) -> Any:
        """In this process for a trusted key; a jailed child for an untrusted one."""

    def begin(self, job_id: str, pipe: Any) -> None:
        """Report the job as this worker's, on ``pipe``."""

    def take(self, waiting: list) -> list[jobs.Job]:
        """Take these waiting jobs as the running job's co-batch."""

    def take_next(self, waiting: queues.Waiting) -> Optional[jobs.Job]:
        """Take this waiting job as the worker's next one; None if another got it."""

    def end(self) -> None:
        """The job and its co-batch are answered: the worker runs nothing."""
