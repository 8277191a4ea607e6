"""Farm-wide Prometheus series, kept in Redis so every web process agrees.

Counters are Redis hashes that whoever sees the event increments, in the
pipeline it already sends (no Prometheus multiprocess mode, no state in any
one process); ``GET /metrics`` on any web reads them back and adds the farm's
current shape (queues, workers, deployments) through :class:`FarmCollector`,
which calls one small function per metric family, in the order served.

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
from ndif_celery.state import launches, queues, registry

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


# --- the families: one function each, from what Redis holds to one metric family ---


def http_requests(raw: dict):
    """``ndif_http_requests_total``: the web's ``<route>|<method>|<status>`` counts."""
    from prometheus_client.core import CounterMetricFamily

    family = CounterMetricFamily(
        "ndif_http_requests", "HTTP requests answered by the web, by route rule, method and status.",
        labels=["route", "method", "status"],
    )
    for field, count in sorted(raw.items()):
        parts = _split(field, 3)
        if parts:
            family.add_metric(parts, int(count))
    return family


def jobs_ended(raw: dict):
    """``ndif_jobs_total``: every outcome and error kind, those never seen as 0."""
    from prometheus_client.core import CounterMetricFamily

    family = CounterMetricFamily(
        "ndif_jobs", "Jobs ended, by outcome (COMPLETED, ERROR) and error kind (none when completed).",
        labels=["outcome", "kind"],
    )
    counts = {("COMPLETED", NO_KIND): 0, **{("ERROR", kind): 0 for kind in ERROR_KINDS}}
    for field, count in raw.items():
        parts = _split(field, 2)
        if parts:
            counts[tuple(parts)] = int(count)
    for labels, count in sorted(counts.items()):
        family.add_metric(list(labels), count)
    return family


def result_bytes(raw: dict):
    """``ndif_result_bytes_total``: bytes of ended jobs' results."""
    return _bytes_total("ndif_result_bytes", raw.get(b"result", 0),
                        "Bytes of results of ended jobs (after compression).")


def payload_bytes(raw: dict):
    """``ndif_payload_bytes_total``: bytes of ended jobs' request payloads."""
    return _bytes_total("ndif_payload_bytes", raw.get(b"payload", 0), "Bytes of request payloads of ended jobs.")


def _bytes_total(name: str, count, help_text: str):
    from prometheus_client.core import CounterMetricFamily

    family = CounterMetricFamily(name, help_text)
    family.add_metric([], int(count))
    return family


def job_phases(raw: dict):
    """``ndif_job_phase_seconds``: the per-bucket counts made cumulative, as Prometheus reads them."""
    from prometheus_client.core import HistogramMetricFamily

    family = HistogramMetricFamily(
        "ndif_job_phase_seconds",
        "Seconds per phase of ended jobs: queue (intake to a worker taking it, model loading included), "
        "deserialize, run (deserialize + execute), upload (to the result store), total (intake to the end).",
        labels=["phase"],
    )
    by_phase = {(k.decode(errors="replace")): float(v) for k, v in raw.items()}
    for phase in PHASE_NAMES:
        cumulative, buckets = 0, []
        for le in BUCKETS:
            cumulative += int(by_phase.get(f"{phase}|{_le(le)}", 0))
            buckets.append((_le(le), cumulative))
        cumulative += int(by_phase.get(f"{phase}|{INF}", 0))
        buckets.append((INF, cumulative))
        family.add_metric([phase], buckets, by_phase.get(f"{phase}|sum", 0.0))
    return family


def queue_totals(client: redis.Redis) -> dict:
    """``[depth, head wait]`` per deployment's labels, its queues added up."""
    per_model: dict[tuple, list] = {}
    for row in queues.summary(client):
        labels = deployment_labels(row["model_key"] or "", queues.model_name(row))
        entry = per_model.setdefault(labels, [0, 0.0])
        entry[0] += row["depth"]
        entry[1] = max(entry[1], row["head_wait_s"])
    return per_model


def queue_depth(totals: dict):
    """``ndif_queue_depth``: jobs waiting per deployment."""
    from prometheus_client.core import GaugeMetricFamily

    family = GaugeMetricFamily("ndif_queue_depth", "Jobs waiting per deployment (repo id, the nnsight "
                               "runtime that serves it, its model key).", labels=DEPLOYMENT_LABELS)
    for labels, (count, _) in sorted(totals.items()):
        family.add_metric(list(labels), count)
    return family


