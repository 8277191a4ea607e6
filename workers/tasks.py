"""The Celery worker: one thing at a time, against models that stay resident.

Three tasks, all run by the worker's single pool thread, so a load, an
eviction and a job never overlap on one worker:

- ``run_job`` (on a model's queue) is the short story of a job's life: fetch the
  payload, RUNNING, execute, then COMPLETED with the result inline or as a URL,
  or ERROR with the user's own traceback. Nothing a job does may take the
  worker down or leak into the next job.
- ``load_model`` / ``evict_model`` (on this worker's own queue) are sent by the
  controller (``workers.controller``), which runs in every worker's background
  thread and decides placements for the whole farm.

torch and nnsight are imported only inside the worker process, never at import
time, so Flower and the web can import this module cheaply.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import sys
import threading
import time
from typing import Optional

from celery.signals import worker_init, worker_ready, worker_shutdown
from celery.worker.control import control_command

from ndif_celery import cleanup, config, jobs, queues, registry, statuses, wire
from ndif_celery.celery_app import CLEANUP, EVICT_MODEL, LOAD_MODEL, RUN_JOB, make_app, queue_for, send_job
from ndif_celery.store import StoreUnavailable

settings = config.load()
if settings.worker_gpus:
    # Before anything imports torch: this process sees only its own GPUs.
    os.environ["CUDA_VISIBLE_DEVICES"] = settings.worker_gpus
if settings.torch_threads:
    # Before torch starts its thread pools (isolated children inherit it too).
    os.environ["OMP_NUM_THREADS"] = str(settings.torch_threads)
app = make_app(settings)
log = logging.getLogger("ndif_celery.worker")


class JobCancelled(BaseException):
    """Raised in the job's thread by ``ndif-celery kill``; BaseException so user
    code's ``except Exception`` cannot swallow it."""


class JobTimedOut(BaseException):
    """Raised in the job's thread at its execution deadline (trusted path)."""


class WorkerState:
    """What lives for the whole worker process: connections, store, resident models."""

    def __init__(self, name: str) -> None:
        from ndif_celery.store import open_store

        from .resident import ResidentModels

        self.name = name
        self.redis = jobs.connect(settings.redis_url, settings.redis_outage_s)
        self.store = open_store(settings)
        self.models = ResidentModels(verify_untrusted=settings.verify_untrusted)
        self.info: dict = {"name": name, "host": socket.gethostname(), "pid": os.getpid()}
        self.current_job: Optional[str] = None
        self.job_thread: Optional[int] = None
        self.controller = None
        self._job_lock = threading.Lock()

    def heartbeat(self) -> None:
        registry.register_worker(
            self.redis, dict(self.info, models=self.models.keys(), current_job=self.current_job)
        )
        for model_key in self.models.keys():
            # Declared dead after a long stall and forgotten? Claim the models again.
            if registry.get_deployment(self.redis, self.name, model_key) is None:
                registry.set_deployment(self.redis, self.name, model_key, registry.RUNNING,
                                        size_bytes=self.models.sizes.get(model_key, 0))

    def begin(self, job_id: str, pipe) -> None:
        """Report the job as this worker's (for the watchdog) in ``pipe``."""
        self.current_job, self.job_thread = job_id, threading.get_ident()
        registry.register_worker(pipe, dict(self.info, models=self.models.keys(), current_job=job_id))

    def end(self) -> None:
        with self._job_lock:
            self.current_job, self.job_thread = None, None

    def cancel(self, job_id: str, reason: type = JobCancelled) -> bool:
        """Interrupt the running job ``job_id`` at its next Python instruction
        (a long C call, such as one CUDA kernel, finishes first)."""
        with self._job_lock:
            thread = self.job_thread
            if self.current_job != job_id or thread is None:
                return False
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(reason))
            return True


_state: Optional[WorkerState] = None
_state_lock = threading.Lock()


