"""A job's life on a worker, as named steps (rq's prepare / perform / handle).

::

    start ──► announce ──► execute ──► deliver          COMPLETED   (execute + deliver: perform)
                              │            │
                              └────────────┴──► fail    ERROR, the one place an
                                                        exception becomes what the client reads
    finish (always, after the answer): end, weight checks, metrics, payload deleted
    then, for an isolated job: the next child prepared while idle

- :func:`start` takes what the job needs in one Redis round trip: its latest
  status, its payload, the model's deployment. It skips a job that already
  ended. It sends the job back to its queue when the model is gone. It queues
  this worker's claim and the model's "last used" for a second round trip.
- :func:`announce` sends RUNNING on that same second round trip.
- :func:`execute` hands the payload to the job's executor
  (``workers.job.executors``). A trusted key runs in this process, an
  untrusted one in a jailed child. Each executor owns its deadline.
  :func:`execute` enforces the result limit.
- :func:`deliver` sends the result inline on the websocket, or through the
  store as a URL.
- :func:`fail` maps every bad end to its ERROR: cancel, timeout, the user's
  error, the store away, a server fault.
- :func:`finish` runs however the job ended. :func:`close` is its part per job.

Keeping the model busy: once a job's result is encoded, nothing left of its
life needs the model. So :func:`hand_over` gives its :func:`deliver` (or
:func:`fail`) and :func:`close` to the worker's delivery thread
(``workers.job.deliveries``). Hand-offs run in order, and at most one waits.
A result over 16 MiB is delivered here, in the job's thread, to bound memory.
Only :func:`finish` then stands between this job's forward and the next.
Its weight check reads cheap stamps. The whole fingerprint runs only when due
(``ResidentModels.check_after_trusted``). ``WorkerState.run`` then takes the
head of the model's queue itself (``gather.next_job``), skipping Celery's hop.
The job's :func:`deliver` runs while the next job starts and runs.

A trusted job may lead a co-batch (``workers.job.gather``). Its ``perform``
gathers its model's waiting trusted jobs. It starts and announces each with
these same steps, then runs them together. It hands every job's answer over
at once. The lead's :func:`finish` comes last.

Nothing a job does may take the worker down or leak into the next job.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from ndif_celery import messages, statuses, wire
from ndif_celery.celery_app import queue_for
from ndif_celery.state import byte_quotas, jobs, registry, run_times, turns
from ndif_celery.store import StoreUnavailable
from workers import metrics, results
from workers.execute import RequestError, result_over_quota, result_too_big

from .channel import FinalChannel
from .executors import JobCancelled, JobTimedOut, ms_since

if TYPE_CHECKING:  # the worker as the steps see it
    from .context import JobContext

log = logging.getLogger("ndif_celery.worker")


#: How long a worker pauses after it sends a job back over its key's running
#: bound. It pauses only when no other key's job waits: the next message is
#: likely the same key's.
BOUNCE_PAUSE_S = 0.5
SENT_BACK: Any = object()  # what start returns for a job it sent back to its queue


@dataclass
class Life:
    """One job as it runs: what :func:`start` gathered, what the steps add."""

    job: jobs.Job
    model: Any
    blob: Optional[bytes]
    executor: Any  # executors.InProcess or executors.Isolated
    channel: statuses.StatusChannel
    pipe: Any  # the second round trip: claim, last used, RUNNING. Sent by announce.
    started: float = field(default_factory=time.time)
    meta: dict = field(default_factory=dict)
    outcome: str = wire.ERROR  # until the result is delivered
    handed: bool = False  # the delivery thread answers and closes it (workers.job.deliveries)
    jobs_run: int = 1  # jobs in the co-batch it led (workers.job.gather), itself included
    encoded_at: float = 0.0  # when its result bytes were ready: the timeline's handover


def perform(worker: JobContext, life: Life) -> None:
    """The job's work once it runs: :func:`execute`, then :func:`deliver`.
    Delivery goes through :func:`hand_over`, off the forward's path."""
    data = execute(worker, life)
    hand_over(worker, [(life, data)])