def queue_head_wait(totals: dict):
    """``ndif_queue_head_wait_seconds``: the oldest waiting job's wait per deployment."""
    from prometheus_client.core import GaugeMetricFamily

    family = GaugeMetricFamily(
        "ndif_queue_head_wait_seconds", "How long the oldest waiting job of each deployment has waited.",
        labels=DEPLOYMENT_LABELS,
    )
    for labels, (_, head) in sorted(totals.items()):
        family.add_metric(list(labels), head)
    return family


def worker_count(workers: dict):
    """``ndif_workers``: the live workers."""
    from prometheus_client.core import GaugeMetricFamily

    family = GaugeMetricFamily("ndif_workers", "Live workers (heard from in the last 10 s).")
    family.add_metric([], len(workers))
    return family


def deployment_states(client: redis.Redis, workers: dict):
    """``ndif_deployments``: replicas by state, RUNNING and DEPLOYING always shown."""
    from prometheus_client.core import GaugeMetricFamily

    states = {registry.RUNNING: 0, registry.DEPLOYING: 0}
    for entry in registry.live_deployments(client, workers):
        states[entry["state"]] = states.get(entry["state"], 0) + 1
    family = GaugeMetricFamily(
        "ndif_deployments", "Models held by live workers (one per replica), by state.", labels=["state"]
    )
    for state, count in sorted(states.items()):
        family.add_metric([state], count)
    return family


def ledger_pending(pending: int):
    """``ndif_ledger_pending``: ended jobs not yet in the ledger database."""
    from prometheus_client.core import GaugeMetricFamily

    family = GaugeMetricFamily(
        "ndif_ledger_pending", "Ended jobs waiting in Redis to be written to the ledger database."
    )
    family.add_metric([], int(pending))
    return family


def worker_replacements(raw: dict):
    """``ndif_worker_replacements_total``: counted here, since the worker that replaced itself exits."""
    from prometheus_client.core import CounterMetricFamily

    family = CounterMetricFamily(
        "ndif_worker_replacements", "Times each worker replaced itself: a job did not unwind from its "
        "deadline or a kill.", labels=["worker"],
    )
    for worker, count in sorted(raw.items()):
        family.add_metric([worker.decode(errors="replace")], int(count))
    return family


def launch_states(known: dict):
    """Workers launched through the cluster's scheduler, by state (``ndif_celery.farm.elastic``)."""
    from prometheus_client.core import GaugeMetricFamily

    family = GaugeMetricFamily("ndif_launches", "Workers launched through the cluster's scheduler "
                               "(NDIF_LAUNCHER), by state; ended ones stay listed 10 minutes.", labels=["state"])
    for state in launches.STATES:
        family.add_metric([state], sum(1 for launch in known.values() if launch["state"] == state))
    return family


def probe_ok(rows: list):
    """``ndif_probe_ok``: whether each deployment's last probe answered right."""
    return _probe_gauge("ndif_probe_ok", "1 when the last health probe of the deployment answered correct "
                        "values (or waits behind users' jobs), 0 when it failed.",
                        rows, lambda row: 1 if row.get("ok") else 0)


def probe_queued(rows: list):
    """``ndif_probe_queued``: whether each deployment's probe waits behind users' jobs."""
    from . import probes

    return _probe_gauge("ndif_probe_queued", "1 while the deployment's probe waits behind users' jobs.",
                        rows, lambda row: 1 if row.get("state") == probes.QUEUED else 0)


def probe_latency(rows: list):
    """``ndif_probe_latency_seconds``: the last answered probe's time per deployment."""
    return _probe_gauge("ndif_probe_latency_seconds", "Seconds the last answered health probe of the deployment took.",
                        rows, lambda row: float(row.get("latency_s") or 0.0))


def probe_last_run(rows: list):
    """``ndif_probe_last_run_timestamp_seconds``: when each deployment was last probed."""
    return _probe_gauge("ndif_probe_last_run_timestamp_seconds", "When the deployment was last probed (Unix time).",
                        rows, lambda row: float(row.get("at") or 0.0))