def state(name: Optional[str] = None) -> WorkerState:
    global _state
    with _state_lock:
        if _state is None:
            _state = WorkerState(name or f"worker@{socket.gethostname()}")
        return _state


# --- jobs -----------------------------------------------------------------------


@app.task(name=RUN_JOB, bind=True)
def run_job(self, job: dict) -> None:
    try:
        run(state(self.request.hostname), jobs.Job.from_message(job))
    except (JobCancelled, JobTimedOut):
        pass  # an interruption that landed just as the job ended; it has already answered


def run(worker: WorkerState, job: jobs.Job) -> None:
    from . import execute

    # What the job needs to start, in one round trip.
    pipe = worker.redis.pipeline(transaction=False)
    pipe.get(jobs.status_key(job.id))
    pipe.get(jobs.payload_key(job.id))
    pipe.hget(registry.DEPLOYMENTS, registry.deployment_field(worker.name, job.model_key))
    latest, blob, deployment = pipe.execute()
    if jobs.ended(latest):
        # A copy of a job that already ended (redelivered after its first
        # worker died and it was run again, or cancelled while queued).
        log.info("job %s already ended; not running it again", job.id)
        return
    model = worker.models.get(job.model_key)
    if model is None:
        # Evicted between the broker handing us the job and now: back to the
        # queue, for whichever worker holds (or will hold) the model.
        send_job(app, job)
        registry.wake_controller(worker.redis, "requeued")
        return
    channel = statuses.StatusChannel(worker.redis, job, settings.job_ttl_s, settings.log_lines_per_s,
                                 settings.log_bytes_per_job)
    started = time.time()
    meta = {"job_id": job.id, "worker": worker.name, "queue_ms": round((started - job.received_at) * 1000, 1)}
    outcome = wire.ERROR  # until the result is delivered
    # One more round trip: this worker runs the job (for the watchdog), the
    # model was just used (so a placement decided meanwhile will not evict
    # it), and RUNNING for the client.
    pipe = worker.redis.pipeline(transaction=False)
    worker.begin(job.id, pipe)
    pipe.hset(registry.DEPLOYMENTS, *registry.touched(deployment, worker.name, job.model_key))
    try:
        if blob is None:
            pipe.execute()
            raise execute.RequestError(
                f"The payload of job {job.id} is gone (it expires after {settings.job_ttl_s} s); please resend."
            )
        channel.send(wire.RUNNING, "Your job has started running.", pipe=pipe)
        pipe.execute()
        run_started = time.perf_counter()
        if job.trusted:
            deadline = threading.Timer(settings.execution_timeout_s, worker.cancel, args=(job.id, JobTimedOut))
            deadline.daemon = True
            deadline.start()
            try:
                data = _run_in_process(model, job, blob, channel, meta, run_started)
            finally:
                deadline.cancel()
        else:
            data = _run_isolated(model, job, blob, channel, meta, worker)
        meta["run_ms"] = _ms_since(run_started)
        meta["result_bytes"] = len(data)
        meta["payload_bytes"] = job.payload_bytes
        if settings.max_result_bytes and len(data) > settings.max_result_bytes:
            raise execute.result_too_big(len(data), settings.max_result_bytes)
        _deliver(worker, channel, job, data, meta)
        outcome = wire.COMPLETED
    except JobCancelled:
        channel.send(wire.ERROR, "Your job was cancelled by the operator.", meta=meta, kind="cancelled")
    except JobTimedOut:
        channel.send(wire.ERROR, f"Your job exceeded the execution timeout of {settings.execution_timeout_s:g}s.", meta=meta,
                     kind="timeout")
    except execute.RequestError as error:
        channel.send(wire.ERROR, str(error), meta=meta, kind=error.kind)
    except StoreUnavailable as error:
        log.error("job %s: %s", job.id, error)
        channel.send(wire.ERROR, f"Your job ran, but the result store is unavailable so its result could not be "
                     f"kept; please resend it shortly. ({error})", meta=meta, kind="store")
    except Exception as error:  # noqa: BLE001 - a server fault still ends the job visibly
        log.exception("job %s failed on the server", job.id)
        channel.send(wire.ERROR, f"Server error while running your job: {type(error).__name__}: {error}", meta=meta,
                     kind="server")
    finally:
        worker.end()
        if job.trusted:
            # After the answer is sent, before the next job: the check reads
            # every weight, which nobody should wait for.
            restored = worker.models.restore_if_changed(job.model_key)
            if restored:
                log.warning("job %s changed %d weight tensors; model reloaded", job.id, len(restored))
        else:
            _check_after_untrusted(worker, job)
        _job_metrics(outcome, time.time() - started)
        worker.redis.delete(jobs.payload_key(job.id))
    if not job.trusted and meta.get("isolated"):
        _prepare_spare(worker, job.model_key)


