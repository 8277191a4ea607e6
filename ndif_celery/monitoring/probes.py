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

Results (``ndif:probes``: model key -> the last result) feed ``/metrics``
(``ndif_probe_ok{model}``, ``ndif_probe_latency_seconds{model}``,
``ndif_probe_last_run_timestamp_seconds{model}``, counted in
``ndif_probe_runs_total{model,result}``), the dashboard and the ``NdifProbeFailing``
alert in deploy/prometheus-rules.yml. When a model turns red, and again when
it is green, the beat POSTs a JSON alert to ``NDIF_ALERT_WEBHOOK_URL`` (when
set): once per change, not every round.
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
import urllib.error
import urllib.request
from typing import Callable, Optional

import redis

from ndif_celery import config
from ndif_celery.notices import Notices
from ndif_celery.policy import models as model_policy
from ndif_celery.state import jobs, registry

log = logging.getLogger("ndif_celery.probes")

LEADER = "ndif:probes:leader"
PROBES = "ndif:probes"
RUNS = "ndif:probes:runs"
REFERENCES = "ndif:probes:references"
OWNER = "ndif:probes:owner"  # the probe key's job owner (key:<id>), as the web saw it (intake.check_probe)
TOLERANCE = 1e-3  # of the reference's largest |value|: co-batching and devices differ by ~1e-6
STARTUP_S = 180.0  # the runner's first import of torch and nnsight, on a loaded host
WEBHOOK_TIMEOUT_S = 5.0
ALERT = "NdifProbeFailing"


def targets(client: redis.Redis) -> list[dict]:
    """``{model_key, dtype}`` of every model to probe: RUNNING on a live worker,
    or pinned and held by no worker at all (none is loading it either)."""
    held: dict[str, list] = {}
    for entry in registry.live_deployments(client):
        held.setdefault(entry["model_key"], []).append(entry)
    out = {}
    for key, entries in held.items():
        running = [e for e in entries if e["state"] == registry.RUNNING]
        if running:
            out[key] = {"model_key": key, "dtype": running[0].get("dtype")}
    for key, wish in registry.desired(client).items():
        if wish.get("pinned") and key not in held:
            out[key] = {"model_key": key, "dtype": wish.get("dtype")}
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
    """The last result of every probed model, by repo id."""
    rows = [json.loads(raw) for raw in client.hvals(PROBES)]
    return sorted(rows, key=lambda row: (row.get("repo") or "", row.get("model_key") or ""))


def reset(client: redis.Redis, model_key: str) -> int:
    """Forget the model's references (every dtype); the next green probe records a new one."""
    fields = [f for f in client.hkeys(REFERENCES) if f.decode().rsplit("|", 1)[0] == model_key]
    return client.hdel(REFERENCES, *fields) if fields else 0


def post_json(url: str, payload: dict, timeout_s: float = WEBHOOK_TIMEOUT_S) -> None:
    """POST ``payload`` as JSON; raises OSError (urllib's errors) when it was not taken (2xx)."""
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "ndif-celery"})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:  # noqa: S310 - the operator's URL
        if not 200 <= answer.status < 300:
            raise OSError(f"the webhook answered {answer.status}")


