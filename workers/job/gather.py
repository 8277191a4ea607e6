"""A co-batch's life on a worker: one trusted job gathers its model's waiting
trusted jobs, and they run in shared forwards (docs/cobatching.md).

Why gather at the worker: jobs reach a worker one Celery message at a time
(concurrency 1, prefetch 1), so the jobs that could share a forward with the
one it runs are still in the model's queue. The job that starts (the *lead*)
takes up to ``NDIF_COBATCH_MAX - 1`` of them out of the queue with LREM
(``queues.take``): whoever removes a message owns it, and its Celery message
never reaches any worker. Each taken job then lives through the same named
steps as any job (``workers.job.life``), and the co-batching engine
(``workers.cobatch``, through ``executors.InProcess.run_together``) runs them::

    lead: start ─► announce ─► perform (this module):
        gather ─► start + announce (each taken job)
               ─► run_together: one deadline watch, cobatch.run_batch, each result encoded
               ─► deliver | fail, close (each taken job) ─► the lead's own answer
    lead: finish (the worker free, the weight check once, close)

What is gathered: trusted jobs (an untrusted one runs alone in its jailed
child: co-batched users share one process and one interleaver) of the same
model key, on their first attempt (a job run again after its worker died may
be what killed it: it runs alone, and cannot take a batch down twice), in the
order they would run. A lead on its second attempt gathers nothing either.

A worker that dies mid-batch loses none of them: the taken jobs are written
into the worker's registry entry (``batch``) in the same Redis step as their
removal, so the beat's watchdog rescues every one (``registry.running_jobs``):
each is run again once, alone, or ended (docs/reliability.md).

Deadlines: one watch covers the whole batch, at the job limit
(``deadline.DeadlineWatchdog.watch`` with ``others``); at it every job of the batch
gets its timeout ERROR. ``ndif-celery kill`` of one job of a running batch
answers that job alone; the others run on.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

from ndif_celery.celery_app import MAINTENANCE_QUEUE, queue_for, worker_queue
from ndif_celery.state import jobs, queues, turns
from workers import adapters

from . import life as job_life
from .executors import ms_since

if TYPE_CHECKING:  # the worker as the steps see it
    from .context import JobContext

log = logging.getLogger("ndif_celery.worker")


#: Most jobs one Celery task runs one after another (``next_job``) before it
#: returns to Celery: its message stays unacknowledged meanwhile.
CHAIN_MAX = 64


def next_job(worker: JobContext, done: jobs.Job, chained: int):
    """The job to run right after ``done`` without a trip through Celery, or None.

    Why: with a prefetch of one and late acknowledgement, Celery fetches the
    next message only once a task returns, so each job paid a broker round
    trip and the pool's dispatch between two forwards. When the head of the
    model's queue is a job this worker would be handed next anyway (trusted,
    first attempt, the same model, still here), it is taken out of the queue
    and made this worker's current job in one Redis step (``queues.take``,
    ``CurrentJob.take_next``: no job is lost if the worker dies), and runs at
    once. The queue's order is kept (only its head is taken), and the chain
    ends, back to Celery, whenever anything else waits for this worker: its
    own queue (a load, an eviction), another of its models' queues, the
    maintenance queue, an untrusted job at the head; after :data:`CHAIN_MAX`
    jobs in any case."""
    key = done.model_key
    if chained >= CHAIN_MAX or not done.trusted or worker.models.get(key) is None:
        return None
    others = [worker_queue(worker.name), MAINTENANCE_QUEUE] + [queue_for(k) for k in worker.models.keys() if k != key]
    names = [list_name for queue in others for list_name in queues.lists(queue)]
    pipe = worker.redis.pipeline(transaction=False)  # one round trip: the other queues, and this one's head
    for name in names:
        pipe.llen(name)
    queues.read_waiting(pipe, queue_for(key), first=1)
    answers = pipe.execute()
    busy = [name for name, length in zip(names, answers) if length]
    if busy:
        log.debug("after job %s: back to Celery (%s waits)", done.id, busy[0])
        return None
    waiting = queues.decode_waiting(queue_for(key), answers)
    if not waiting:
        return None
    head = waiting[0]
    if not (head.job.trusted and head.job.attempt < 2 and head.job.model_key == key):
        log.debug("after job %s: back to Celery (job %s heads the queue)", done.id, head.job.id)
        return None
    return worker.slot.take_next(head)


def may_gather(worker: JobContext, job: jobs.Job) -> bool:
    """Whether ``job`` leads a co-batch when it starts: co-batching on (and on
    this worker's nnsight, ``workers.adapters``), trusted, first attempt."""
    return worker.settings.cobatch_max > 1 and job.trusted and job.attempt < 2 and adapters.current().COBATCH


def gather(worker: JobContext, lead: job_life.Life) -> list[jobs.Job]:
    """Up to ``NDIF_COBATCH_MAX - 1`` of the model's waiting jobs that may share
    with ``lead``, taken out of the queue and reported as this worker's."""
    key = lead.job.model_key
    # The first few of each list: the jobs that run next (a long queue is not read whole for each job).
    waiting = [entry for entry in queues.waiting(worker.redis, queue_for(key), first=2 * worker.settings.cobatch_max)
               if entry.job.trusted and entry.job.attempt < 2 and entry.job.model_key == key
               and entry.job.id != lead.job.id]
    waiting = waiting[:worker.settings.cobatch_max - 1]
    return worker.slot.take(waiting) if waiting else []


def perform(worker: JobContext, lead: job_life.Life) -> None:
    """``job.run``'s ``perform`` for a job that may lead a co-batch: gather,
    run together, answer every taken job; the lead's own answer is delivered,
    or raised for ``job.run`` to fail it. Without partners, ``job.perform``."""
    lives: list = []
    answered: set = set()
    try:
        for job in gather(worker, lead):
            life = _join(worker, job)
            if life is not None:
                lives.append(life)
        if not lives:
            return job_life.perform(worker, lead)
        _together(worker, lead, lives, answered)
    except BaseException as error:
        # The batch ended as a whole (a server fault, an interruption): every
        # started job not answered yet gets this answer (dropped by its channel
        # where the deadline already answered it), and a job taken but never
        # started goes back to its queue.
        for life in lives:
            if life.job.id not in answered:
                _answer(worker, life, error, 0.0, answered)
        _send_back(worker, [j for j in worker.slot.batch if j not in answered and j not in {x.job.id for x in lives}])
        raise
    finally:
        for life in lives:
            if not life.handed:  # else the delivery thread closes it, once delivered
                job_life.close(worker, life)


def _join(worker: JobContext, job: jobs.Job):
    """A taken job started and announced RUNNING, as ``job.run`` does; None if
    it is not to run (it ended meanwhile) or was answered already (its payload gone)."""
    life = job_life.start(worker, job, bounded=False)
    if life is None or life is job_life.SENT_BACK:
        return None
    try:
        job_life.announce(worker, life)
    except Exception as error:  # noqa: BLE001 - answered, like any job
        job_life.fail(worker, life, error)
        job_life.close(worker, life)
        return None
    return life


def _together(worker: JobContext, lead: job_life.Life, lives: list, answered: set) -> None:
    runs = [(life.job, life.blob, life.channel, life.meta) for life in (lead, *lives)]
    lead.jobs_run = len(runs)  # its finish counts them all towards the next whole weight check
    started = time.perf_counter()
    lead_answer, *answers = worker.in_process.run_together(lead.model, runs)
    run_ms = ms_since(started)
    log.info("co-batch of %d jobs on %s led by %s: %.0f ms", len(runs), lead.job.model_key, lead.job.id, run_ms)
    handed = [(life, _within_limit(worker, life, answer, run_ms)) for life, answer in zip(lives, answers)]
    lead_answer = _within_limit(worker, lead, lead_answer, run_ms)
    if isinstance(lead_answer, BaseException):  # the lead's own error is raised for job.run to fail
        job_life.hand_over(worker, handed)
        answered.update(life.job.id for life, _ in handed)
        raise lead_answer
    # Every job's answer at once, delivered while the next job starts (life.hand_over).
    job_life.hand_over(worker, [*handed, (lead, lead_answer)])
    answered.update(life.job.id for life, _ in handed)


def _within_limit(worker: JobContext, life: job_life.Life, answer, run_ms: float):
    """The job's result bytes within the result limit, or the exception that is its answer."""
    if isinstance(answer, BaseException):
        return answer
    try:
        return job_life.within_limit(worker, life, answer, run_ms)
    except Exception as error:  # noqa: BLE001 - one job's result, one job's answer
        return error


def _answer(worker: JobContext, life: job_life.Life, answer, run_ms: float, answered: set) -> None:
    """One job of the batch answered now: its result delivered, or its ERROR."""
    answered.add(life.job.id)
    job_life.answer(worker, life, _within_limit(worker, life, answer, run_ms))


def _send_back(worker: JobContext, job_ids: list) -> None:
    """Jobs taken for a batch that ended before they started: back to their queue
    (unless they ended, or are still waiting there)."""
    if not job_ids:
        return
    try:
        for job_id in job_ids:
            raw = worker.redis.get(jobs.message_key(job_id))
            if raw is None or jobs.finished(worker.redis, job_id):
                continue
            job = jobs.Job.from_message(json.loads(raw))
            if all(entry.job.id != job_id for entry in queues.waiting(worker.redis, queue_for(job.model_key))):
                turns.send(worker.redis, worker.app, job, worker.settings)
                log.warning("job %s: taken for a co-batch that ended before it started; sent back", job_id)
    except Exception:  # noqa: BLE001 - the watchdog rescues them if this worker dies; log the rest
        log.exception("could not send back the jobs of an ended co-batch: %s", job_ids)