def _check_after_untrusted(worker: "WorkerState", job: jobs.Job) -> None:
    """After every untrusted job, however it ended (success, user error,
    timeout, cancel, a crashed child, a server fault), before the next job:
    the keyed weight check, where a child could have written the weights (a
    GPU model: CUDA IPC has no read-only mapping) or the operator asked for it
    (NDIF_VERIFY_UNTRUSTED). A child not dead in time, or a check that fails,
    evicts the model: it is not served unverified."""
    from . import isolate

    if not worker.models.checks_untrusted(job.model_key):
        return
    started = time.perf_counter()
    if not isolate.wait_reaped(_REAP_WAIT_S):
        log.error("untrusted job %s: its child was not reaped within %g s; evicting %s unverified",
                  job.id, _REAP_WAIT_S, job.model_key)
        worker.models.evict(job.model_key)
        return
    restored = worker.models.check_after_untrusted(job.model_key)
    if restored:
        log.warning("untrusted job %s changed %d weight tensors (%s); model reloaded", job.id, len(restored),
                    ", ".join(restored[:5]))
    else:
        log.info("untrusted job %s: keyed weight check intact (%.0f ms)", job.id, _ms_since(started))


_REAP_WAIT_S = 30.0  # a killed child is gone in milliseconds; one that is not is stuck in the kernel


def _job_metrics(outcome: str, seconds: float) -> None:
    from . import metrics

    try:
        metrics.job_ended(outcome, seconds)
    except Exception:  # noqa: BLE001 - metrics never fail a job
        log.warning("worker metrics failed", exc_info=True)


def _run_in_process(model, job: jobs.Job, blob: bytes, channel: statuses.StatusChannel, meta: dict, started: float) -> bytes:
    """Trusted: run in this process, against the resident model itself."""
    from . import execute, results

    meta["isolated"] = False
    with execute.request_scope(model):
        try:
            tracer = execute.deserialize(model, blob, job.compress, job.env)
            meta["deserialize_ms"] = _ms_since(started)
            saved = execute.run(tracer, channel.log)
        except Exception as error:  # noqa: BLE001 - user code may raise anything
            # Formatted inside the scope: linecache still holds the user's source.
            raise execute.RequestError(execute.format_user_error(error)) from None
    return results.encode(saved, job.compress)


def _run_isolated(model, job: jobs.Job, blob: bytes, channel: statuses.StatusChannel, meta: dict,
                  worker: "WorkerState") -> bytes:
    """Untrusted: a fresh jailed child per request (``workers.isolate``), forked
    by the model's zygote (exec'd, or forked from the fork server), never by
    this worker: it holds secrets and what earlier jobs left in its memory."""
    from . import isolate

    meta["isolated"] = True
    zygote = _zygote(worker, job.model_key)
    outcome = isolate.run(model, blob, job.compress, job.env, _isolation_policy(zygote), channel.log, zygote=zygote)
    # Only what isolate vouches for (the child's jail layers and timings, checked
    # by isolate.child_meta; its own isolated_ms and spare): never a key of ours.
    meta.update({key: value for key, value in outcome.meta.items() if key in isolate.OUTCOME_META and key not in meta})
    meta["isolation"] = zygote.mode
    return outcome.data


