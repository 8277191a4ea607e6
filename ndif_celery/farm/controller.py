"""The farm controller: decides which worker holds which model.

Every worker runs this loop in a background thread, and one of them at a time
leads (a Redis lease that expires when its holder dies, so another worker takes
over within seconds). The leader, on every tick or when woken:

1. places models that have jobs waiting and no worker holding them (the first
   request for a model deploys it), or fails every waiting job with the reason
   when nothing can hold the model;
2. keeps operator deployments (``ndif-celery deploy``) at their replica count,
   pins and unpins the models of scheduled windows on time (``ndif_celery.farm.schedules``),
   writes ``NDIF_DEPLOYMENTS`` into them when it starts leading and whenever a
   worker joins (``ndif_celery.farm.deployments``);
3. adds a replica when a model's oldest waiting job has waited too long, and
   removes extra replicas that sat idle;
4. tells waiting clients their new queue position when it changes (at most
   once a second each).

Dead workers and the jobs they were running are not its business: it dies
with the workers, so the watchdog runs in ``ndif-celery beat``
(``ndif_celery.farm.watchdog``). Nor is the ledger: its drain is a thread of
its own beside this one (``ndif_celery.accounts.ledger.Drainer``), so a slow
database never delays a tick.

It only decides and sends: loading and evicting run on the chosen worker as
tasks on that worker's own queue, one thing at a time with its jobs.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import defaultdict
from typing import Optional

from ndif_celery import config, messages, statuses, wire
from ndif_celery.celery_app import EVICT_MODEL, LOAD_MODEL, worker_queue
from ndif_celery.farm import deployments, elastic, schedules
from ndif_celery.monitoring import probes
from ndif_celery.notices import Notices
from ndif_celery.policy import client_versions
from ndif_celery.policy import model_policy
from ndif_celery.state import leases, queues, registry, run_times

from . import placement, sizing

log = logging.getLogger("ndif_celery.controller")
LEADER = "ndif:controller:leader"
LEASE_MS = 5000
#: A waiting job is told a new position at most this often. Every job that
#: leaves the queue moves every job behind it, and a tick came with every
#: arrival (at most every 250 ms): with 16 clients waiting on one worker that
#: was tens of QUEUED a second, each through Redis, the web and a client
#: parsing it, on the CPU the forward needs; the client shows one line.
POSITION_EVERY_S = 1.0
#: The cached ``/status`` is rewritten at most this often (it lives
#: ``registry.STATUS_TTL_S``); a worker rewrites it at once when it loads or
#: evicts a model. Every tick (twice a second) was a whole document a second
#: time, in the process that runs the jobs.
STATUS_EVERY_S = 2.0


class Controller(threading.Thread):
    def __init__(self, name: str, redis_client, celery_app, settings: config.Settings) -> None:
        super().__init__(name="ndif-controller", daemon=True)
        self.worker = name
        self.redis = redis_client
        self.app = celery_app
        self.settings = settings
        self.positions: dict[str, tuple] = {}  # job id -> (the position it was told, when)
        self.last_scaled: dict[str, float] = {}
        self.wishes: dict[str, dict] = {}
        self.stopping = threading.Event()
        self.lease = leases.Lease(redis_client, LEADER, name, LEASE_MS)
        # The same trouble meets every tick (a model no worker can take): logged once per change.
        self.notices = Notices(log)
        self.known_workers: set = set()  # (name, pid) of the live workers the last tick saw
        self.status_at = 0.0  # when this controller last rewrote the cached /status
        self.failures: dict = {}  # model key -> {worker: failed load}, as this tick read them
        self.unmet: dict = {}  # model key -> why this tick could not keep its wish (registry.UNMET)
        self.unmet_written: dict = {}

    def run(self) -> None:
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(registry.WAKE)
        while not self.stopping.is_set():
            try:
                if self.lease.hold():
                    self.tick()
            except Exception:  # noqa: BLE001 - the controller must outlive any one bad tick
                log.exception("controller tick failed")
            try:
                if pubsub.get_message(timeout=self.settings.controller_interval_s):
                    while pubsub.get_message(timeout=0):
                        pass  # several wake-ups, one tick
            except Exception:  # noqa: BLE001 - broker blip: sleep and retry
                time.sleep(self.settings.controller_interval_s)
                pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(registry.WAKE)

    def stop(self) -> None:
        self.stopping.set()
        self.lease.release()

    # -- one look at the farm ------------------------------------------------

    def tick(self) -> None:
        now = time.time()
        farm = Farm.read(self.redis)
        self.boot_deployments(farm)
        for model_key in schedules.reconcile(self.redis, now):  # pins on time, unpins on time
            self.release(farm, model_key)
        wishes = self.wishes = registry.desired(self.redis)
        self.failures, self.unmet = registry.load_failures(self.redis), {}
        waiting_ids = set()
        for queue in queues.model_queues(self.redis):
            entries = queues.waiting(self.redis, queue)
            waiting_ids.update(entry.job.id for entry in entries)
            if not entries:
                continue
            self.tell_positions(entries, now, farm)
            model_key = entries[0].job.model_key
            wish = wishes.get(model_key, {})
            holders = farm.holders(model_key)
            if not holders:
                if self.refused(model_key, entries, wishes, queue) or self.probes_only(model_key, entries, wishes, queue):
                    continue
                self.place(farm, model_key, wish, fail_queue=queue)
            elif self.needs_replica(model_key, holders, now - min(e.job.received_at for e in entries), now):
                if self.place(farm, model_key, wish, evict=False):
                    self.last_scaled[model_key] = now
        for model_key, wish in wishes.items():
            # A pinned deployment takes its room back; an unpinned one evicted
            # for another model waits for free room (or its next request).
            if len(farm.holders(model_key)) < wish.get("replicas", 1):
                self.place(farm, model_key, wish, evict=bool(wish.get("pinned")))
        self.retire_idle(farm, wishes, now)
        self.write_unmet()
        if now - self.status_at >= STATUS_EVERY_S:
            registry.publish_status(self.redis)
            self.status_at = now
        self.positions = {k: v for k, v in self.positions.items() if k in waiting_ids}

    def boot_deployments(self, farm: "Farm") -> None:
        """``NDIF_DEPLOYMENTS`` into the wishes, on this controller's first tick as
        leader (the farm starts) and whenever a live worker is new to it (one
        joined, or restarted): what the file lists is deployed again, even after
        an ``evict``. Read afresh each time, so an edited file is applied."""
        live = {(name, info.get("pid")) for name, info in farm.workers.items()}
        joined, self.known_workers = live - self.known_workers, live
        if not joined or not self.settings.deployments:
            return
        try:
            entries = deployments.from_setting(self.settings.deployments,
                                               model_policy.ModelPolicy.from_settings(self.settings))
        except deployments.DeploymentsError as error:
            self.notices.warn("NDIF_DEPLOYMENTS", f"{error} (not applied)")
            return
        self.notices.cleared("NDIF_DEPLOYMENTS", "NDIF_DEPLOYMENTS applies again")
        applied = deployments.apply(self.redis, entries, source=deployments.BOOT)
        if applied.added or applied.changed:
            log.info("NDIF_DEPLOYMENTS applied (%s joined): added %s, changed %s",
                     ", ".join(sorted(name for name, _ in joined)), applied.added or "nothing",
                     applied.changed or "nothing")

    def write_unmet(self) -> None:
        """Why each wish is not kept, for ``ndif-celery deployments`` and the deploy
        that waits on it: rewritten while any is unmet (an operator's deploy clears
        its model's reason, and the next tick must say it again)."""
        for model_key, entry in self.unmet.items():
            known = self.unmet_written.get(model_key)
            if known and known["reason"] == entry["reason"] and not entry["failed"]:
                entry["at"] = known["at"]  # unmet since then
        if not self.unmet and not self.unmet_written:
            return
        pipe = self.redis.pipeline()
        pipe.delete(registry.UNMET)
        if self.unmet:
            pipe.hset(registry.UNMET, mapping={key: json.dumps(entry) for key, entry in self.unmet.items()})
        pipe.execute()
        self.unmet_written = self.unmet

    def refused(self, model_key: str, entries: list, wishes: dict, queue: str) -> bool:
        """The model policy again before a first deploy (``ndif_celery.policy.model_policy``),
        for jobs that reached the broker without the web: a key it refuses, or an
        untrusted-only queue for a model neither deployed by the operator nor
        listed in NDIF_MODELS, fails its jobs and loads nothing."""
        policy = model_policy.ModelPolicy.from_settings(self.settings)
        try:
            policy.loadable(model_key)
            key = model_policy.parse(model_key)
            if model_key not in wishes and not any(e.job.trusted for e in entries) and not policy.untrusted_may_deploy(key):
                raise model_policy.PolicyError(
                    f"Model {key.repo_id!r} is not deployed on this farm, and untrusted keys cannot deploy new models.")
        except model_policy.PolicyError as error:
            self.cannot(queue, f"Could not deploy: {error.detail}", model_key)
            return True
        return False

    def probes_only(self, model_key: str, entries: list, wishes: dict, queue: str) -> bool:
        """Only health probes wait for a model nobody holds or wants (it was evicted
        after they were accepted): end them rather than load it again (``ndif_celery.monitoring.probes``)."""
        owner = self.redis.get(probes.OWNER)
        if owner is None or model_key in wishes or any(e.job.owner != owner.decode() for e in entries):
            return False
        fail_waiting(self.redis, queue, "The health probe does not deploy models; this one was evicted.",
                     self.settings.job_ttl_s)
        return True

    def needs_replica(self, model_key: str, holders: list[dict], head_wait: float, now: float) -> bool:
        return (
            head_wait > self.settings.replica_wait_s
            and len(holders) < self.settings.max_replicas
            and all(h["state"] == registry.RUNNING for h in holders)
            and now - self.last_scaled.get(model_key, 0) > self.settings.autoscale_backoff_s
        )

    def tell_positions(self, entries: list[queues.Waiting], now: float, farm: "Farm") -> None:
        """QUEUED again when a waiting job's position changed since it was last
        told (first by the web: ``Job.queued_position``), at most every
        :data:`POSITION_EVERY_S` per job, with the wait the model's recent run
        times give (``state.run_times``)."""
        model_key = entries[0].job.model_key
        per_job = run_times.per_job_s(self.redis.lrange(run_times.key(model_key), 0, run_times.RECENT - 1))
        lanes = registry.lanes(farm.workers, farm.holders(model_key), model_key, now)
        for position, entry in enumerate(entries, start=1):
            known = self.positions.get(entry.job.id)
            if known is None and entry.job.queued_position:  # what the web told it
                known = (entry.job.queued_position, entry.job.queued_at)
            if known is None:
                self.positions[entry.job.id] = (position, now)
            elif known[0] != position and now - known[1] >= POSITION_EVERY_S:
                self.positions[entry.job.id] = (position, now)
                channel = statuses.StatusChannel(self.redis, entry.job, self.settings.job_ttl_s)
                wait = run_times.wait_s(position, per_job, lanes)
                channel.send(wire.QUEUED, messages.queued(entry.job.model_key, position, wait))
            else:
                self.positions[entry.job.id] = known

    # -- decisions -------------------------------------------------------------

    def place(
        self, farm: "Farm", model_key: str, wish: dict, fail_queue: Optional[str] = None, evict: bool = True
    ) -> bool:
        """Send a load to the best worker; on no room, fail ``fail_queue``'s jobs."""
        dtype = wish.get("dtype") or self.settings.default_dtype or None  # an operator's wish, else the farm's
        repo = wire.repo_fields(model_key)["repo_id"]
        try:
            model_policy.ModelPolicy.from_settings(self.settings).loadable(model_key)  # before sizing reads any config
        except model_policy.PolicyError as error:
            return self.cannot(fail_queue, f"Could not deploy: {error.detail}", model_key, failed=True)
        # An operator's wish is not loaded again where it failed to load (a request's model is: each
        # request tries again); when no other worker can take it, the wish has failed.
        failed_on = self.failures.get(model_key, {}) if wish else {}
        views = [view for view in farm.views(self.wishes) if view.name not in failed_on]
        try:
            weights = sizing.weight_bytes(model_key, dtype, self.redis)
            size = sizing.padded(weights, self.settings.padding_factor, self.settings.padding_bytes)
            key = model_policy.parse(model_key)
            chosen = placement.place(model_key, size, views, evict=evict, nnsight=key.nnsight, held=key.held)
        except sizing.SizingError as error:
            return self.cannot(fail_queue, str(error), model_key, failed=True)
        except placement.CannotHold as error:
            return self.cannot(fail_queue, f"Could not deploy {repo}: {error}", model_key, failed=True)
        except placement.NoRoom as error:
            if failed_on:
                why = "; ".join(f"on {worker}: {failure['reason']}" for worker, failure in sorted(failed_on.items()))
                return self.cannot(fail_queue, f"Could not deploy {repo}: it failed to load {why}", model_key,
                                   failed=True, at=max(failure["at"] for failure in failed_on.values()))
            if fail_queue is not None and elastic.may_launch(self.redis, self.settings):
                # Its jobs wait for a launched worker (ndif_celery.farm.elastic) instead of failing.
                return self.cannot(None, f"Could not deploy {repo} yet: {error}; a worker will be launched.", model_key)
            return self.cannot(fail_queue, f"Could not deploy {repo}: {error}.", model_key)
        self.notices.cleared(model_key, f"{repo} can be placed again")
        log.info("placing %s (%d bytes) on %s, evicting %s", repo, size, chosen.worker, chosen.evict or "nothing")
        registry.set_deployment(
            self.redis, chosen.worker, model_key, registry.DEPLOYING,
            size_bytes=size, weight_bytes=weights, dtype=dtype, assigned_at=time.time(),
        )
        farm.add(chosen.worker, model_key, size)
        for evicted in chosen.evict:
            farm.remove(chosen.worker, evicted)
        self.app.send_task(
            LOAD_MODEL,
            kwargs={"model_key": model_key, "dtype": dtype, "size_bytes": size, "evict": chosen.evict},
            queue=worker_queue(chosen.worker),
        )
        return True

    def cannot(self, fail_queue: Optional[str], reason: str, model_key: str, failed: bool = False,
               at: Optional[float] = None) -> bool:
        """A model that cannot be placed: say why (once per change, ``notices``; for a
        wish, in ``registry.UNMET``), and fail ``fail_queue``'s jobs with the reason
        (a first deploy nothing can hold). ``failed``: it will not place without an
        operator (its loads failed, its policy or size refuse it)."""
        self.notices.warn(model_key, reason)
        if model_key in self.wishes:
            self.unmet[model_key] = {"reason": reason, "failed": failed, "at": at or time.time()}
        if fail_queue is not None:
            fail_waiting(self.redis, fail_queue, reason, self.settings.job_ttl_s)
        return False

    def release(self, farm: "Farm", model_key: str) -> None:
        """A scheduled window closed and no wish keeps the model: evict it everywhere."""
        for holder in farm.holders(model_key):
            log.info("the schedule of %s ended; evicting it from %s", model_key, holder["worker"])
            self.app.send_task(EVICT_MODEL, kwargs={"model_key": model_key}, queue=worker_queue(holder["worker"]))
            farm.remove(holder["worker"], model_key)

    def retire_idle(self, farm: "Farm", wishes: dict, now: float) -> None:
        """Evict replicas beyond the wanted count that nobody used for a while."""
        for model_key in farm.model_keys():
            holders = [h for h in farm.holders(model_key) if h["state"] == registry.RUNNING]
            keep = max(1, wishes.get(model_key, {}).get("replicas", 1))
            idle = sorted(
                (h for h in holders if now - _last_activity(h) > self.settings.replica_idle_s),
                key=_last_activity,
            )
            for holder in idle[: max(0, len(holders) - keep)]:
                log.info("retiring idle replica of %s on %s", model_key, holder["worker"])
                self.app.send_task(EVICT_MODEL, kwargs={"model_key": model_key}, queue=worker_queue(holder["worker"]))
                farm.remove(holder["worker"], model_key)


def fail_waiting(redis_client, queue: str, reason: str, ttl_s: int) -> int:
    """End every job waiting in ``queue`` with ERROR ``reason``: nobody waits forever."""
    failed = queues.drain(redis_client, queue)
    for job in failed:
        statuses.StatusChannel(redis_client, job, ttl_s).send(wire.ERROR, reason, kind="deploy")
    return len(failed)


def _last_activity(holder: dict) -> float:
    return holder.get("last_used") or holder.get("loaded_at") or holder.get("created_at") or 0.0


class Farm:
    """The live workers and what each holds, as one tick sees them."""

    def __init__(self, workers: dict, deployments: list[dict]) -> None:
        self.workers = workers
        self.by_worker: dict[str, dict[str, dict]] = defaultdict(dict)
        for entry in deployments:
            self.by_worker[entry["worker"]][entry["model_key"]] = entry

    @classmethod
    def read(cls, redis_client) -> "Farm":
        workers = registry.live_workers(redis_client)
        return cls(workers, registry.live_deployments(redis_client, workers))

    def holders(self, model_key: str) -> list[dict]:
        return [held[model_key] for held in self.by_worker.values() if model_key in held]

    def model_keys(self) -> set[str]:
        return {key for held in self.by_worker.values() for key in held}

    def add(self, worker: str, model_key: str, size: int) -> None:
        self.by_worker[worker][model_key] = {
            "model_key": model_key, "worker": worker, "state": registry.DEPLOYING, "size_bytes": size,
        }

    def remove(self, worker: str, model_key: str) -> None:
        self.by_worker[worker].pop(model_key, None)

    def views(self, wishes: dict) -> list[placement.WorkerView]:
        return placement.views_of(self.workers, self.by_worker, wishes,
                                  lambda info: client_versions.as_runtime(info.get("nnsight", "")))