def _probe_gauge(name: str, help_text: str, rows: list, value):
    """A gauge with one series per probed deployment, ``value`` read from its result row."""
    from prometheus_client.core import GaugeMetricFamily

    family = GaugeMetricFamily(name, help_text, labels=DEPLOYMENT_LABELS)
    for row in rows:
        family.add_metric(list(deployment_labels(row["model_key"], row.get("repo"))), value(row))
    return family


def probe_runs(raw: dict):
    """``ndif_probe_runs_total``: probes judged per deployment and result."""
    from prometheus_client.core import CounterMetricFamily

    family = CounterMetricFamily("ndif_probe_runs", "Health probes judged, by deployment and result (ok, failed).",
                                 labels=[*DEPLOYMENT_LABELS, "result"])
    for field, count in sorted(raw.items()):
        parts = _split(field, 2)
        if parts and ":" in parts[0]:  # "<model key>|<result>"; a repo's count from before runtimes is left out
            family.add_metric([*deployment_labels(parts[0]), parts[1]], int(count))
    return family


#: The usage families (``ndif_usage_<name>_total{key}``) and their help, in the order they are served.
USAGE_SERIES = (
    ("jobs", "Jobs ended, per key (top NDIF_USAGE_TOP_KEYS, the rest as other)."),
    ("errors", "Jobs ended with an error, per key."),
    ("gpu_seconds", "Run time times the worker's GPUs of ended jobs, per key."),
    ("run_seconds", "Run time (deserialize and execute) of ended jobs, per key."),
    ("bytes_in", "Request payload bytes of ended jobs, per key."),
    ("bytes_out", "Result bytes of ended jobs, per key."),
)


def usage_family(name: str, help_text: str, rows: dict):
    """``ndif_usage_<name>_total``: one of ``usage.series``' values, per key."""
    from prometheus_client.core import CounterMetricFamily

    family = CounterMetricFamily(f"ndif_usage_{name}", help_text, labels=["key"])
    for owner, values in rows.items():
        family.add_metric([owner], values[name])
    return family


class FarmCollector:
    """A prometheus_client collector reading the farm's series from Redis."""

    def __init__(self, client: redis.Redis, top_keys: Optional[int] = None, per_key: bool = True) -> None:
        self.redis = client
        self.top_keys = top_keys  # None: NDIF_USAGE_TOP_KEYS
        self.per_key = per_key  # the usage series name keys: only for a scraper allowed to see them

    def collect(self):
        """Every family, in the order ``/metrics`` has always listed them."""
        pipe = self.redis.pipeline(transaction=False)
        for key in (REQUESTS, JOBS, BYTES, PHASES):
            pipe.hgetall(key)
        pipe.llen(ledger.PENDING)
        pipe.hgetall(REPLACEMENTS)
        requests_raw, jobs_raw, bytes_raw, phases_raw, pending, replacements = pipe.execute()
        yield http_requests(requests_raw)
        yield jobs_ended(jobs_raw)
        yield result_bytes(bytes_raw)
        yield payload_bytes(bytes_raw)
        yield job_phases(phases_raw)
        totals = queue_totals(self.redis)
        yield queue_depth(totals)
        yield queue_head_wait(totals)
        workers = registry.live_workers(self.redis)
        yield worker_count(workers)
        yield deployment_states(self.redis, workers)
        yield ledger_pending(pending)
        yield worker_replacements(replacements)
        yield launch_states(launches.read(self.redis))
        yield from self.probe_families()
        if self.per_key:
            yield from self.usage_families()

    def probe_families(self):
        """The health probes' last results (``ndif_celery.monitoring.probes``), one series per probed model."""
        from . import probes

        rows = probes.results(self.redis)
        yield probe_ok(rows)
        yield probe_queued(rows)
        yield probe_latency(rows)
        yield probe_last_run(rows)
        yield probe_runs(self.redis.hgetall(probes.RUNS))

    def usage_families(self):
        """Usage per key (``ndif_celery.accounts.usage``): the top NDIF_USAGE_TOP_KEYS, the rest as ``other``."""
        from ndif_celery import config
        from ndif_celery.accounts import usage

        top = config.load().usage_top_keys if self.top_keys is None else self.top_keys
        rows = usage.series(self.redis, top)
        for name, help_text in USAGE_SERIES:
            yield usage_family(name, help_text, rows)


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