def _zygote(worker: "WorkerState", model_key: str):
    """The model's zygote (started on first use): exec'd (NDIF_ISOLATION=zygote)
    or forked from the fork server (=fork). None can be had: the job is refused."""
    from . import execute, forkserver
    from .zygote import ZygoteError

    try:
        server = None
        if settings.isolation == "fork":
            server = forkserver.current()
            if server is None:
                raise forkserver.ForkServerError("this worker has no fork server (it starts with the Celery worker, "
                                                 "when untrusted jobs can come)")
        zygote = worker.models.zygote(model_key, fork_server=server)
        zygote.wait_ready()
    except ZygoteError as error:
        worker.models.drop_zygote(model_key)  # the next job tries a fresh one
        raise execute.RequestError(f"This worker could not start its isolation process, so it did not run your "
                                   f"job: {error}. Ask the operator (see docs/security.md).", kind="server") from None
    return zygote


def _isolation_policy(zygote=None):
    from . import isolate

    readable = _JAIL_READABLE
    if zygote is not None and zygote.cuda:
        readable = readable + _gpu_readable()
    return isolate.Policy(
        timeout_s=settings.execution_timeout_s,
        memory_bytes=settings.job_memory_bytes,
        disk_bytes=settings.job_disk_bytes,
        secrets=settings.secrets(),
        max_result_bytes=settings.max_result_bytes,
        readable=readable,
        as_nobody=_JAIL_AS_NOBODY,
        jail_waived=settings.jail_waived,
        jail_disabled=settings.jail_disabled,
        cgroup_root=settings.jail_cgroup_root,
        # Hidden from the child's view (its UNIX sockets included), on top of Landlock.
        hidden=(str(settings.home), str(settings.results_dir)),
    )


def _gpu_readable() -> tuple:
    """What a CUDA child may still read once locked in: the driver's device
    nodes and its /proc and /sys entries (not tested on a GPU yet)."""
    import glob

    return tuple(glob.glob("/dev/nvidia*")) + tuple(p for p in ("/proc/driver/nvidia", "/sys") if os.path.exists(p))


def _prepare_spare(worker: WorkerState, model_key: str) -> None:
    """After an untrusted job: fork and jail the next one's child now, while
    idle (``isolate.Spare``). Best effort: a failure here only costs speed."""
    from . import isolate

    model = worker.models.get(model_key)
    if model is None:
        return
    try:
        zygote = worker.models.zygotes.get(model_key)
        if zygote is None:
            return
        isolate.prepare(model, _isolation_policy(zygote), zygote=zygote)
    except Exception:  # noqa: BLE001
        log.exception("could not prepare a spare isolated process")


def _hf_cache() -> tuple:
    from huggingface_hub import constants

    return (constants.HF_HUB_CACHE,)


# Computed once: what an isolated job may read, and whether it can run as nobody.
_JAIL_READABLE: tuple = ()
_JAIL_AS_NOBODY = True


def _deliver(worker: WorkerState, channel: statuses.StatusChannel, job: jobs.Job, data: bytes, meta: dict) -> None:
    """Inline on the websocket when small and someone listens, else through the
    store as a URL (which ``GET /response/<id>`` also returns)."""
    from . import results

    description = "Your job has been completed."
    if job.session_id and len(data) <= settings.max_inline_bytes:
        meta["inline"] = True
        latest = wire.response_json(
            job.id, wire.COMPLETED, description + " Its result was delivered over the websocket.", meta=meta
        )
        if channel.send_binary(results.completed_frame(job.id, description, data, meta), latest):
            return
        # Nobody listens any more (the client went away): keep the result for a poll.
    key = cleanup.result_key(job.id)
    upload_started = time.perf_counter()
    worker.store.put(key, data)
    meta["upload_ms"] = _ms_since(upload_started)
    meta["inline"] = False
    channel.send(wire.COMPLETED, description, data=worker.store.url(key), meta=meta)


