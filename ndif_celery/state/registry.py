"""The farm's shared picture, kept in Redis: workers, deployments, wishes.

Workers write their own entries; the controller (one worker at a time, see
``ndif_celery.farm.controller``) decides placements; the web and the CLI read. A
worker refreshes its entry every few seconds; an entry older than ``STALE_S``
belongs to a dead worker and is ignored, together with the models it claimed,
so a killed worker disappears from ``/status`` without anyone cleaning up.

- hash ``ndif:workers``       worker name -> JSON {name, host, pid, gpus, memory_bytes, last_seen, current_job,
  batch, delivering, ...} (``current_job``: the job it runs, the lead of a co-batch; ``batch``: the other
  jobs of that co-batch, taken out of the queue so no broker message covers them; ``delivering``: jobs
  whose results its delivery thread still sends; ``running_jobs`` reads all three; for operators only:
  never in the open ``/status``)
- hash ``ndif:deployments``   "<worker>|<model_key>" -> JSON {model_key, worker, state, size_bytes, pinned, last_used, ...}
- hash ``ndif:desired``       model_key -> JSON {pinned, replicas, dtype, source}: what operators
  deployed (``source``: ``cli``, ``file``, ``boot``; a schedule's pin adds ``schedule`` and ``before``)
- hash ``ndif:load_failures`` "<worker>|<model_key>" -> JSON {worker, model_key, reason, at}: the last failed
  load of a model on a worker, until it loads there or an operator deploys it again
- hash ``ndif:unmet``         model_key -> JSON {reason, at, failed}: why the controller cannot keep a wish
  now, rewritten by the leading controller (``failed``: every worker that could take it failed to load it)
- hash ``ndif:sizes``         "<model_key>|<dtype>" -> estimated weight bytes
- set  ``ndif:queues``        every model queue a request has named
- hash ``ndif:queue_models``  queue -> model_key
- key  ``ndif:env``           the workers' Python and package versions, for ``GET /env``
- key  ``ndif:status``        the ``GET /status`` document, rewritten by the controller every tick
- channel ``ndif:controller`` wakes the controller (a new queue, a deploy, an evict)
- hash ``ndif:refs:<repo_id>`` branch or tag -> the commit it pointed at in the model cache of the
  worker that last loaded the repo (``policy.model_policy.same_weights``: one repo's weights named two ways)
- hash ``ndif:orphans``       job id -> JSON {worker, pid}: the job a worker process was running
  when it died, handed over by the next process of the same name (``take_over``) for the
  watchdog (``ndif_celery.farm.watchdog``) to rescue
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Optional

import redis

from ndif_celery import wire
from ndif_celery.policy import client_versions
from ndif_celery.policy import model_policy
from ndif_celery.state import launches

WORKERS = "ndif:workers"
DEPLOYMENTS = "ndif:deployments"
DESIRED = "ndif:desired"
SIZES = "ndif:sizes"
QUEUES = "ndif:queues"
QUEUE_MODELS = "ndif:queue_models"
ENV = "ndif:env"
STATUS = "ndif:status"
STATUS_TTL_S = 5
WAKE = "ndif:controller"
ORPHANS = "ndif:orphans"
LOAD_FAILURES = "ndif:load_failures"
UNMET = "ndif:unmet"
HEARTBEAT_S = 2.0
STALE_S = 10.0


def env_key(runtime: str = "") -> str:
    """Where the workers of ``runtime`` ("" the farm's own nnsight) write their environment (``GET /env``)."""
    return f"{ENV}:nnsight:{runtime}" if runtime else ENV


# Deployment states, as nnsight.status() reads `application_state`.
DEPLOYING = "DEPLOYING"
RUNNING = "RUNNING"


def register_worker(client: redis.Redis, info: dict) -> None:
    info = dict(info, last_seen=time.time())
    client.hset(WORKERS, info["name"], json.dumps(info))


def take_over(client: redis.Redis, name: str, pid: int) -> Optional[dict]:
    """A worker process starts under ``name``: forget what an earlier process of
    that name claimed (its models are not in this one), and hand the job it was
    running to the watchdog. Without this, a worker restarted (by ``up``'s
    supervisor) before it went stale would overwrite its predecessor's entry,
    and the job it died with would be lost in silence. Returns that entry."""
    raw = client.hget(WORKERS, name)
    if raw is None:
        return None
    old = json.loads(raw)
    if old.get("pid") == pid:
        return None
    for job_id in running_jobs(old):
        client.hset(ORPHANS, job_id, json.dumps({"worker": name, "pid": old.get("pid")}))
    unregister_worker(client, name)
    return old


def running_jobs(info: dict) -> list[str]:
    """Every job a worker entry says it runs: its ``current_job``, while it
    runs a co-batch the batch's other jobs (``workers.job.gather``), and the jobs
    whose results its delivery thread still sends (``workers.job.deliveries``),
    which no broker message covers: if the worker dies, the watchdog must
    rescue each one."""
    lead = info.get("current_job")
    others = [*(info.get("batch") or ()), *(info.get("delivering") or ())]
    return ([lead] if lead else []) + list(dict.fromkeys(job_id for job_id in others if job_id != lead))


# A worker's entry and its deployments deleted in one step, and with ARGV[2]
# (a pid) only while the entry is still that process's.
_UNREGISTER = """
if ARGV[2] ~= '' then
  local raw = redis.call('HGET', KEYS[1], ARGV[1])
  if not raw or tostring(cjson.decode(raw)['pid']) ~= ARGV[2] then
    return 0
  end
end
redis.call('HDEL', KEYS[1], ARGV[1])
local prefix = ARGV[1] .. '|'
for _, field in ipairs(redis.call('HKEYS', KEYS[2])) do
  if string.sub(field, 1, #prefix) == prefix then
    redis.call('HDEL', KEYS[2], field)
  end
end
return 1
"""


def unregister_worker(client: redis.Redis, name: str, pid: Optional[int] = None) -> bool:
    """Forget the worker ``name`` and the models it claimed; False if nothing was done.

    ``pid``: only if the entry is still that process's. The beat's watchdog
    judges a worker dead on an entry it read earlier; meanwhile ``up``'s
    supervisor may have restarted it under the same name, and the fresh
    process registered (``take_over``). Deleting by name would then erase the
    live worker: until its next heartbeat the farm would have no worker, and
    the controller would fail the rescued job with "no live worker can take
    another replica of it"."""
    return bool(client.eval(_UNREGISTER, 2, WORKERS, DEPLOYMENTS, name, "" if pid is None else str(pid)))


def deployment_field(worker: str, model_key: str) -> str:
    return f"{worker}|{model_key}"


def _merged(raw: Optional[bytes], worker: str, model_key: str, state: str, **extra) -> str:
    """The deployment entry ``raw`` (as read, or None) updated with ``extra``."""
    entry = json.loads(raw) if raw else {"model_key": model_key, "worker": worker, "created_at": time.time()}
    entry.update(extra, state=state, updated_at=time.time())
    return json.dumps(entry)


def set_deployment(client: redis.Redis, worker: str, model_key: str, state: str, **extra) -> None:
    field = deployment_field(worker, model_key)
    client.hset(DEPLOYMENTS, field, _merged(client.hget(DEPLOYMENTS, field), worker, model_key, state, **extra))


def touched(raw: Optional[bytes], worker: str, model_key: str) -> tuple[str, str]:
    """The deployment entry ``raw`` (as read) marked used now: ``(field, value)``
    to HSET into :data:`DEPLOYMENTS`, for a caller that batches its writes."""
    return deployment_field(worker, model_key), _merged(raw, worker, model_key, RUNNING, last_used=time.time())


def get_deployment(client: redis.Redis, worker: str, model_key: str) -> Optional[dict]:
    raw = client.hget(DEPLOYMENTS, deployment_field(worker, model_key))
    return json.loads(raw) if raw else None


def remove_deployment(client: redis.Redis, worker: str, model_key: str) -> None:
    client.hdel(DEPLOYMENTS, deployment_field(worker, model_key))


def all_workers(client: redis.Redis) -> dict:
    """Every registered worker, dead ones included (see ``live_workers``)."""
    return {name.decode(): json.loads(raw) for name, raw in client.hgetall(WORKERS).items()}


def live_workers(client: redis.Redis, now: Optional[float] = None) -> dict:
    return _live(client.hgetall(WORKERS), time.time() if now is None else now)


def _live(raw_workers: dict, now: float) -> dict:
    """The entries of ``ndif:workers`` (as read) seen within ``STALE_S``, by name."""
    workers = {}
    for name, raw in raw_workers.items():
        info = json.loads(raw)
        if now - info.get("last_seen", 0) <= STALE_S:
            workers[name.decode()] = info
    return workers


def live_deployments(client: redis.Redis, workers: Optional[dict] = None) -> list[dict]:
    workers = live_workers(client) if workers is None else workers
    entries = []
    for raw in client.hvals(DEPLOYMENTS):
        entry = json.loads(raw)
        if entry["worker"] in workers:
            entries.append(entry)
    return entries


def desired(client: redis.Redis) -> dict:
    return {k.decode(): json.loads(v) for k, v in client.hgetall(DESIRED).items()}


def record_load_failure(client: redis.Redis, worker: str, model_key: str, reason: str) -> None:
    """A load that failed on ``worker``: the controller tries another worker, never this one again
    for an operator's wish, until the operator deploys it again (``forget_load_failures``)."""
    client.hset(LOAD_FAILURES, deployment_field(worker, model_key),
                json.dumps({"worker": worker, "model_key": model_key, "reason": reason[:2000], "at": time.time()}))


def load_failures(client: redis.Redis) -> dict:
    """model key -> {worker: {reason, at}} of the loads that failed."""
    failures: dict = {}
    for raw in client.hvals(LOAD_FAILURES):
        entry = json.loads(raw)
        failures.setdefault(entry["model_key"], {})[entry["worker"]] = entry
    return failures


def forget_load_failures(client: redis.Redis, pipe, model_keys) -> None:
    """On ``pipe``: the failed loads and the unmet reasons of ``model_keys``, gone
    (an operator asked for them again: the controller tries every worker anew)."""
    model_keys = set(model_keys)
    fields = [field for field in client.hkeys(LOAD_FAILURES) if field.decode().split("|", 1)[-1] in model_keys]
    if fields:
        pipe.hdel(LOAD_FAILURES, *fields)
    if model_keys:
        pipe.hdel(UNMET, *model_keys)


def unmet(client: redis.Redis) -> dict:
    """model key -> {reason, at, failed}: the wishes the controller cannot keep now, and why."""
    return {k.decode(): json.loads(v) for k, v in client.hgetall(UNMET).items()}


def wake_controller(client: redis.Redis, reason: str = "") -> None:
    client.publish(WAKE, reason)


# Wakes the controller unless this queue woke it within ARGV[1] ms: one round
# trip, and a burst of requests costs the controller one tick, not one each.
_WAKE_ONCE = """
if redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[1]) then
  return redis.call('PUBLISH', KEYS[2], ARGV[2])
end
return -1
"""


def wake_controller_once(client: redis.Redis, queue: str, within_ms: int = 250) -> None:
    client.eval(_WAKE_ONCE, 2, f"ndif:woken:{queue}", WAKE, within_ms, queue)


def status_document(client: redis.Redis, operator: bool = False) -> dict:
    """``GET /status`` in the shape ``nnsight.status()`` parses: one entry per replica,
    plus the cluster: each worker with its GPUs and memory used and free.

    ``/status`` is open, so the public document names no job: a running job's
    id is a handle on its status and result (with auth off, all it takes).
    ``operator=True`` (the CLI, the admin dashboard) adds each worker's
    ``current_job`` and the launches (``state.launches``)."""
    workers = live_workers(client)
    deployments = live_deployments(client, workers)
    wishes = desired(client)
    entries = {}
    used: dict[str, int] = {}
    for entry in deployments:
        key = entry["model_key"]
        used[entry["worker"]] = used.get(entry["worker"], 0) + entry.get("size_bytes", 0)
        fields = wire.repo_fields(key)
        entries[f"{entry['worker']}:{key}"] = {
            "model_key": key,
            **fields,
            "nnsight": fields.get("nnsight") or client_versions.MAIN,  # the runtime that serves it
            "deployment_level": "HOT",
            "application_state": entry["state"],
            "worker": entry["worker"],
            "pinned": bool(wishes.get(key, {}).get("pinned")),
            # nnsight 0.5-0.7's status() reads it (and fails without it); 0.8 ignores it.
            "dedicated": True,
            "size_bytes": entry.get("size_bytes"),
            "dtype": entry.get("dtype"),
            # The weights as estimated before the load, and as loaded (size_bytes: as placed, padded).
            "weight_bytes": entry.get("weight_bytes"),
            "measured_bytes": entry.get("measured_bytes"),
            "loaded_at": entry.get("loaded_at"),
            "load_seconds": entry.get("load_seconds"),
            "last_used": entry.get("last_used"),
        }
    hot = {entry["repo_id"] for entry in entries.values()}
    for info in workers.values():
        for repo in info.get("cached", []):
            if repo not in hot:
                # As NDIF lists them: on a worker's disk, loaded nowhere (nnsight.status skips them).
                entries[repo] = {"repo_id": repo, "deployment_level": "COLD"}
    cluster = {}
    for name, info in workers.items():
        budget = info.get("memory_bytes", 0)
        cluster[name] = {
            "host": info.get("host"),
            "pid": info.get("pid"),
            "gpus": info.get("gpus", []),
            "memory_bytes": budget,
            "memory_used_bytes": used.get(name, 0),
            "memory_free_bytes": max(0, budget - used.get(name, 0)),
            **({"current_job": info.get("current_job")} if operator else {}),
            "last_seen": info.get("last_seen"),
            "metrics_port": info.get("metrics_port"),
            "nnsight": info.get("nnsight") or client_versions.MAIN,
            "python": info.get("python"),  # its interpreter's major.minor: where a 0.5 payload can run
        }
    document = {"deployments": entries, "cluster": {"workers": cluster}}
    if operator:  # workers asked of the cluster's scheduler (ndif_celery.farm.elastic)
        document["cluster"]["launches"] = sorted(launches.read(client).values(), key=lambda row: row["submitted_at"])
    return document


def runtime_status(document: dict, runtime: str) -> dict:
    """``/status`` as a runtime's own port serves it (``NDIF_RUNTIME_PORTS``):
    that runtime's deployments and workers only, each key as its clients
    write it, so their ``nnsight.status()`` and ``is_model_running()`` tell
    the truth about the runtime they would run on."""
    entries = {}
    for name, entry in document.get("deployments", {}).items():
        if entry.get("deployment_level") == "COLD":
            entries[name] = entry  # on a disk: any runtime can load it
        elif entry.get("nnsight") == runtime:
            entries[name] = dict(entry, model_key=model_policy.family_key(entry["model_key"]))
    workers = {name: info for name, info in document.get("cluster", {}).get("workers", {}).items()
               if info.get("nnsight") == runtime}
    return {"deployments": entries, "cluster": {"workers": workers}}


def publish_status(client: redis.Redis) -> None:
    """Refresh the cached ``/status`` document (the controller does, every tick)."""
    client.set(STATUS, json.dumps(status_document(client)), ex=STATUS_TTL_S)


def cached_status(client: redis.Redis) -> bytes:
    """The ``/status`` document as JSON: the controller's copy, or computed now
    when no controller has written one lately (no worker alive)."""
    raw = client.get(STATUS)
    return raw if raw is not None else json.dumps(status_document(client)).encode()


@dataclass
class Offer:
    """What the farm offers now, as one request's intake reads it.

    ``keys``: deployed on a live worker (any state) or by the operator;
    ``serving``: running on a live worker (a job for it needs no controller);
    ``desired``: the operators' deployments (``desired``); ``refs``: the
    branches and tags (``refs``) of ``repo_id``, the repo asked for."""

    keys: set
    serving: set
    desired: dict
    refs: dict
    repo_id: str = ""
    workers: dict = field(default_factory=dict)  # the live workers' entries, by name
    deployments: list = field(default_factory=list)  # the live workers' deployment entries

    def refs_of(self, client: redis.Redis, repo_id: str) -> dict:
        return self.refs if repo_id == self.repo_id else refs(client, repo_id)


def offer(client: redis.Redis, repo_id: str = "") -> Offer:
    """The farm's :class:`Offer` (with ``repo_id``'s refs), on one round trip."""
    pipe = client.pipeline(transaction=False)
    read_offer(pipe, repo_id)
    return decode_offer(pipe.execute(), repo_id)


def read_offer(pipe: "redis.client.Pipeline", repo_id: str = "") -> None:
    """Queue :func:`offer`'s reads on ``pipe`` first (with others of the caller's:
    one round trip); :func:`decode_offer` reads their answers."""
    pipe.hgetall(WORKERS)
    pipe.hvals(DEPLOYMENTS)
    pipe.hgetall(DESIRED)
    if repo_id:
        pipe.hgetall(_refs_key(repo_id))


def decode_offer(answers: list, repo_id: str = "") -> Offer:
    raw_workers, raw_deployments, raw_desired = answers[:3]
    raw_refs = answers[3:4] if repo_id else []
    live = _live(raw_workers, time.time())
    entries = [entry for entry in map(json.loads, raw_deployments) if entry["worker"] in live]
    desired = {key.decode(): json.loads(wish) for key, wish in raw_desired.items()}
    return Offer(keys={entry["model_key"] for entry in entries} | set(desired),
                 serving={entry["model_key"] for entry in entries if entry.get("state") == RUNNING},
                 desired=desired,
                 refs={name.decode(): sha.decode() for name, sha in (raw_refs[0] if raw_refs else {}).items()},
                 repo_id=repo_id, workers=live, deployments=entries)


def lanes(workers: dict, deployments: list[dict], model_key: str, now: float) -> list[Optional[float]]:
    """Each live replica of ``model_key`` serving now, as a waiting job's
    estimate needs it (``run_times.wait_s``): how long its worker's job has run
    (since the deployment was last used), or None for an idle worker."""
    found = []
    for entry in deployments:
        info = workers.get(entry["worker"])
        if entry["model_key"] != model_key or entry.get("state") != RUNNING or info is None:
            continue
        found.append(max(now - entry.get("last_used", now), 0.0) if info.get("current_job") else None)
    return found


def offered_keys(redis_client) -> set:
    """Keys deployed on a live worker (any state) or deployed by the operator."""
    return offer(redis_client).keys


def _refs_key(repo_id: str) -> str:
    return f"ndif:refs:{repo_id}"


def record_refs(client: redis.Redis, repo_id: str, refs: dict) -> None:
    """What ``repo_id``'s branches and tags point at, as a worker's cache says
    when it loads the repo (the last loader's picture replaces the one before)."""
    pipe = client.pipeline()
    pipe.delete(_refs_key(repo_id))
    if refs:
        pipe.hset(_refs_key(repo_id), mapping=refs)
    pipe.execute()


def refs(client: redis.Redis, repo_id: str) -> dict:
    """``repo_id``'s branches and tags -> commits, as last recorded (empty: none known)."""
    return {name.decode(): sha.decode() for name, sha in client.hgetall(_refs_key(repo_id)).items()}