def run(worker: JobContext, job: jobs.Job, perform: Callable[[Any, Life], None] = perform) -> bool:
    """A job's whole life on ``worker``, a ``workers.worker.WorkerState``.

    Returns False when the job went back to its queue, so the worker goes
    back to Celery. That happens when its model is gone, or its key is over
    NDIF_MAX_RUNNING_PER_KEY.

    ``perform`` is its work once RUNNING. For a job that may lead a co-batch
    it is ``workers.job.gather.perform``. That one answers the batch's other
    jobs itself. Like :func:`perform`, it raises this job's answer."""
    try:
        life = start(worker, job)
        if life is SENT_BACK:
            return False
        if life is None:
            return True
        try:
            announce(worker, life)
            perform(worker, life)
        except (JobCancelled, JobTimedOut, Exception) as error:  # noqa: BLE001 - every end is answered
            fail(worker, life, error)
        finally:
            finish(worker, life)
        if life.meta.get("isolated"):
            life.executor.prepare_next(job.model_key)
    except (JobCancelled, JobTimedOut):
        pass  # an interruption that landed as the job ended: it has answered
    return True


def start(worker: JobContext, job: jobs.Job, bounded: bool = True) -> Optional[Life]:
    """What the job needs to start, in one round trip.

    Returns None when the job already ended, so this worker does not run it.
    Returns :data:`SENT_BACK` when the job went back to its queue. That
    happens when the model is gone. When ``bounded``, it also happens when the
    key already runs its bound on the model. A co-batch's partners are not
    bounded: they ride their lead's forward."""
    queue = queue_for(job.model_key)
    pipe = worker.redis.pipeline(transaction=False)
    pipe.get(jobs.status_key(job.id))
    pipe.get(jobs.payload_key(job.id))
    pipe.hget(registry.DEPLOYMENTS, registry.deployment_field(worker.name, job.model_key))
    if bounded:  # a slot among its key's running jobs on the model, same round trip
        turns.claim_run(pipe, job, queue, worker.settings)
    latest, blob, deployment, *claimed = pipe.execute()
    model = worker.models.use(job.model_key)  # sets torch to the model's threads
    if claimed and claimed[0] and (jobs.ended(latest) or model is None):
        turns.release_run(worker.redis, job, queue)  # the job will not run here
    if jobs.ended(latest):
        # A copy of a job that already ended. It was redelivered after its
        # first worker died, and another copy ran. Or it was cancelled while queued.
        log.info("job %s already ended; not running it again", job.id)
        return None
    if model is not None and claimed and not claimed[0]:
        # Its key already runs NDIF_MAX_RUNNING_PER_KEY jobs on this model, on
        # other replicas. Back in line, behind the other keys waiting. If none
        # waits, pause before the next message, so the bounce is no busy loop.
        turns.send(worker.redis, worker.app, job, worker.settings)
        if not turns.others_waiting(worker.redis, job, queue):
            time.sleep(BOUNCE_PAUSE_S)
        return SENT_BACK
    if model is None:
        # Evicted since the broker handed us the job. Back to the queue, for
        # whichever worker holds the model or will.
        turns.send(worker.redis, worker.app, job, worker.settings)
        registry.wake_controller(worker.redis, "requeued")
        return SENT_BACK
    settings = worker.settings
    # Its final status is sent once: by this thread or the deadline's watchdog.
    channel = FinalChannel(worker.redis, job, settings.job_ttl_s, settings.log_lines_per_s,
                           settings.log_bytes_per_job)
    life = Life(job, model, blob, worker.executor_for(job), channel, worker.redis.pipeline(transaction=False))
    life.meta.update(job_id=job.id, worker=worker.name, queue_ms=round((life.started - job.received_at) * 1000, 1))
    life.meta["timeline"] = timeline = {"received_at": job.received_at}
    if job.queued_at:
        timeline.update(web_ms=_ms(job.queued_at - job.received_at), broker_ms=_ms(life.started - job.queued_at))
    # One more round trip, sent by announce. It tells the watchdog this worker
    # runs the job. It marks the model just used, so a placement decided
    # meanwhile will not evict it. It carries RUNNING for the client.
    worker.slot.begin(job.id, life.pipe)
    turns.started(life.pipe, job, queue, settings.job_ttl_s)  # the model's turn moves on
    life.pipe.hset(registry.DEPLOYMENTS, *registry.touched(deployment, worker.name, job.model_key))
    return life