def _ms_since(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 1)


@app.task(name=CLEANUP, bind=True)
def cleanup_expired(self) -> dict:
    """Sent by ``ndif-celery beat``: delete results and job state past ``NDIF_JOB_TTL_S``."""
    worker = state(self.request.hostname)
    swept = cleanup.sweep(worker.redis, worker.store, settings.job_ttl_s)
    swept["ledger_rows"] = _prune_ledger()
    if any(swept.values()):
        log.info("cleanup: %(jobs)d expired jobs, %(orphan_results)d orphaned results, "
                 "%(ledger_rows)d ledger rows deleted", swept)
    return swept


_ledger_engine = None


def _prune_ledger() -> int:
    """Ledger rows past NDIF_LEDGER_RETENTION_DAYS; a database away only waits."""
    global _ledger_engine
    from sqlalchemy.exc import SQLAlchemyError

    from ndif_celery import db, ledger

    try:
        if _ledger_engine is None:
            _ledger_engine = db.engine_for(settings.database_url)
        return ledger.prune(_ledger_engine, settings.ledger_retention_days)
    except (SQLAlchemyError, OSError) as error:
        log.warning("cleanup: the ledger database cannot be reached (%s); pruning later", type(error).__name__)
        return 0


# --- deployments (sent by the controller to this worker's own queue) -------------


@app.task(name=LOAD_MODEL, bind=True)
def load_model(self, model_key: str, dtype: Optional[str] = None, size_bytes: int = 0, evict: tuple = ()) -> None:
    from .controller import fail_waiting
    from .execute import RequestError

    worker = state(self.request.hostname)
    for key in evict:
        _evict(worker, key)
    queue = queue_for(model_key)
    repo = wire.repo_fields(model_key)["repo_id"]
    text = f"Loading {repo} onto {worker.name}."
    for entry in queues.waiting(worker.redis, queue):
        statuses.StatusChannel(worker.redis, entry.job, settings.job_ttl_s).send(wire.DEPLOYING, text)
    registry.set_deployment(worker.redis, worker.name, model_key, registry.DEPLOYING, size_bytes=size_bytes, dtype=dtype)
    try:
        seconds = worker.models.load(model_key, dtype)
        worker.models.sizes[model_key] = size_bytes
        _load_metrics(repo, seconds)
    except RequestError as error:
        registry.remove_deployment(worker.redis, worker.name, model_key)
        fail_waiting(worker.redis, queue, str(error), settings.job_ttl_s)
        return
    registry.set_deployment(
        worker.redis, worker.name, model_key, registry.RUNNING,
        size_bytes=size_bytes, dtype=dtype, loaded_at=time.time(), load_seconds=seconds,
    )
    if _untrusted_jobs_possible():
        try:  # started now, ready by the first untrusted job (an exec'd one takes seconds of imports)
            from . import forkserver

            worker.models.zygote(model_key, fork_server=forkserver.current() if settings.isolation == "fork" else None)
        except Exception:  # noqa: BLE001 - the first untrusted job retries and reports
            log.exception("could not start the isolation zygote for %s", repo)
    worker.heartbeat()
    registry.publish_status(worker.redis)
    app.control.add_consumer(queue, destination=[worker.name], reply=True, timeout=10)
    log.info("%s loaded in %.2f s; consuming %s", repo, seconds, queue)


def _load_metrics(repo: str, seconds: float) -> None:
    from . import metrics

    try:
        metrics.model_loaded(repo, seconds)
    except Exception:  # noqa: BLE001 - metrics never fail a load
        log.warning("worker metrics failed", exc_info=True)


@app.task(name=EVICT_MODEL, bind=True)
def evict_model(self, model_key: str) -> None:
    _evict(state(self.request.hostname), model_key)


