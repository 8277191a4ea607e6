"""Synthetic health probes: the beat runs a real remote trace against each model the farm serves.

Every ``NDIF_PROBE_INTERVAL_S`` (0: off) the leading beat (a Redis lease,
like the watchdog's) probes each *target*: every model a live worker holds
RUNNING, and every pinned deployment no worker holds at all (its worker
stopped: that probe waits out ``NDIF_PROBE_TIMEOUT_S`` and fails). A probe is
what a user does: the real nnsight client, through the public endpoint
(``NDIF_API_URL``) with ``NDIF_PROBE_API_KEY``, a trace that saves the
logits. It runs in a child process (``ndif_celery.monitoring.probe_runner``) because the
client imports torch and the beat must not.

A probe is green when the trace answered, the logits are finite, shaped
``[1, tokens, vocab]`` with the model config's vocabulary, and equal, within
:data:`TOLERANCE` of their scale, to the reference: the first green probe of a
model key and dtype records its values (``ndif:probes:references``), so a
model loaded later from corrupted weights (a bad copy in the model cache, a
flipped bit) answers other logits and goes red. ``ndif-celery probes --reset
MODEL`` forgets a reference (a branch that moved on purpose).

A deployment is a model key, and a runtime's deployment of a model has a key
of its own (``"nnsight": "0.7.0"``, ``policy.model_policy``): its probe runs under
that runtime's interpreter (its venv's ``python -m
ndif_celery.monitoring.probe_runner``, so the client is that nnsight's, as its
users' is), and its results, references and alerts are its own.

Results (``ndif:probes``: model key -> the last result) feed ``/metrics``
(``ndif_probe_ok{model,nnsight,model_key}`` and the rest, one series per
deployment), the dashboard and the ``NdifProbeFailing`` alert in
deploy/prometheus-rules.yml.

A probe that waits behind users' jobs is no failure: the intake gives it a
turn of its own at the front of its model's line (``state.turns``), and one
that still waits when its time is up is recorded as ``queued behind N
jobs`` (state ``QUEUED``; the model is busy, not broken) and is not sent again
while it waits, so probes never pile up in a line.

A probe judged red turns its alert on after ``alerts.ALERT_AFTER_S``; the
prober's :class:`ndif_celery.monitoring.alerts.Courier` tells the webhook
(``NDIF_ALERT_WEBHOOK_URL``) in a thread of its own.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

import redis

from pathlib import Path

from ndif_celery import config
from ndif_celery.celery_app import queue_for
from ndif_celery.policy import client_versions
from ndif_celery.policy import model_policy
from ndif_celery.state import jobs, leases, queues, registry

from . import alerts, history

log = logging.getLogger("ndif_celery.probes")

LEADER = "ndif:probes:leader"
PROBES = "ndif:probes"
RUNS = "ndif:probes:runs"
REFERENCES = "ndif:probes:references"
OWNER = "ndif:probes:owner"  # the probe key's job owner (key:<id>), as the web saw it (intake.check_probe)
TOLERANCE = 1e-3  # of the reference's largest |value|: co-batching and devices differ by ~1e-6
STARTUP_S = 180.0  # the runner's first import of torch and nnsight, on a loaded host
SENT = "ndif:probes:sent"  # model key -> the job id of its last probe, as the intake parked it
SENT_TTL_S = 86400
OK, FAILING, QUEUED = "ok", "FAILING", "QUEUED"  # a result's state


runtime_of = model_policy.runtime_of


def runtime_interpreter(home: Path, runtime: str) -> Path:
    """Where ``ndif-celery runtime add`` puts the runtime's interpreter (``host.runtimes.folder``;
    the beat's layer cannot import ``host``, a test holds the two equal)."""
    return Path(home) / "runtimes" / f"nnsight-{runtime}" / "bin" / "python"


def targets(client: redis.Redis) -> list[dict]:
    """``{model_key, dtype, nnsight}`` of every deployment to probe: RUNNING on a live
    worker, or pinned and held by no worker at all (none is loading it either)."""
    held: dict[str, list] = {}
    for entry in registry.live_deployments(client):
        held.setdefault(entry["model_key"], []).append(entry)
    out = {}
    for key, entries in held.items():
        running = [e for e in entries if e["state"] == registry.RUNNING]
        if running:
            out[key] = {"model_key": key, "dtype": running[0].get("dtype"), "nnsight": runtime_of(key)}
    for key, wish in registry.desired(client).items():
        if wish.get("pinned") and key not in held:
            out[key] = {"model_key": key, "dtype": wish.get("dtype"), "nnsight": runtime_of(key)}
    return [out[key] for key in sorted(out)]