def announce(worker: JobContext, life: Life) -> None:
    """RUNNING, on the round trip :func:`start` queued. A payload that
    expired while queued ends the job instead."""
    if life.blob is None:
        life.pipe.execute()
        raise RequestError(f"The payload of job {life.job.id} is gone (it expires after "
                                   f"{worker.settings.job_ttl_s} s); please resend.")
    life.channel.send(wire.RUNNING, "Your job has started running.", pipe=life.pipe)
    life.pipe.execute()


def execute(worker: JobContext, life: Life) -> bytes:
    """Run the block through the job's executor. Returns its result bytes, within the limit."""
    life.meta["timeline"]["start_ms"] = _ms(time.time() - life.started)
    run_started = time.perf_counter()
    data = life.executor.run(life.model, life.job, life.blob, life.channel, life.meta)
    life.encoded_at = time.time()
    return within_limit(worker, life, data, ms_since(run_started))


def within_limit(worker: JobContext, life: Life, data: bytes, run_ms: float) -> bytes:
    """The run's figures, put in the job's meta. Returns ``data``; raises when it is over the limit."""
    meta = life.meta
    meta["run_ms"] = run_ms
    meta["result_bytes"] = len(data)
    meta["payload_bytes"] = life.job.payload_bytes
    limit = worker.settings.max_result_bytes
    if limit and len(data) > limit:
        raise result_too_big(len(data), limit)
    return data


def deliver(worker: JobContext, life: Life, data: bytes) -> None:
    """Inline on the websocket when small and someone listens. Else through
    the store as a URL, which ``GET /response/<id>`` also returns. A 0.6/0.7
    client's result always goes by URL: the web writes its frames."""
    job, meta, channel = life.job, life.meta, life.channel
    description = "Your job has been completed."
    if job.session_id and not job.protocol and len(data) <= worker.settings.max_inline_bytes:
        meta["inline"] = True
        _sent(life)
        latest = wire.response_json(
            job.id, wire.COMPLETED, description + " Its result was delivered over the websocket.", meta=meta
        )
        if channel.send_binary(results.completed_frame(job.id, description, data, meta), latest):
            return
        # Nobody listens: the client went away. Keep the result for a poll.
    key = jobs.result_key(job.id)
    quota = worker.settings.result_quota_bytes
    used = byte_quotas.RESULTS.reserve(worker.redis, job.owner, job.id, len(data), quota)
    if used is not None:
        raise result_over_quota(len(data), used, quota, worker.settings.job_ttl_s)
    upload_started = time.perf_counter()
    try:
        worker.store.put(key, data)
    except BaseException:
        byte_quotas.RESULTS.release(worker.redis, [job.id])  # nothing kept, nothing counted
        raise
    meta["upload_ms"] = ms_since(upload_started)
    meta["inline"] = False
    _sent(life)
    channel.send(wire.COMPLETED, description, data=worker.store.url(key), meta=meta)


def _sent(life: Life) -> None:
    """The timeline's last hops, as the result is sent.

    It records the time from the result bytes to here: the delivery thread's
    turn. It records when it was sent. The client's clock tells the rest: the
    web's relay and the transfer."""
    timeline = life.meta.get("timeline")
    if timeline is None:
        return
    now = time.time()
    if life.encoded_at:
        timeline["handover_ms"] = _ms(now - life.encoded_at)
    for hop in ("deserialize_ms", "encode_ms"):
        if hop in life.meta:
            timeline[hop] = life.meta[hop]
    if "run_ms" in life.meta and "encode_ms" in life.meta:
        timeline["forward_ms"] = round(life.meta["run_ms"] - life.meta["encode_ms"] - life.meta.get("deserialize_ms", 0), 1)
    timeline["sent_at"] = now
    log.debug("job %s timeline %s", life.job.id, timeline)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def hand_over(worker: JobContext, answers: list) -> None:
    """Answer (:func:`answer`) and close each ``(life, result or exception)``.

    The worker's delivery thread (``workers.job.deliveries``) does it, in
    order, so the next job starts meanwhile. Some results are too big to hold
    while the next one is made. Those are answered here, in this thread."""
    if all(isinstance(a, BaseException) or worker.deliveries.takes(a) for _, a in answers):
        worker.deliveries.hand(answers)
        for life, _ in answers:
            life.handed = True
        return
    for life, result in answers:
        answer(worker, life, result)


