"""What lives for the whole worker process, and what it does besides jobs.

:class:`WorkerState` holds the worker's connections (Redis, the result
store), its resident models, its two executors, its delivery thread
(``workers.job.deliveries``), its job slot (``workers.job.current``: the job
it runs now, for ``ndif-celery kill`` and the watchdog), its controller and
the ledger's drainer; it registers the worker and beats its heart. Its
methods are what the Celery tasks and signals of ``workers.tasks`` do: run a
job (``workers.job.life``), load and evict models, sweep expired jobs, get
ready, shut down. One object, made once per process (``tasks.ThisWorker``),
so nothing here is a module global.

This module imports torch (through the resident models and the executors):
``workers.tasks`` imports it only once the worker's environment is set
(``CUDA_VISIBLE_DEVICES``, ``OMP_NUM_THREADS``) and its fork server forked.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional

import torch
from celery import Celery
from sqlalchemy.exc import SQLAlchemyError

from ndif_celery import config, messages, statuses, wire
from ndif_celery.accounts import db, ledger
from ndif_celery.celery_app import queue_for
from ndif_celery.exit_codes import EX_CONFIG, REPLACE_EXIT_CODE
from ndif_celery.farm.controller import Controller, fail_waiting
from ndif_celery.host.environment import local_env
from ndif_celery.monitoring import metrics as farm_metrics
from ndif_celery.policy import client_versions, model_policy
from ndif_celery.state import expiry
from ndif_celery.state import jobs, queues, registry
from ndif_celery.store import FilesystemStore, open_store
from ndif_celery.store.fs import NotShared, check_shared

from . import cuda, metrics, quantized
from .execute import RequestError
from .isolation import parent
from .job import deadline
from .job import gather
from .job import life
from .job.current import CurrentJob
from .job.deliveries import Deliveries
from .job.executors import InProcess, Isolated, JobCancelled, JobTimedOut
from .models import memory
from .models.resident import ResidentModels
from .startup import untrusted_jobs_possible

log = logging.getLogger("ndif_celery.worker")

#: What a stopping worker waits for its delivery thread (a job not delivered by then is rescued by the watchdog).
SHUTDOWN_DELIVERY_S = 2.0


class WorkerState:
    """What lives for the whole worker process: connections, store, resident models."""

    def __init__(self, name: str, settings: config.Settings, app: Celery) -> None:
        self.name = name
        self.settings = settings
        self.app = app
        self.redis = jobs.connect(settings.redis_url, settings.redis_outage_s)
        self.store = open_store(settings)
        self.models = ResidentModels(verify_untrusted=settings.verify_untrusted,
                                     trusted_check_every=settings.trusted_check_every,
                                     torch_threads=settings.torch_threads)
        # The deadline of every job, and `ndif-celery kill`: answers, interrupts, replaces this process if stuck.
        self.deadlines = deadline.DeadlineWatchdog(settings.execution_timeout_s, settings.deadline_grace_s,
                                           (JobTimedOut, JobCancelled), self.replace)
        self.in_process = InProcess(settings, self.models, self.deadlines, self.job_waiting)
        # Results delivered while the next job runs (workers.job.deliveries).
        self.deliveries = Deliveries(lambda done, result: life.answer(self, done, result),
                                     lambda done: life.close(self, done))
        self.isolated = Isolated(settings, self.models, self.deadlines)
        self.info: dict = {"name": name, "host": socket.gethostname(), "pid": os.getpid()}
        self._entry_lock = threading.Lock()  # one writer of this worker's registry entry at a time
        # The job it runs now (workers.job.current): the watchdog and `ndif-celery kill` read it.
        self.slot = CurrentJob(self.redis, name, settings.job_ttl_s, self._entry_lock, self.registration)
        self.controller: Optional[Controller] = None
        self.drainer: Optional[ledger.Drainer] = None
        self._ledger_engine = None  # opened by the first cleanup that prunes the ledger
        self.idle_since = time.monotonic()  # NDIF_WORKER_IDLE_EXIT_S: nothing ran or waited since
        self.leaving = False

    # --- jobs -------------------------------------------------------------------

    def run(self, job: jobs.Job) -> None:
        """One job, or a co-batch led by it (``workers.job.gather``: a trusted job
        with ``NDIF_COBATCH_MAX`` > 1 gathers its model's waiting trusted jobs);
        then, while the head of its model's queue is a job this worker would
        run next anyway, that job at once, without a trip through Celery
        (``gather.next_job``)."""
        chained = 0
        while job is not None:
            ran = life.run(self, job, perform=gather.perform if gather.may_gather(self, job) else life.perform)
            if self.slot.job_id == job.id:  # taken as the next job, then skipped (it had ended): not running
                self.slot.end()
            if not ran:  # sent back to its queue: back to Celery, not round again
                return
            chained += 1
            try:
                job = gather.next_job(self, job, chained)
            except Exception:  # noqa: BLE001 - the broker away: back to Celery, which retries it
                log.warning("could not look for the next job; back to Celery", exc_info=True)
                job = None

    def executor_for(self, job: jobs.Job):
        """In this process for a trusted key; a jailed child for an untrusted one."""
        return self.in_process if job.trusted else self.isolated

    def registration(self) -> dict:
        """This worker's registry entry: what it holds, the job it runs, that
        job's co-batch, and the jobs whose results its delivery thread still sends."""
        return dict(self.info, models=self.models.keys(), **self.slot.entry(),
                    delivering=self.deliveries.delivering())

    def job_waiting(self, model_key: str) -> bool:
        """Whether a job waits in the model's queue (one round trip)."""
        pipe = self.redis.pipeline(transaction=False)
        for name in queues.lists(queue_for(model_key)):
            pipe.llen(name)
        return any(pipe.execute())

    def cancel(self, job_id: str, text: str = messages.CANCELLED, reason: type = JobCancelled) -> bool:
        """``ndif-celery kill`` (or the job's owner, or its client gone; ``text``
        is the ERROR its client reads): a job in its executor is answered at once and
        interrupted by the watchdog (``workers.job.deadline``: replaced if stuck);
        in any other step, it is interrupted at its next Python instruction,
        unless a co-batch is being answered (an interruption would land in
        another user's delivery): then ``ndif-celery kill`` answers it itself."""
        if self.deadlines.kill(job_id, text) or self.deliveries.cancel(job_id, text):
            return True
        return self.slot.cancel(job_id, text, reason)

    def replace(self, job_id: str, why: str, exit: Callable[[int], None] = os._exit) -> None:
        """The job's thread is stuck in code no exception can reach: let go of
        what this process holds and exit with ``REPLACE_EXIT_CODE`` for a fresh one.

        Its registry entry and deployments go first (the controller then places
        the model on the fresh process), then its isolation children; all
        within :data:`deadline.CLEANUP_S`, since a broker away must not keep a stuck worker."""
        log.error("replacing this worker: job %s did not unwind %s (user code blocked where no exception "
                  "reaches it); exiting with status %d for a fresh process", job_id, why, REPLACE_EXIT_CODE)

        def let_go() -> None:
            try:
                farm_metrics.worker_replaced(self.redis, self.name)
            except Exception:  # noqa: BLE001
                log.warning("could not count the replacement", exc_info=True)
            self.shutdown()

        helper = threading.Thread(target=let_go, name="ndif-replace", daemon=True)
        helper.start()
        helper.join(deadline.CLEANUP_S)
        for handler in logging.getLogger().handlers + log.handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        exit(REPLACE_EXIT_CODE)

    # --- registration -----------------------------------------------------------

    def heartbeat(self) -> None:
        with self._entry_lock:
            registry.register_worker(self.redis, self.registration())
        for model_key in self.models.keys():
            # Declared dead after a long stall and forgotten? Claim the models again.
            if registry.get_deployment(self.redis, self.name, model_key) is None:
                registry.set_deployment(self.redis, self.name, model_key, registry.RUNNING,
                                        size_bytes=self.models.size(model_key))

    def _beat(self) -> None:
        while True:
            time.sleep(registry.HEARTBEAT_S)
            try:
                self.heartbeat()
                self.leave_if_idle(time.monotonic())
            except Exception:  # noqa: BLE001 - a broker blip must not kill the heartbeat
                log.warning("heartbeat failed", exc_info=True)

    def leave_if_idle(self, now: float) -> bool:
        """A launched worker (``NDIF_WORKER_IDLE_EXIT_S``) leaves when nothing ran
        for that long and nothing waits for its models: its allocation ends with
        it (``ndif_celery.farm.elastic``). Leaving is Celery's warm shutdown."""
        limit = self.settings.worker_idle_exit_s
        if not limit or self.leaving:
            return False
        if self.slot.job_id or self.deliveries.delivering() or any(map(self.job_waiting, self.models.keys())):
            self.idle_since = now
            return False
        if now - self.idle_since < limit:
            return False
        log.info("idle for %.0f s (NDIF_WORKER_IDLE_EXIT_S): leaving the farm", now - self.idle_since)
        self.leaving = True
        os.kill(os.getpid(), signal.SIGTERM)
        return True

    # --- deployments (sent by the controller to this worker's own queue) ---------

    def load_model(self, model_key: str, dtype: Optional[str], size_bytes: int, evict: tuple) -> None:
        settings = self.settings
        for key in evict:
            self.evict(key)
        queue = queue_for(model_key)
        repo = wire.repo_fields(model_key)["repo_id"]
        text = f"Loading {repo} onto {self.name}."
        for entry in queues.waiting(self.redis, queue):
            statuses.StatusChannel(self.redis, entry.job, settings.job_ttl_s).send(wire.DEPLOYING, text)
        registry.set_deployment(self.redis, self.name, model_key, registry.DEPLOYING, size_bytes=size_bytes,
                                dtype=dtype)
        try:
            seconds = self.models.load(model_key, dtype, size_bytes=size_bytes)
            try:
                metrics.model_loaded(repo, seconds)
            except Exception:  # noqa: BLE001 - metrics never fail a load
                log.warning("worker metrics failed", exc_info=True)
        except RequestError as error:
            registry.remove_deployment(self.redis, self.name, model_key)
            # Recorded for the controller (another worker, or the wish marked failed) and the operator's deploy.
            registry.record_load_failure(self.redis, self.name, model_key, str(error))
            fail_waiting(self.redis, queue, str(error), settings.job_ttl_s)
            registry.wake_controller(self.redis, "load failed")
            log.warning("could not load %s: %s", repo, error)
            return
        self.redis.hdel(registry.LOAD_FAILURES, registry.deployment_field(self.name, model_key))
        registry.set_deployment(
            self.redis, self.name, model_key, registry.RUNNING,
            size_bytes=size_bytes, dtype=model_policy.parse(model_key).held or dtype, loaded_at=time.time(),
            load_seconds=seconds, torch_threads=self.models.threads_of(model_key),
            measured_bytes=self.models.measured_bytes(model_key),
        )
        registry.record_refs(self.redis, repo, memory.cached_refs(repo))  # which revisions name these weights
        if untrusted_jobs_possible(settings):
            try:
                self.isolated.start_zygote(model_key)
            except Exception:  # noqa: BLE001 - the first untrusted job retries and reports
                log.exception("could not start the isolation zygote for %s", repo)
        self.heartbeat()
        registry.publish_status(self.redis)
        self.app.control.add_consumer(queue, destination=[self.name], reply=True, timeout=10)
        log.info("%s loaded in %.2f s; consuming %s", repo, seconds, queue)

    def evict(self, model_key: str) -> None:
        """Stop taking the model's jobs first, then let go of it."""
        self.app.control.cancel_consumer(queue_for(model_key), destination=[self.name], reply=True, timeout=10)
        parent.discard()  # it holds the model's memory
        self.models.evict(model_key)
        registry.remove_deployment(self.redis, self.name, model_key)
        self.heartbeat()
        registry.publish_status(self.redis)
        registry.wake_controller(self.redis, "evicted")
        log.info("evicted %s", model_key)

    # --- housekeeping (sent by ndif-celery beat) ---------------------------------

    def cleanup(self) -> dict:
        """Delete results and job state past ``NDIF_JOB_TTL_S``, and old ledger rows."""
        swept = expiry.sweep(self.redis, self.store, self.settings.job_ttl_s)
        swept["ledger_rows"] = self._prune_ledger()
        if any(swept.values()):
            log.info("cleanup: %(jobs)d expired jobs, %(orphan_results)d orphaned results, "
                     "%(ledger_rows)d ledger rows deleted", swept)
        return swept

    def _prune_ledger(self) -> int:
        """Ledger rows past NDIF_LEDGER_RETENTION_DAYS; a database away only waits."""
        try:
            if self._ledger_engine is None:
                self._ledger_engine = db.engine_for(self.settings.database_url)
            return ledger.prune(self._ledger_engine, self.settings.ledger_retention_days)
        except (SQLAlchemyError, OSError) as error:
            log.warning("cleanup: the ledger database cannot be reached (%s); pruning later", type(error).__name__)
            return 0

    # --- the worker's life --------------------------------------------------------

    def runtime_name(self, version: str) -> str:
        """The runtime this worker serves: its nnsight, named with its Python
        minor when it was started as such a runtime (``0.5.15+py3.12``)."""
        said = self.settings.worker_nnsight
        if said and client_versions.release_of(said) == version and client_versions.MINOR_LABEL in said:
            return client_versions.runtime_name(version, f"{sys.version_info.major}.{sys.version_info.minor}")
        return version

    def ready(self) -> None:
        """Import the heavy stack, register, start the heartbeat, the controller and the ledger's drainer."""
        settings = self.settings
        self.check_store()
        import nnsight
        import nnsight.modeling.transformers  # noqa: F401 - now, not during the first job

        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        self.isolated.learn_host()
        self.info.update(
            gpus=[g for g in settings.worker_gpus.split(",") if g.strip()],
            memory_bytes=memory.budget_bytes(settings),
            cached=memory.cached_repos(settings),
            started_at=time.time(),
            nnsight=self.runtime_name(nnsight.__version__),  # the runtime it serves (policy.client_versions)
            python=f"{sys.version_info.major}.{sys.version_info.minor}",  # a 0.5 payload runs on its own minor only
            # The quantizations nnsight refuses here, so the controller places them elsewhere.
            refused_formats={} if cuda.gpus_visible() else quantized.refused_formats(),
        )
        self.info["metrics_port"] = metrics.start(
            settings.worker_metrics_host, settings.worker_metrics_port, lambda: len(self.models.keys())
        )
        runtime = client_versions.as_runtime(self.info["nnsight"])
        self.redis.set(registry.env_key(runtime), json.dumps(local_env()))
        for repo in self.info["cached"]:  # which revisions name the same weights, before any is loaded
            registry.record_refs(self.redis, repo, memory.cached_refs(repo))
        # A process of this name that died (restarted by a supervisor before
        # it went stale): its models are not here, its job goes to the watchdog.
        registry.take_over(self.redis, self.name, os.getpid())
        self.heartbeat()
        threading.Thread(target=self._beat, name="ndif-heartbeat", daemon=True).start()
        if not runtime:  # a runtime's worker sizes no model of another nnsight: the farm's own workers lead
            self.controller = Controller(self.name, self.redis, self.app, settings)
            self.controller.start()
            self.drainer = ledger.Drainer(self.name, self.redis, settings.database_url)
            self.drainer.start()
        registry.wake_controller(self.redis, "worker ready")
        log.info("worker %s ready (%d bytes for models)", self.name, self.info["memory_bytes"])

    def check_store(self) -> None:
        """A filesystem store this host does not share with the web hosts: its
        results could never be downloaded, so this worker refuses to serve
        (``store.fs.check_shared``) and exits with EX_CONFIG; its log says why."""
        if not isinstance(self.store, FilesystemStore):
            return
        try:
            check_shared(self.store, self.redis, socket.gethostname())
        except NotShared as error:
            log.critical("refusing to serve: %s", error)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(EX_CONFIG)

    def shutdown(self) -> None:
        if not self.deliveries.wait_idle(SHUTDOWN_DELIVERY_S):
            log.error("stopping with results still being delivered: %s", ", ".join(self.deliveries.delivering()))
        parent.discard()
        self.models.drop_zygotes()
        if self.controller is not None:
            self.controller.stop()
        if self.drainer is not None:
            self.drainer.stop()
        registry.unregister_worker(self.redis, self.name)
