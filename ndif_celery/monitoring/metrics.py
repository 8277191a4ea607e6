"""Farm-wide Prometheus series, kept in Redis so every web process agrees.

Counters are Redis hashes that whoever sees the event increments, in the
pipeline it already sends (no Prometheus multiprocess mode, no state in any
one process); ``GET /metrics`` on any web reads them back and adds the farm's
current shape (queues, workers, deployments) through :class:`FarmCollector`.

- hash ``ndif:metrics:requests``  "<route>|<method>|<status>" -> count (the web's after_request)
- hash ``ndif:metrics:jobs``      "<outcome>|<kind>" -> count (a job's final status)
- hash ``ndif:metrics:bytes``     "result" / "payload" -> bytes of ended jobs
- hash ``ndif:metrics:phases``    "<phase>|<le>" -> jobs whose phase took at most le seconds
                                   (and more than the bucket below; "+Inf" past the last),
                                   "<phase>|sum" seconds, "<phase>|count" jobs

Series (all prefixed ``ndif_``): ``ndif_http_requests_total{route,method,status}``,
``ndif_jobs_total{outcome,kind}``, ``ndif_job_phase_seconds{phase}`` (histogram:
queue, deserialize, run, upload, total), ``ndif_result_bytes_total``,
``ndif_payload_bytes_total``, ``ndif_queue_depth{model,nnsight,model_key}``,
``ndif_queue_head_wait_seconds{model,nnsight,model_key}``, ``ndif_workers``,
``ndif_deployments{state}``, ``ndif_ledger_pending``,
``ndif_worker_replacements_total{worker}`` (workers that replaced themselves
because a job's code would not unwind from its deadline or a kill; counted
here, since the process that would count it exits: ``workers.job.deadline``),
the health probes' ``ndif_probe_ok``, ``ndif_probe_queued``, ``ndif_probe_latency_seconds``,
``ndif_probe_last_run_timestamp_seconds`` (each ``{model,nnsight,model_key}``: one series per
deployment, a runtime's apart) and ``ndif_probe_runs_total{model,nnsight,model_key,result}``
(``ndif_celery.monitoring.probes``), and usage per key, bounded to the top keys plus
``other``: ``ndif_usage_{jobs,errors,gpu_seconds,run_seconds,bytes_in,bytes_out}_total{key}``
(``ndif_celery.accounts.usage``).

Each worker serves its own series besides (``workers.metrics``).
"""

from __future__ import annotations

import logging
from typing import Optional

import redis

from ndif_celery.accounts import ledger
from ndif_celery.state import queues, registry

REQUESTS = "ndif:metrics:requests"
JOBS = "ndif:metrics:jobs"
BYTES = "ndif:metrics:bytes"
PHASES = "ndif:metrics:phases"
REPLACEMENTS = "ndif:metrics:replacements"  # worker name -> times it replaced itself

PHASE_NAMES = ("queue", "deserialize", "run", "upload", "total")
# Seconds; a job's phases run from milliseconds (a cached trace) to an hour.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
           1800.0, 3600.0)
INF = "+Inf"
# The kind of a COMPLETED job, and the kinds of ERROR (see ``ledger``); each
# one is exported from the start (as 0), so rates and alerts have a series.
NO_KIND = "none"
ERROR_KINDS = ("user", "timeout", "cancelled", "store", "server", "deploy", "worker_lost", "error")

log = logging.getLogger("ndif_celery.metrics")


#: The labels of a series per deployment: the repo, the nnsight that serves it (a
#: runtime's deployment of a repo is another one) and the model key, which tells
#: apart any two deployments (a revision, a task), so no label set comes twice.
DEPLOYMENT_LABELS = ["model", "nnsight", "model_key"]


def deployment_labels(model_key: str, model: Optional[str] = None) -> tuple[str, str, str]:
    """``(model, nnsight, model_key)`` of a deployment; ``model`` when the key is unknown (a queue's own name)."""
    from ndif_celery.policy import model_policy

    from .probes import runtime_of

    try:
        repo = model_policy.parse(model_key).repo_id
    except Exception:  # noqa: BLE001 - a key written before the policy, or none
        repo = model or model_key
    return repo, runtime_of(model_key) if model_key else "", model_key


def bucket_of(seconds: float) -> str:
    """The hash field of the smallest bucket holding ``seconds``."""
    for le in BUCKETS:
        if seconds <= le:
            return _le(le)
    return INF


def _le(value: float) -> str:
    return repr(float(value))


def record_job(pipe, summary: dict) -> None:
    """Count an ended job (a ledger summary, see ``ledger.summary``) in ``pipe``."""
    pipe.hincrby(JOBS, f"{summary['outcome']}|{summary.get('error_kind') or NO_KIND}", 1)
    for field, key in (("result", "result_bytes"), ("payload", "payload_bytes")):
        if summary.get(key):
            pipe.hincrby(BYTES, field, int(summary[key]))
    for phase, seconds in phases(summary).items():
        pipe.hincrby(PHASES, f"{phase}|{bucket_of(seconds)}", 1)
        pipe.hincrby(PHASES, f"{phase}|count", 1)
        pipe.hincrbyfloat(PHASES, f"{phase}|sum", seconds)