def reference_field(model_key: str, dtype: Optional[str]) -> str:
    return f"{model_key}|{dtype or ''}"


def judge(result: dict, reference: Optional[dict]) -> tuple[bool, str]:
    """(green, why not): the answer, its shape, finiteness, and its values against ``reference``."""
    if not result.get("ok"):
        return False, result.get("error") or "the probe failed"
    shape, vocab = result.get("shape") or [], result.get("vocab")
    if len(shape) != 3 or shape[0] != 1 or shape[1] < 1 or (vocab and shape[2] != vocab):
        return False, f"the logits are shaped {shape}, not [1, tokens, {vocab}]"
    if not result.get("finite"):
        return False, "the logits hold NaN or infinity"
    if reference is None:
        return True, ""
    if reference.get("shape") != shape:
        return False, f"the logits are shaped {shape}, the reference {reference.get('shape')}"
    expected, values = reference["values"], result.get("values") or []
    if len(values) != len(expected):
        return False, "the probe answered other values than its reference holds"
    scale = max([1.0] + [abs(v) for v in expected])
    worst = max((abs(a - b) for a, b in zip(values, expected)), default=0.0)
    if worst > TOLERANCE * scale:
        return False, (f"the logits differ from the reference recorded {_ago(reference.get('recorded_at'))} by "
                       f"{worst:.3g} (allowed {TOLERANCE * scale:.3g}): the weights changed")
    return True, ""


def _ago(epoch) -> str:
    if not epoch:
        return "earlier"
    return f"{max(0.0, time.time() - epoch):.0f} s ago"


def results(client: redis.Redis) -> list[dict]:
    """The last result of every probed deployment, by repo id and runtime."""
    rows = [json.loads(raw) for raw in client.hvals(PROBES)]
    for row in rows:  # results written before runtimes were told apart
        row.setdefault("nnsight", runtime_of(row.get("model_key") or ""))
        row.setdefault("state", OK if row.get("ok") else FAILING)
    return sorted(rows, key=lambda row: (row.get("repo") or "", row["nnsight"], row.get("model_key") or ""))


def note_sent(client: "redis.Redis | redis.client.Pipeline", model_key: str, job_id: str) -> None:
    """The intake parked a probe's job: the beat looks for it in the line (:func:`queued_behind`)."""
    client.hset(SENT, model_key, job_id)
    client.expire(SENT, SENT_TTL_S)


def queued_behind(client: redis.Redis, model_key: str) -> Optional[int]:
    """How many jobs the deployment's last probe waits behind (those ahead in its
    line and those its workers run), or None when it waits no more, or waits for
    no one: with no live worker running the deployment, a wait is no sign of a
    busy model, and the probe is judged (and fails) as usual."""
    job_id = client.hget(SENT, model_key)
    if not job_id:
        return None
    workers = registry.live_workers(client)
    holders = {e["worker"] for e in registry.live_deployments(client, workers)
               if e["model_key"] == model_key and e["state"] == registry.RUNNING}
    if not holders:
        return None
    for ahead, entry in enumerate(queues.waiting(client, queue_for(model_key))):
        if entry.job.id == job_id.decode():
            return ahead + sum(1 for name in holders if workers[name].get("current_job"))
    return None


def reset(client: redis.Redis, model_key: str) -> int:
    """Forget the model's references (every dtype); the next green probe records a new one."""
    fields = [f for f in client.hkeys(REFERENCES) if f.decode().rsplit("|", 1)[0] == model_key]
    return client.hdel(REFERENCES, *fields) if fields else 0