def _evict(worker: WorkerState, model_key: str) -> None:
    """Stop taking the model's jobs first, then let go of it."""
    from . import isolate

    app.control.cancel_consumer(queue_for(model_key), destination=[worker.name], reply=True, timeout=10)
    isolate.discard()  # it holds the model's memory
    worker.models.evict(model_key)
    registry.remove_deployment(worker.redis, worker.name, model_key)
    worker.heartbeat()
    registry.publish_status(worker.redis)
    registry.wake_controller(worker.redis, "evicted")
    log.info("evicted %s", model_key)


@control_command(args=[("job_id", str)], signature="<job_id>")
def ndif_kill(panel, job_id: str) -> dict:
    """Cancel a running job on this worker (``ndif-celery kill``)."""
    cancelled = _state is not None and _state.cancel(job_id)
    return {"ok": "cancelling" if cancelled else "not running here"}


# --- worker lifecycle -----------------------------------------------------------


def _untrusted_jobs_possible() -> bool:
    """Auth on (keys not tagged trusted), or every request untrusted."""
    return settings.auth or not settings.default_trusted


@worker_init.connect
def _on_init(**_) -> None:
    """NDIF_ISOLATION=fork: fork the fork server now, from the main thread,
    while this process is still clean: no Redis, store or database client
    opened, no job run, no CUDA (``workers.forkserver``). Its zygotes fork the
    isolated children. Without it, untrusted jobs are refused."""
    if settings.isolation != "fork" or not _untrusted_jobs_possible():
        return
    from . import forkserver
    from .zygote import ENV_KEEP

    try:
        forkserver.start(settings.secrets(), ENV_KEEP)
    except Exception:  # noqa: BLE001 - untrusted jobs will say so; trusted ones still run
        log.exception("could not start the fork server; untrusted jobs will be refused")


@worker_ready.connect
def _on_ready(sender, **_) -> None:
    """Import the heavy stack, register, start the heartbeat and the controller."""
    from . import memory
    from .controller import Controller

    worker = state(sender.hostname)
    import nnsight.modeling.transformers  # noqa: F401 - now, not during the first job
    import torch

    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)

    global _JAIL_READABLE, _JAIL_AS_NOBODY
    from . import jail

    _JAIL_READABLE = tuple(jail.readable_paths(_hf_cache()))
    _JAIL_AS_NOBODY = jail.readable_by_others(sys.base_prefix) and jail.readable_by_others(sys.prefix)
    worker.info.update(
        gpus=[g for g in settings.worker_gpus.split(",") if g.strip()],
        memory_bytes=memory.budget_bytes(settings),
        cached=memory.cached_repos(settings),
        started_at=time.time(),
    )
    from . import metrics

    worker.info["metrics_port"] = metrics.start(
        settings.worker_metrics_host, settings.worker_metrics_port, lambda: len(worker.models.keys())
    )
    worker.redis.set(registry.ENV, _env_json())
    worker.heartbeat()
    threading.Thread(target=_heartbeat, args=(worker,), name="ndif-heartbeat", daemon=True).start()
    worker.controller = Controller(worker.name, worker.redis, app, settings)
    worker.controller.start()
    registry.wake_controller(worker.redis, "worker ready")
    log.info("worker %s ready (%d bytes for models)", worker.name, worker.info["memory_bytes"])


def _heartbeat(worker: WorkerState) -> None:
    while True:
        time.sleep(registry.HEARTBEAT_S)
        try:
            worker.heartbeat()
        except Exception:  # noqa: BLE001 - a broker blip must not kill the heartbeat
            log.warning("heartbeat failed", exc_info=True)


@worker_shutdown.connect
def _on_shutdown(**_) -> None:
    from . import forkserver, isolate

    isolate.discard()
    if _state is not None:
        for model_key in list(_state.models.zygotes):
            _state.models.drop_zygote(model_key)
        if _state.controller is not None:
            _state.controller.stop()
        registry.unregister_worker(_state.redis, _state.name)
    forkserver.stop()


def _env_json() -> str:
    import json

    from ndif_celery.environment import local_env

    return json.dumps(local_env())
