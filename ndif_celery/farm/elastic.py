"""Elastic workers: ask the cluster for a worker while jobs wait; it leaves when idle.

The beat runs this (``ndif_celery.beat``): it lives when no worker does. One
beat leads, by a lease. Every :data:`INTERVAL_S` the leader:

1. reads what the scheduler says of each launch (``state.launches``):
   pending and why, running, ended and how; a launch whose worker has
   registered is matched to it by name (``slurm<id>@<host>``);
2. launches a worker for a model whose oldest job has waited
   ``NDIF_LAUNCH_AFTER_S``, when no launched worker of its runtime is on its
   way (pending, or started and not yet registered), launching is not
   paused, and fewer than ``NDIF_LAUNCH_MAX_WORKERS`` launches are alive;
3. tells that model's waiting jobs what the launch is doing, once per
   change; a launch the scheduler refuses fails them with its reason.

Leaving is the worker's own: a launch sets ``NDIF_WORKER_IDLE_EXIT_S`` to
``NDIF_LAUNCH_IDLE_S``, the worker exits when idle that long, its batch
script ends and the allocation with it. The controller (in the workers) then
places the models on whoever joined: replicas grow and shrink as before.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import redis

from ndif_celery import config, statuses, wire
from ndif_celery.farm import launchers
from ndif_celery.policy import model_policy
from ndif_celery.state import jobs, launches, leases, queues, registry

log = logging.getLogger("ndif_celery.elastic")

LEADER = "ndif:elastic:leader"
LEASE_MS = 10_000
INTERVAL_S = 2.0
#: An ended launch stays listed this long, so an operator reads how it ended.
KEEP_ENDED_S = 600.0


def may_launch(client: redis.Redis, settings: config.Settings) -> bool:
    """Whether a model no live worker can hold may wait for a launched worker
    instead of failing its jobs (the controller asks)."""
    if not settings.launcher or not settings.launch_max_workers or launches.paused(client):
        return False
    known = launches.alive(launches.read(client))
    return len(known) < settings.launch_max_workers or any(not launch.get("worker") for launch in known)


def worker_of(launch_id: str, launcher: str, workers: dict) -> Optional[str]:
    """The live worker a launch started (the batch script names it ``slurm<id>@<host>``)."""
    prefix = f"{launcher}{launch_id}@"
    return next((name for name in workers if name.startswith(prefix)), None)


class Elastic(threading.Thread):
    """One copy per beat process with ``NDIF_LAUNCHER`` set; the lease makes one act."""

    def __init__(self, settings: config.Settings, redis_client=None, launcher=None,
                 name: Optional[str] = None) -> None:
        super().__init__(name="ndif-elastic", daemon=True)
        self.settings = settings
        self.redis = redis_client or jobs.connect(settings.redis_url, settings.redis_outage_s)
        self.launcher = launcher or launchers.for_settings(settings)
        self.me = name or f"elastic-{id(self):x}@{time.time():.0f}"
        self.lease = leases.Lease(self.redis, LEADER, self.me, LEASE_MS)
        self.told: dict[str, str] = {}  # model key -> what its waiting jobs were last told
        self.stopping = threading.Event()

    def run(self) -> None:
        self.lease.lead(self.tick, self.stopping, INTERVAL_S, log, "elastic tick")

    def stop(self) -> None:
        self.stopping.set()

    def tick(self, now: Optional[float] = None) -> None:
        now = time.time() if now is None else now
        known = launches.read(self.redis)
        self.follow(known, now)
        self.launch_for_waiting(known, now)

    # -- 1. what became of each launch --------------------------------------------

    def follow(self, known: dict, now: float) -> None:
        ours = [launch for launch in launches.alive(known) if launch["launcher"] == self.launcher.name]
        states = self.launcher.states([launch["id"] for launch in ours]) if ours else {}
        workers = registry.live_workers(self.redis, now)
        for launch in ours:
            said = states.get(launch["id"])
            before = dict(launch)
            if said is not None:
                launch["state"], launch["reason"] = said.state, said.reason
            worker = worker_of(launch["id"], self.launcher.name, workers)
            if worker and not launch.get("worker"):
                launch["worker"], launch["joined_at"] = worker, now
                log.info("launch %s joined the farm as %s", launch["id"], worker)
            if launch["state"] == launches.ENDED:
                launch["ended_at"] = now
                log.info("launch %s ended%s", launch["id"], f": {launch['reason']}" if launch["reason"] else "")
            if launch != before:
                launches.write(self.redis, launch)
        for launch in known.values():
            if launch["state"] not in (launches.PENDING, launches.RUNNING) and \
                    now - launch.get("ended_at", now) > KEEP_ENDED_S:
                self.redis.hdel(launches.LAUNCHES, launch["id"])

    # -- 2 and 3. launching for the waiting -----------------------------------------

    def launch_for_waiting(self, known: dict, now: float) -> None:
        for queue in queues.model_queues(self.redis):
            entries = queues.waiting(self.redis, queue)
            if not entries:
                continue
            model_key = entries[0].job.model_key
            if now - min(entry.job.received_at for entry in entries) < self.settings.launch_after_s:
                continue
            runtime = model_policy.parse(model_key).nnsight
            lost = self.lost_launch(known, runtime, now)
            if lost is not None:
                self.fail(queue, model_key, f"Could not start a worker for {wire.repo_id(model_key)}: "
                                            f"{self.launcher.name} job {lost['id']} ended before it joined the farm"
                                            f"{': ' + lost['reason'] if lost.get('reason') else ''}.")
                continue
            live = launches.alive(known)
            coming = [launch for launch in live if not launch.get("worker") and launch.get("nnsight", "") == runtime]
            if coming:
                self.tell(entries, model_key, self.on_its_way(coming[0]))
            elif launches.paused(self.redis):
                self.tell(entries, model_key, f"No worker is free for {wire.repo_id(model_key)}, and launching "
                                              "workers is paused by the farm's operator; your job stays queued.")
            elif len(live) >= self.settings.launch_max_workers:
                self.tell(entries, model_key, f"No worker is free for {wire.repo_id(model_key)}, and the farm has "
                                              f"launched as many workers as it may ({len(live)}); your job stays "
                                              "queued.")
            else:
                launch = self.launch(model_key, runtime, queue, now)
                if launch is not None:
                    known[launch["id"]] = launch
                    self.tell(entries, model_key, self.on_its_way(launch))

    def launch(self, model_key: str, runtime: str, queue: str, now: float) -> Optional[dict]:
        """Submit one worker; on refusal, fail the queue's jobs with the scheduler's reason."""
        repo = wire.repo_id(model_key)
        try:
            launch_id = self.launcher.submit(["--nnsight", runtime] if runtime else [])
        except launchers.LaunchRefused as refused:
            reason = f"Could not launch a worker for {repo}: {self.launcher.name} refused it: {refused}"
            log.warning("%s", reason)
            launches.write(self.redis, {"id": f"refused-{now:.0f}", "launcher": self.launcher.name,
                                        "state": launches.REFUSED, "reason": str(refused), "model_key": model_key,
                                        "nnsight": runtime, "submitted_at": now, "ended_at": now})
            self.fail(queue, model_key, reason)
            return None
        log.info("launched %s %s for %s", self.launcher.name, launch_id, repo)
        launch = {"id": launch_id, "launcher": self.launcher.name, "state": launches.PENDING, "reason": "",
                  "model_key": model_key, "nnsight": runtime, "submitted_at": now}
        launches.write(self.redis, launch)
        return launch

    def lost_launch(self, known: dict, runtime: str, now: float) -> Optional[dict]:
        """The latest launch of ``runtime``, if it ended lately without its worker
        ever joining: launching again would fail the same way, every tick."""
        mine = [launch for launch in known.values()
                if launch.get("nnsight", "") == runtime and launch["state"] == launches.ENDED]
        latest = max(mine, key=lambda launch: launch["submitted_at"], default=None)
        if latest is None or latest.get("worker") or now - latest.get("ended_at", 0) > self.settings.launch_after_s:
            return None
        if any(launch["submitted_at"] > latest["submitted_at"] for launch in launches.alive(known)):
            return None
        return latest

    def fail(self, queue: str, model_key: str, reason: str) -> None:
        """End every job waiting in ``queue`` with ERROR ``reason``: nobody waits for a worker that will not come."""
        for job in queues.drain(self.redis, queue):
            statuses.StatusChannel(self.redis, job, self.settings.job_ttl_s).send(wire.ERROR, reason, kind="deploy")
        self.told.pop(model_key, None)

    def on_its_way(self, launch: dict) -> str:
        what = f"{self.launcher.name} job {launch['id']}"
        if launch["state"] == launches.PENDING:
            why = f" ({launch['reason']})" if launch.get("reason") else ""
            return f"A worker is being launched for your job: {what} is pending{why}."
        return f"A worker is being launched for your job: {what} is starting."

    def tell(self, entries: list, model_key: str, text: str) -> None:
        """QUEUED with ``text`` to each waiting job of the model, once per change."""
        if self.told.get(model_key) == text:
            return
        self.told[model_key] = text
        for entry in entries:
            statuses.StatusChannel(self.redis, entry.job, self.settings.job_ttl_s).send(wire.QUEUED, text)