class Runner:
    """The probe's client process (``python -m ndif_celery.monitoring.probe_runner``), started
    on first use and again after it died or gave up on a stuck trace. ``runtime``: the
    nnsight version whose deployments it probes; another than the farm's own runs under
    that runtime's interpreter, so the client is the one its users run."""

    def __init__(self, settings: config.Settings, runtime: str = "") -> None:
        self.settings = settings
        self.runtime = "" if runtime == client_versions.MAIN else runtime
        self.proc: Optional[subprocess.Popen] = None
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()

    def interpreter(self) -> str:
        if not self.runtime:
            return sys.executable
        python = runtime_interpreter(self.settings.home, self.runtime)
        if not python.exists():
            raise OSError(f"the beat's host has no nnsight {self.runtime} runtime to probe with "
                          f"(`ndif-celery runtime add {self.runtime}` there)")
        return str(python)

    def _start(self) -> None:
        env = dict(os.environ, NDIF_PROBE_HOST=self.settings.api_url,
                   NDIF_PROBE_API_KEY=self.settings.probe_api_key)
        self.proc = subprocess.Popen([self.interpreter(), "-m", "ndif_celery.monitoring.probe_runner"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self.lines), daemon=True,
                         name="ndif-probe-reader").start()
        ready = self._line(STARTUP_S)
        if not ready or not json.loads(ready).get("ready"):
            self.stop()
            raise OSError("the probe's client process did not start (see the beat's log)")

    @staticmethod
    def _read(proc: subprocess.Popen, lines: "queue.Queue") -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    def _line(self, timeout_s: float) -> Optional[str]:
        try:
            return self.lines.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def probe(self, model_key: str, timeout_s: float) -> dict:
        try:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            self.proc.stdin.write(json.dumps({"model_key": model_key, "timeout_s": timeout_s}) + "\n")
            self.proc.stdin.flush()
        except OSError as error:
            self.stop()
            return {"model_key": model_key, "ok": False, "error": f"the probe could not run: {error}"}
        line = self._line(timeout_s + 30)
        if not line:
            self.stop()
            return {"model_key": model_key, "ok": False, "timed_out": True,
                    "error": f"no answer within {timeout_s:.0f} s"}
        return json.loads(line)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