def phases(summary: dict) -> dict:
    """Seconds per phase of an ended job, for those it went through."""
    out = {}
    for phase in ("queue", "deserialize", "run", "upload"):
        value = summary.get(f"{phase}_ms")
        if isinstance(value, (int, float)) and value >= 0:
            out[phase] = value / 1000.0
    if summary.get("received_at") and summary.get("finished_at"):
        out["total"] = max(0.0, summary["finished_at"] - summary["received_at"])
    return out


def count_request(client: redis.Redis, route: str, method: str, status: int) -> None:
    client.hincrby(REQUESTS, f"{route}|{method}|{status}", 1)


def _split(field: bytes, parts: int) -> Optional[list[str]]:
    values = field.decode(errors="replace").rsplit("|", parts - 1)
    return values if len(values) == parts else None


class FarmCollector:
    """A prometheus_client collector reading the farm's series from Redis."""

    def __init__(self, client: redis.Redis, top_keys: Optional[int] = None, per_key: bool = True) -> None:
        self.redis = client
        self.top_keys = top_keys  # None: NDIF_USAGE_TOP_KEYS
        self.per_key = per_key  # the usage series name keys: only for a scraper allowed to see them

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        pipe = self.redis.pipeline(transaction=False)
        for key in (REQUESTS, JOBS, BYTES, PHASES):
            pipe.hgetall(key)
        pipe.llen(ledger.PENDING)
        pipe.hgetall(REPLACEMENTS)
        requests_raw, jobs_raw, bytes_raw, phases_raw, pending, replacements = pipe.execute()

        requests = CounterMetricFamily(
            "ndif_http_requests", "HTTP requests answered by the web, by route rule, method and status.",
            labels=["route", "method", "status"],
        )
        for field, count in sorted(requests_raw.items()):
            parts = _split(field, 3)
            if parts:
                requests.add_metric(parts, int(count))
        yield requests

        jobs = CounterMetricFamily(
            "ndif_jobs", "Jobs ended, by outcome (COMPLETED, ERROR) and error kind (none when completed).",
            labels=["outcome", "kind"],
        )
        counts = {("COMPLETED", NO_KIND): 0, **{("ERROR", kind): 0 for kind in ERROR_KINDS}}
        for field, count in jobs_raw.items():
            parts = _split(field, 2)
            if parts:
                counts[tuple(parts)] = int(count)
        for labels, count in sorted(counts.items()):
            jobs.add_metric(list(labels), count)
        yield jobs

        for name, field, help_text in (
            ("ndif_result_bytes", b"result", "Bytes of results of ended jobs (after compression)."),
            ("ndif_payload_bytes", b"payload", "Bytes of request payloads of ended jobs."),
        ):
            family = CounterMetricFamily(name, help_text)
            family.add_metric([], int(bytes_raw.get(field, 0)))
            yield family

        histogram = HistogramMetricFamily(
            "ndif_job_phase_seconds",
            "Seconds per phase of ended jobs: queue (intake to a worker taking it, model loading included), "
            "deserialize, run (deserialize + execute), upload (to the result store), total (intake to the end).",
            labels=["phase"],
        )
        by_phase = {(k.decode(errors="replace")): float(v) for k, v in phases_raw.items()}
        for phase in PHASE_NAMES:
            cumulative, buckets = 0, []
            for le in BUCKETS:
                cumulative += int(by_phase.get(f"{phase}|{_le(le)}", 0))
                buckets.append((_le(le), cumulative))
            cumulative += int(by_phase.get(f"{phase}|{INF}", 0))
            buckets.append((INF, cumulative))
            histogram.add_metric([phase], buckets, by_phase.get(f"{phase}|sum", 0.0))
        yield histogram

        depth = GaugeMetricFamily("ndif_queue_depth", "Jobs waiting per deployment (repo id, the nnsight "
                                  "runtime that serves it, its model key).", labels=DEPLOYMENT_LABELS)
        wait = GaugeMetricFamily(
            "ndif_queue_head_wait_seconds", "How long the oldest waiting job of each deployment has waited.",
            labels=DEPLOYMENT_LABELS,
        )
        per_model: dict[tuple, list] = {}
        for row in queues.summary(self.redis):
            labels = deployment_labels(row["model_key"] or "", queues.model_name(row))
            entry = per_model.setdefault(labels, [0, 0.0])
            entry[0] += row["depth"]
            entry[1] = max(entry[1], row["head_wait_s"])
        for labels, (count, head) in sorted(per_model.items()):
            depth.add_metric(list(labels), count)
            wait.add_metric(list(labels), head)
        yield depth
        yield wait

        workers = registry.live_workers(self.redis)
        family = GaugeMetricFamily("ndif_workers", "Live workers (heard from in the last 10 s).")
        family.add_metric([], len(workers))
        yield family

        states = {registry.RUNNING: 0, registry.DEPLOYING: 0}
        for entry in registry.live_deployments(self.redis, workers):
            states[entry["state"]] = states.get(entry["state"], 0) + 1
        family = GaugeMetricFamily(
            "ndif_deployments", "Models held by live workers (one per replica), by state.", labels=["state"]
        )
        for state, count in sorted(states.items()):
            family.add_metric([state], count)
        yield family

        family = GaugeMetricFamily(
            "ndif_ledger_pending", "Ended jobs waiting in Redis to be written to the ledger database."
        )
        family.add_metric([], int(pending))
        yield family

        family = CounterMetricFamily(
            "ndif_worker_replacements", "Times each worker replaced itself: a job did not unwind from its "
            "deadline or a kill.", labels=["worker"],
        )
        for worker, count in sorted(replacements.items()):
            family.add_metric([worker.decode(errors="replace")], int(count))
        yield family

        yield from self.probe_families()
        if self.per_key:
            yield from self.usage_families()

    def probe_families(self):
        """The health probes' last results (``ndif_celery.monitoring.probes``), one series per probed model."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from . import probes

        ok = GaugeMetricFamily("ndif_probe_ok", "1 when the last health probe of the deployment answered correct "
                               "values (or waits behind users' jobs), 0 when it failed.", labels=DEPLOYMENT_LABELS)
        queued = GaugeMetricFamily("ndif_probe_queued", "1 while the deployment's probe waits behind users' jobs.",
                                   labels=DEPLOYMENT_LABELS)
        latency = GaugeMetricFamily("ndif_probe_latency_seconds",
                                    "Seconds the last answered health probe of the deployment took.",
                                    labels=DEPLOYMENT_LABELS)
        last = GaugeMetricFamily("ndif_probe_last_run_timestamp_seconds",
                                 "When the deployment was last probed (Unix time).", labels=DEPLOYMENT_LABELS)
        for row in probes.results(self.redis):
            labels = list(deployment_labels(row["model_key"], row.get("repo")))
            ok.add_metric(labels, 1 if row.get("ok") else 0)
            queued.add_metric(labels, 1 if row.get("state") == probes.QUEUED else 0)
            latency.add_metric(labels, float(row.get("latency_s") or 0.0))
            last.add_metric(labels, float(row.get("at") or 0.0))
        yield ok
        yield queued
        yield latency
        yield last
        runs = CounterMetricFamily("ndif_probe_runs", "Health probes judged, by deployment and result (ok, failed).",
                                   labels=[*DEPLOYMENT_LABELS, "result"])
        for field, count in sorted(self.redis.hgetall(probes.RUNS).items()):
            parts = _split(field, 2)
            if parts and ":" in parts[0]:  # "<model key>|<result>"; a repo's count from before runtimes is left out
                runs.add_metric([*deployment_labels(parts[0]), parts[1]], int(count))
        yield runs

    def usage_families(self):
        """Usage per key (``ndif_celery.accounts.usage``): the top NDIF_USAGE_TOP_KEYS, the rest as ``other``."""
        from prometheus_client.core import CounterMetricFamily

        from ndif_celery import config
        from ndif_celery.accounts import usage

        top = config.load().usage_top_keys if self.top_keys is None else self.top_keys
        rows = usage.series(self.redis, top)
        for name, help_text in (
            ("jobs", "Jobs ended, per key (top NDIF_USAGE_TOP_KEYS, the rest as other)."),
            ("errors", "Jobs ended with an error, per key."),
            ("gpu_seconds", "Run time times the worker's GPUs of ended jobs, per key."),
            ("run_seconds", "Run time (deserialize and execute) of ended jobs, per key."),
            ("bytes_in", "Request payload bytes of ended jobs, per key."),
            ("bytes_out", "Result bytes of ended jobs, per key."),
        ):
            family = CounterMetricFamily(f"ndif_usage_{name}", help_text, labels=["key"])
            for owner, values in rows.items():
                family.add_metric([owner], values[name])
            yield family


def worker_replaced(client: redis.Redis, worker: str) -> None:
    """Count one replacement of ``worker`` (``workers.worker.WorkerState.replace``)."""
    client.hincrby(REPLACEMENTS, worker, 1)


def render(client: redis.Redis, top_keys: Optional[int] = None, per_key: bool = True) -> bytes:
    """The farm's series in Prometheus text format (``top_keys``: NDIF_USAGE_TOP_KEYS);
    without ``per_key``, no series that names a key."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(FarmCollector(client, top_keys, per_key))
    return generate_latest(registry)
