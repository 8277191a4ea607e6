"""The farm's watchdog: jobs whose worker vanished, and queues nobody serves.

It runs in ``ndif-celery beat`` (:mod:`ndif_celery.beat`), not in the
workers: a watchdog in a worker dies with it, and on a one-worker farm whose
worker was killed (``kill -9``, the OOM killer) nobody would notice, and its
client would wait forever. The beat runs no job and imports no torch, and leads with a Redis lease (:data:`LEADER`), so two beats are safe:
one of them looks, the other takes over within :data:`LEASE_MS` if it dies.

Every :data:`INTERVAL_S` the leader

1. buries the workers silent for ``registry.STALE_S`` and rescues the jobs each
   one was running (``registry.running_jobs``: a co-batch's every job);
2. rescues the jobs of workers that restarted under the same name before they
   went stale (the new process hands its predecessor's job over in
   ``registry.ORPHANS`` when it registers: ``registry.take_over``);
3. tells the jobs waiting for a model that no live worker holds (none alive,
   or none placed it for :data:`UNSERVED_GRACE_S`) that nobody serves it right
   now, once per change (``ndif:job:<id>:unserved``), not every tick;
4. re-sends the jobs accepted but neither queued, nor running on a live
   worker, nor ended, for :data:`LOST_AFTER_S` (``jobs.OPEN``): the broker
   handed the message to a worker connection that was already dead (a host's
   link cut while its worker idled), and its own redelivery waits for the
   visibility timeout (hours). Watched rather than acknowledged differently:
   Celery's late acknowledgement is what keeps a running job's message safe,
   and the loss happens inside the broker's delivery, where the farm cannot
   hook in; the states a job can be in are all readable in Redis;
5. first of all, answers the jobs still running :data:`OVERDUE_S` past their
   deadline (``jobs.DEADLINES``, written by the worker's deadline watch) with
   the timeout ERROR: their worker did not, because the job's code holds the
   GIL in a C call and no thread of that process runs
   (``workers.job.deadline``: its backstop restarts the process). The ERROR is
   claimed like any final status (``StatusChannel.claim_final``), so a worker
   that answers at the same moment sends nothing twice.

A rescue is exactly once per job: ``jobs.lost_key`` is set NX before anything
is sent (by whichever watchdog, for whichever reason, gets there first). The
job is sent again as attempt 2; a job already on attempt 2 ends with ERROR
instead; a job that already ended is left alone. A copy the broker redelivers
later is dropped by the worker (``workers.job.life.start``: ended jobs are skipped).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Optional

from ndif_celery import config, messages, statuses, wire
from ndif_celery.celery_app import make_app
from ndif_celery.state import jobs, leases, queues, registry, turns

log = logging.getLogger("ndif_celery.watchdog")

LEADER = "ndif:watchdog:leader"
LEASE_MS = 10_000
INTERVAL_S = 2.0
# Live workers exist but none holds (or is loading) the model this long: say so.
UNSERVED_GRACE_S = 15.0
# A running job this long past its deadline was not answered by its worker: answer it here.
OVERDUE_S = 1.0
# An accepted job seen neither queued, nor running, nor ended this long is lost: sent again.
LOST_AFTER_S = 10.0


def unserved_key(job_id: str) -> str:
    """Present while the job was told that no worker serves its model."""
    return f"ndif:job:{job_id}:unserved"


class FarmWatchdog(threading.Thread):
    """One copy per beat process; the lease makes one of them act."""

    def __init__(self, settings: config.Settings, redis_client=None, app=None, name: Optional[str] = None) -> None:
        super().__init__(name="ndif-watchdog", daemon=True)
        self.settings = settings
        self.redis = redis_client or jobs.connect(settings.redis_url, settings.redis_outage_s)
        self.app = app or make_app(settings)
        self.me = name or f"watchdog-{id(self):x}@{time.time():.0f}"
        self.lease = leases.Lease(self.redis, LEADER, self.me, LEASE_MS)
        self.unserved_since: dict[str, float] = {}
        self.unseen_since: dict[str, float] = {}  # open jobs found nowhere, since when
        self.stopping = threading.Event()

    def run(self) -> None:
        self.lease.lead(self.tick, self.stopping, INTERVAL_S, log, "watchdog tick")

    def stop(self) -> None:
        self.stopping.set()

    def tick(self, now: Optional[float] = None) -> None:
        now = time.time() if now is None else now
        self.answer_overdue(now)
        self.bury_dead_workers(now)
        self.rescue_orphans()
        self.find_lost(now)
        self.tell_unserved(now)

    # -- jobs whose worker cannot answer -----------------------------------------

    def answer_overdue(self, now: float) -> None:
        """The timeout ERROR for every job running :data:`OVERDUE_S` past its deadline."""
        for raw in self.redis.zrangebyscore(jobs.DEADLINES, 0, now - OVERDUE_S):
            job_id = raw.decode()
            self.redis.zrem(jobs.DEADLINES, job_id)
            if statuses.answer_for_worker(self.redis, job_id, self.settings.job_ttl_s, self.me,
                                          messages.timed_out_unanswered(self.settings.execution_timeout_s), "timeout"):
                log.warning("job %s: past its deadline and not answered by its worker; its ERROR sent", job_id)

    # -- jobs whose worker is gone ---------------------------------------------

    def bury_dead_workers(self, now: float) -> None:
        """A worker silent for ``STALE_S`` is dead: forget it and its models,
        and rescue the jobs it was running (every job of a co-batch)."""
        for name, info in registry.all_workers(self.redis).items():
            silent = now - info.get("last_seen", 0)
            if silent <= registry.STALE_S:
                continue
            log.warning("worker %s is gone (silent for %.0f s)", name, silent)
            for job_id in registry.running_jobs(info):
                self.rescue(job_id, name)
            registry.unregister_worker(self.redis, name, pid=info.get("pid"))

    def rescue_orphans(self) -> None:
        """Jobs handed over by a worker that restarted under its predecessor's name."""
        for job_id, raw in self.redis.hgetall(registry.ORPHANS).items():
            self.redis.hdel(registry.ORPHANS, job_id)
            worker = json.loads(raw).get("worker", "a worker")
            log.warning("worker %s restarted while running job %s", worker, job_id.decode())
            self.rescue(job_id.decode(), worker)

    def rescue(self, job_id: str, worker: str) -> bool:
        """Send the job again once (attempt 2), or end it with ERROR; False
        when it was rescued before or already ended."""
        if not self.redis.set(jobs.lost_key(job_id), worker, nx=True, ex=self.settings.job_ttl_s):
            return False
        raw = self.redis.get(jobs.message_key(job_id))
        if raw is None or jobs.finished(self.redis, job_id):
            return False
        job = jobs.Job.from_message(json.loads(raw))
        channel = statuses.StatusChannel(self.redis, job, self.settings.job_ttl_s)
        if job.attempt >= 2:
            if channel.claim_final(self.me):
                channel.send(wire.ERROR, messages.worker_lost_twice(worker), kind="worker_lost")
            return True
        job.attempt += 1
        self.redis.zrem(jobs.DEADLINES, job.id)  # attempt 1's: attempt 2 records its own when it runs
        self.redis.set(jobs.message_key(job.id), jobs.dumps(job.to_message()), keepttl=True)
        turns.send(self.redis, self.app, job, self.settings)
        channel.send(wire.QUEUED, messages.worker_lost_again(worker))
        registry.wake_controller(self.redis, "rescued")
        log.warning("job %s lost with worker %s: sent again (attempt 2)", job.id, worker)
        return True

    def find_lost(self, now: float) -> None:
        """Jobs accepted :data:`LOST_AFTER_S` ago or more that are nowhere: not in a
        queue, not reported by a live worker (its job or co-batch), not ended.
        Found nowhere on every look for :data:`LOST_AFTER_S`, a job is rescued
        (a message a worker took a moment ago is not reported yet, but is by the
        next look)."""
        candidates = [raw.decode() for raw in self.redis.zrangebyscore(jobs.OPEN, 0, now - LOST_AFTER_S)]
        if not candidates:
            self.unseen_since.clear()
            return
        queued = {entry.job.id for queue in queues.model_queues(self.redis)
                  for entry in queues.waiting(self.redis, queue)}
        running = {job_id for info in registry.live_workers(self.redis, now).values()
                   for job_id in registry.running_jobs(info)}
        unseen = {}
        for job_id in candidates:
            if job_id in queued or job_id in running:
                continue
            if jobs.finished(self.redis, job_id) or not self.redis.exists(jobs.message_key(job_id)):
                self.redis.zrem(jobs.OPEN, job_id)  # ended (or expired) without a word here
                continue
            unseen[job_id] = since = self.unseen_since.get(job_id, now)
            if now - since >= LOST_AFTER_S:
                log.warning("job %s was accepted but is neither queued, nor running, nor ended: lost "
                            "between the broker and a worker", job_id)
                if self.rescue(job_id, messages.LOST_IN_DELIVERY):
                    unseen.pop(job_id)
        self.unseen_since = unseen

    # -- queues nobody serves ----------------------------------------------------

    def tell_unserved(self, now: float) -> None:
        workers = registry.live_workers(self.redis, now)
        served = {entry["model_key"] for entry in registry.live_deployments(self.redis, workers)}
        waiting_models = set()
        for queue in queues.model_queues(self.redis):
            entries = queues.waiting(self.redis, queue)
            if not entries:
                continue
            model_key = entries[0].job.model_key
            waiting_models.add(model_key)
            if model_key in served:
                self.unserved_since.pop(model_key, None)
                for entry in entries:
                    self.redis.delete(unserved_key(entry.job.id))  # told again if it stops being served
                continue
            since = self.unserved_since.setdefault(model_key, now)
            if workers and now - since < UNSERVED_GRACE_S:
                continue  # the controller is placing it
            for entry in entries:
                if self.redis.set(unserved_key(entry.job.id), "1", nx=True, ex=self.settings.job_ttl_s):
                    statuses.StatusChannel(self.redis, entry.job, self.settings.job_ttl_s).send(
                        wire.QUEUED, messages.unserved(model_key))
        self.unserved_since = {k: v for k, v in self.unserved_since.items() if k in waiting_models}