class Prober(threading.Thread):
    """One per beat process; the lease makes one of them probe (and its courier deliver)."""

    def __init__(self, settings: config.Settings, redis_client=None, runner=None,
                 post: Callable[[str, dict], None] = alerts.post_json, name: Optional[str] = None,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(name="ndif-prober", daemon=True)
        self.settings = settings
        self.redis = redis_client or jobs.connect(settings.redis_url, settings.redis_outage_s)
        self.runner = runner  # one for every runtime (the tests'); else one per runtime, made on first use
        self.runners: dict[str, Runner] = {}
        self.clock = clock
        self.me = name or f"prober-{id(self):x}@{time.time():.0f}"
        self.stopping = threading.Event()
        lease_ms = int(max(10.0, 3 * settings.probe_interval_s + settings.probe_timeout_s) * 1000)
        self.lease = leases.Lease(self.redis, LEADER, self.me, lease_ms)
        self.leading = False
        self.courier = alerts.Courier(self, post)

    def run(self) -> None:
        self.courier.start()
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                if self.lead():
                    self.courier.wake.set()  # after a (re)start it has the red models to send again
                    self.round()
            except Exception:  # noqa: BLE001 - the prober must outlive a bad round
                log.exception("probe round failed")
            self.stopping.wait(max(0.0, self.settings.probe_interval_s - (time.monotonic() - started)))
        self.courier.wake.set()
        for runner in [self.runner, *self.runners.values()]:
            if runner is not None:
                runner.stop()

    def runner_for(self, runtime: str):
        """The client process that probes ``runtime``'s deployments."""
        if self.runner is not None:
            return self.runner
        if runtime not in self.runners:
            self.runners[runtime] = Runner(self.settings, runtime)
        return self.runners[runtime]

    def lead(self) -> bool:
        """Take or renew the lease. On taking it, the models red now are sent again (``alerts.resend``)."""
        leads = self.lease.hold()
        if leads and not self.leading:
            alerts.resend(self.redis, self.results())
        self.leading = leads
        return leads

    def results(self) -> list[dict]:
        """The last result of every probed deployment (:func:`results`): what the courier reports."""
        return results(self.redis)

    def round(self) -> list[dict]:
        """Probe every target once; forget the results of models no longer served."""
        recorded = []
        wanted = targets(self.redis)
        for target in wanted:
            if target not in targets(self.redis):
                continue  # evicted since the round began (and the web refuses a probe of a model not deployed)
            behind = queued_behind(self.redis, target["model_key"])
            if behind is None:  # the last probe's job waits no more: send another
                result = self.runner_for(target["nnsight"]).probe(target["model_key"], self.settings.probe_timeout_s)
                if not result.get("ok") and target not in targets(self.redis):
                    continue  # evicted while it was probed: not a failure of the model
                if not result.get("ok") and result.get("timed_out"):
                    behind = queued_behind(self.redis, target["model_key"])
            if behind is not None:  # busy, not broken: its job still waits its turn
                result = {"model_key": target["model_key"], "queued_behind": behind}
            recorded.append(self.record(target, result))
            self.lease.hold()  # a long round keeps its lease
        keys = {t["model_key"] for t in wanted}
        for field in self.redis.hkeys(PROBES):
            if field.decode() not in keys:
                gone = json.loads(self.redis.hget(PROBES, field) or "{}")
                self.redis.hdel(PROBES, field)
                if gone and alerts.alerting(gone):
                    log.warning("%s", alerts.alert_text(gone, "resolved", alerts.NOT_DEPLOYED))
        self.courier.wake.set()
        return recorded

    def record(self, target: dict, result: dict) -> dict:
        """Judge ``result`` and keep it as the deployment's last; a result with
        ``queued_behind`` (its job still waits) keeps the verdict it had."""
        model_key = target["model_key"]
        now = self.clock()
        previous_raw = self.redis.hget(PROBES, model_key)
        previous = json.loads(previous_raw) if previous_raw else None
        repo = model_policy.parse(model_key).repo_id
        was_alerting = previous is not None and alerts.alerting(previous)
        base = {"model_key": model_key, "repo": repo, "nnsight": target.get("nnsight") or runtime_of(model_key),
                "dtype": target.get("dtype"), "at": now}
        if "queued_behind" in result:
            behind = result["queued_behind"]
            entry = {"ok": True, "error": "", "failures": 0, "since": now, "latency_s": None, "worker": None,
                     **(previous or {}), **base, "state": QUEUED, "queued_behind": behind,
                     "note": f"queued behind {behind} job{'' if behind == 1 else 's'}" if behind else "queued, next"}
            self.redis.hset(PROBES, model_key, json.dumps(entry))
            return entry
        field = reference_field(model_key, target.get("dtype"))
        raw = self.redis.hget(REFERENCES, field)
        reference = json.loads(raw) if raw else None
        ok, why = judge(result, reference)
        if ok and reference is None:
            self.redis.hset(REFERENCES, field, json.dumps(
                {"values": result["values"], "shape": result["shape"], "recorded_at": now,
                 "worker": result.get("worker")}))
        same = previous is not None and bool(previous.get("ok")) == ok
        entry = {
            **base, "ok": ok, "state": OK if ok else FAILING, "error": why,
            "latency_s": result.get("latency_s"), "worker": result.get("worker"),
            "failures": 0 if ok else (previous or {}).get("failures", 0) + 1,
            "since": previous.get("since", now) if same else now,
        }
        if not ok:
            entry["failed_at"] = now
        pipe = self.redis.pipeline()
        pipe.hset(PROBES, model_key, json.dumps(entry))
        pipe.hincrby(RUNS, f"{model_key}|{'ok' if ok else 'failed'}", 1)
        pipe.execute()
        history.record_probe(self.redis, model_key, ok, entry["latency_s"], now)  # the dashboard's charts
        # The log says each change; the webhook hears of it from the courier (``alerts.Courier``).
        if not ok and (previous is None or previous.get("ok")):
            log.warning("the health probe of %s failed (the alert waits %.0f s for it to go on failing): %s",
                        alerts.shown_deployment(entry), alerts.ALERT_AFTER_S, why)
        if alerts.alerting(entry) and not was_alerting:
            log.warning("%s", alerts.alert_text(entry, "firing"))
        elif ok and previous is not None and not previous.get("ok"):
            log.warning("%s", alerts.alert_text(entry, "resolved") if was_alerting else
                        f"the health probe of {alerts.shown_deployment(entry)} answers correctly again")
        self.courier.wake.set()
        return entry