class Runner:
    """The probe's client process (``python -m ndif_celery.monitoring.probe_runner``), started
    on first use and again after it died or gave up on a stuck trace."""

    def __init__(self, settings: config.Settings) -> None:
        self.settings = settings
        self.proc: Optional[subprocess.Popen] = None
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()

    def _start(self) -> None:
        env = dict(os.environ, NDIF_PROBE_HOST=self.settings.api_url,
                   NDIF_PROBE_API_KEY=self.settings.probe_api_key)
        self.proc = subprocess.Popen([sys.executable, "-m", "ndif_celery.monitoring.probe_runner"], env=env,
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
            return {"model_key": model_key, "ok": False, "error": f"no answer within {timeout_s:.0f} s"}
        return json.loads(line)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


class Prober(threading.Thread):
    """One per beat process; the lease makes one of them probe."""

    def __init__(self, settings: config.Settings, redis_client=None, runner=None,
                 post: Callable[[str, dict], None] = post_json, name: Optional[str] = None) -> None:
        super().__init__(name="ndif-prober", daemon=True)
        self.settings = settings
        self.redis = redis_client or jobs.connect(settings.redis_url, settings.redis_outage_s)
        self.runner = runner or Runner(settings)
        self.post = post
        self.me = name or f"prober-{id(self):x}@{time.time():.0f}"
        self.stopping = threading.Event()
        self.notices = Notices(log)
        self.lease_ms = int(max(10.0, 3 * settings.probe_interval_s + settings.probe_timeout_s) * 1000)

    def run(self) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                if self.lead():
                    self.round()
            except Exception:  # noqa: BLE001 - the prober must outlive a bad round
                log.exception("probe round failed")
            self.stopping.wait(max(0.0, self.settings.probe_interval_s - (time.monotonic() - started)))
        self.runner.stop()

    def lead(self) -> bool:
        if self.redis.set(LEADER, self.me, nx=True, px=self.lease_ms):
            return True
        if self.redis.get(LEADER) == self.me.encode():
            self.redis.pexpire(LEADER, self.lease_ms)
            return True
        return False

    def round(self) -> list[dict]:
        """Probe every target once; forget the results of models no longer served."""
        recorded = []
        wanted = targets(self.redis)
        for target in wanted:
            if target not in targets(self.redis):
                continue  # evicted since the round began (and the web refuses a probe of a model not deployed)
            result = self.runner.probe(target["model_key"], self.settings.probe_timeout_s)
            if not result.get("ok") and target not in targets(self.redis):
                continue  # evicted while it was probed: not a failure of the model
            recorded.append(self.record(target, result))
            self.redis.pexpire(LEADER, self.lease_ms)
        keys = {t["model_key"] for t in wanted}
        for field in self.redis.hkeys(PROBES):
            if field.decode() not in keys:
                gone = json.loads(self.redis.hget(PROBES, field) or "{}")
                self.redis.hdel(PROBES, field)
                if gone and not gone.get("ok"):
                    self.alert({**gone, "ok": True, "error": "", "at": time.time()}, "resolved",
                               note="no longer deployed")
        return recorded

    def record(self, target: dict, result: dict) -> dict:
        model_key = target["model_key"]
        field = reference_field(model_key, target.get("dtype"))
        raw = self.redis.hget(REFERENCES, field)
        reference = json.loads(raw) if raw else None
        ok, why = judge(result, reference)
        if ok and reference is None:
            self.redis.hset(REFERENCES, field, json.dumps(
                {"values": result["values"], "shape": result["shape"], "recorded_at": time.time(),
                 "worker": result.get("worker")}))
        previous_raw = self.redis.hget(PROBES, model_key)
        previous = json.loads(previous_raw) if previous_raw else None
        repo = model_policy.parse(model_key).repo_id
        entry = {
            "model_key": model_key, "repo": repo, "dtype": target.get("dtype"), "ok": ok, "error": why,
            "latency_s": result.get("latency_s"), "worker": result.get("worker"), "at": time.time(),
            "failures": 0 if ok else (previous or {}).get("failures", 0) + 1,
            "since": (previous or {}).get("since") if previous and previous.get("ok") == ok else time.time(),
        }
        pipe = self.redis.pipeline()
        pipe.hset(PROBES, model_key, json.dumps(entry))
        pipe.hincrby(RUNS, f"{repo}|{'ok' if ok else 'failed'}", 1)
        pipe.execute()
        if not ok and (previous is None or previous.get("ok")):
            self.alert(entry, "firing")
        elif ok and previous is not None and not previous.get("ok"):
            self.alert(entry, "resolved")
        return entry

    def alert(self, entry: dict, status: str, note: str = "") -> None:
        repo = entry.get("repo")
        if status == "firing":
            text = f"{ALERT}: the health probe of {repo} failed: {entry.get('error')}"
            log.warning("%s", text)
        else:
            text = f"{ALERT} resolved: {repo} {note or 'answers its probe correctly again'}"
            log.warning("%s", text)
        url = self.settings.alert_webhook_url
        if not url:
            return
        payload = {
            "alert": ALERT, "status": status, "model": repo, "model_key": entry.get("model_key"),
            "error": entry.get("error") or None, "latency_s": entry.get("latency_s"),
            "worker": entry.get("worker"), "at": entry.get("at"), "farm": self.settings.api_url, "text": text,
        }
        try:
            self.post(url, payload)
            self.notices.cleared("webhook", "the alert webhook takes alerts again")
        except (OSError, urllib.error.URLError, ValueError) as error:
            self.notices.warn("webhook", f"the alert webhook ({_shown(url)}) did not take the alert: {error}")


def _shown(url: str) -> str:
    """The webhook's scheme and host only: its path often holds a token."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}{':' + str(parts.port) if parts.port else ''}/..."