def answer(worker: JobContext, life: Life, result) -> None:
    """Deliver the job's result (COMPLETED). When ``result`` is an exception, fail with it."""
    try:
        if isinstance(result, BaseException):
            raise result
        deliver(worker, life, result)
        life.outcome = wire.COMPLETED
    except (JobCancelled, JobTimedOut, Exception) as error:  # noqa: BLE001 - every end is answered
        fail(worker, life, error)


def fail(worker: JobContext, life: Life, error: BaseException) -> None:
    """The ERROR the client sees, for every way a job can end badly.

    Called while ``error`` is being handled, so ``log.exception`` logs it."""
    job, meta, channel = life.job, life.meta, life.channel
    if isinstance(error, JobCancelled):
        channel.send(wire.ERROR, worker.slot.cancel_texts.pop(job.id, messages.CANCELLED), meta=meta, kind="cancelled")
    elif isinstance(error, JobTimedOut):
        channel.send(wire.ERROR, messages.timed_out(worker.settings.execution_timeout_s), meta=meta, kind="timeout")
    elif isinstance(error, RequestError):
        channel.send(wire.ERROR, str(error), meta=meta, kind=error.kind)
    elif isinstance(error, StoreUnavailable):
        log.error("job %s: %s", job.id, error)
        channel.send(wire.ERROR, f"Your job ran, but the result store is unavailable so its result could not be "
                     f"kept; please resend it shortly. ({error})", meta=meta, kind="store")
    else:  # a server fault still ends the job visibly
        log.exception("job %s failed on the server", job.id)
        channel.send(wire.ERROR, f"Server error while running your job: {type(error).__name__}: {error}",
                     meta=meta, kind="server")


def finish(worker: JobContext, life: Life) -> None:
    """Frees the worker, records the run time, runs the weight checks, then :func:`close`.

    It runs however the job ended. It comes after the answer, and after every
    job of its co-batch. It comes before the next job."""
    worker.slot.end()
    try:  # this model's run times: the waiting clients' estimate (ndif_celery.state.run_times)
        pipe = worker.redis.pipeline(transaction=False)
        run_times.record(pipe, life.job.model_key, time.time() - life.started, life.jobs_run)
        pipe.execute()
    except Exception:  # noqa: BLE001 - an estimate never fails a job
        log.warning("could not record job %s's run time", life.job.id, exc_info=True)
    life.executor.after(life.job, life.jobs_run)  # the weight checks, before the next forward
    if not life.handed:  # else the delivery thread closes it, once delivered
        close(worker, life)


def close(worker: JobContext, life: Life) -> None:
    """What every answered job leaves behind. It records its metrics, deletes
    its payload and frees its key's running slot on the model."""
    try:
        metrics.job_ended(life.outcome, time.time() - life.started)
    except Exception:  # noqa: BLE001 - metrics never fail a job
        log.warning("worker metrics failed", exc_info=True)
    pipe = worker.redis.pipeline(transaction=False)  # one round trip
    turns.release_run(pipe, life.job, queue_for(life.job.model_key))
    pipe.delete(jobs.payload_key(life.job.id))
    try:
        pipe.execute()
    except Exception:  # noqa: BLE001 - with Redis away, the slot lapses at the deadline, the payload at its TTL
        log.warning("job %s: could not free its key's running slot or delete its payload", life.job.id, exc_info=True)
