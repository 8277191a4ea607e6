"""A worker's own Prometheus endpoint: what this process did and holds.

Started when the worker is ready (``WorkerState.ready``, ``workers.worker``) on
``NDIF_WORKER_METRICS_HOST:NDIF_WORKER_METRICS_PORT`` (default
127.0.0.1:9108; port 0 turns it off). Several workers on one host: a taken
port moves this one to the next free one of the following few, and the port
it got is in the worker's registry entry (``metrics_port`` in ``/status``).

Series: ``ndif_worker_model_load_seconds{model}`` (the last load of each model),
``ndif_worker_model_load_duration_seconds`` (histogram of loads),
``ndif_worker_execution_seconds`` (histogram: a job's time on the worker, from
taking it to its final status), ``ndif_worker_jobs_total{outcome}``,
``ndif_worker_deadlines_total{kind}`` (jobs the deadline watchdog answered:
timeout, cancelled; ``workers.job.deadline``), ``ndif_worker_rss_bytes``,
``ndif_worker_gpu_memory_bytes`` (reserved by torch
on this worker's GPUs; 0 before CUDA is used), ``ndif_worker_resident_models``,
plus prometheus_client's process and Python series.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable, Optional

from prometheus_client import Counter, Gauge, Histogram, start_http_server

log = logging.getLogger("ndif_celery.worker")

PORT_TRIES = 10

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)

MODEL_LOAD = Gauge("ndif_worker_model_load_seconds", "Seconds the last load of each model took.", ["model"])
MODEL_LOADS = Histogram("ndif_worker_model_load_duration_seconds", "Seconds each model load took.",
                        buckets=_SECONDS)
EXECUTION = Histogram("ndif_worker_execution_seconds",
                      "Seconds each job spent on this worker, from taking it to its final status.", buckets=_SECONDS)
JOBS = Counter("ndif_worker_jobs_total", "Jobs this worker ended, by outcome.", ["outcome"])
for _outcome in ("COMPLETED", "ERROR"):
    JOBS.labels(_outcome)
DEADLINES = Counter("ndif_worker_deadlines_total",
                    "Jobs this worker's deadline watchdog ended (timeout, or cancelled by the operator).", ["kind"])
for _kind in ("timeout", "cancelled"):
    DEADLINES.labels(_kind)
RSS = Gauge("ndif_worker_rss_bytes", "Resident memory of the worker process.")
GPU_MEMORY = Gauge("ndif_worker_gpu_memory_bytes",
                   "GPU memory torch holds on this worker's GPUs (reserved; 0 before CUDA is first used).")
RESIDENT = Gauge("ndif_worker_resident_models", "Models resident on this worker.")


def _rss_bytes() -> float:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        # ru_maxrss: KiB on Linux, bytes on macOS; the peak, where /proc is missing.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def _gpu_bytes() -> float:
    torch = sys.modules.get("torch")
    try:
        # Never initialise CUDA to answer a scrape; a worker that has not used it holds nothing there.
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return 0
        return sum(torch.cuda.memory_reserved(d) for d in range(torch.cuda.device_count()))
    except Exception:  # noqa: BLE001 - a scrape must not fail on a driver hiccup
        return 0


RSS.set_function(_rss_bytes)
GPU_MEMORY.set_function(_gpu_bytes)


def start(host: str, port: int, resident: Callable[[], int]) -> Optional[int]:
    """Serve /metrics on ``port`` or the next free of the following few; the
    port it got, or None (off, or none free)."""
    RESIDENT.set_function(lambda: float(resident()))
    if not port:
        return None
    for candidate in range(port, port + PORT_TRIES):
        try:
            start_http_server(candidate, addr=host)
        except OSError:
            continue
        if candidate != port:
            log.warning("metrics port %d is taken; serving worker metrics on %s:%d", port, host, candidate)
        else:
            log.info("serving worker metrics on %s:%d", host, candidate)
        return candidate
    log.warning("no free metrics port in %d-%d on %s; worker metrics are off", port, port + PORT_TRIES - 1, host)
    return None


def job_ended(outcome: str, seconds: float) -> None:
    JOBS.labels(outcome).inc()
    EXECUTION.observe(max(0.0, seconds))


def deadline_fired(kind: str) -> None:
    DEADLINES.labels(kind).inc()


def model_loaded(model: str, seconds: float) -> None:
    MODEL_LOAD.labels(model).set(seconds)
    MODEL_LOADS.observe(max(0.0, seconds))
