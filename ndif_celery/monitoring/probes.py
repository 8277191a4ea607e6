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
alert in deploy/prometheus-rules.yml.

Alerts (``NDIF_ALERT_WEBHOOK_URL``, when set): the webhook is told the current
state of every model, not a stream of events. ``ndif:probes:delivered`` holds,
per model key, that its ``firing`` alert was taken, and by which URL (a hash
of it: Redis need not hold the token). A :class:`Courier` thread compares it
with the results after every round: a red model the URL was not told of gets
``firing``, a model it was told of that is green again (or no longer
deployed) gets ``resolved``. So an alert a down receiver missed is sent once
it is back, and once taken it is not sent again. A failed POST is retried
with backoff (:data:`RETRY_FIRST_S` doubling to :data:`RETRY_MAX_S`) in that
thread, so the probes never wait on the webhook. A changed URL has not been
told anything, so it gets every red model; a beat that starts leading forgets
what was delivered for the models red now and sends them again, since the
last receiver may have lost them while no beat led.
"""

from __future__ import annotations

import hashlib
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
from urllib.parse import urlsplit

import redis

from ndif_celery import config
from ndif_celery.notices import Notices
from ndif_celery.policy import models as model_policy
from ndif_celery.state import jobs, registry

from . import history

log = logging.getLogger("ndif_celery.probes")

LEADER = "ndif:probes:leader"
PROBES = "ndif:probes"
RUNS = "ndif:probes:runs"
REFERENCES = "ndif:probes:references"
OWNER = "ndif:probes:owner"  # the probe key's job owner (key:<id>), as the web saw it (intake.check_probe)
TOLERANCE = 1e-3  # of the reference's largest |value|: co-batching and devices differ by ~1e-6
STARTUP_S = 180.0  # the runner's first import of torch and nnsight, on a loaded host
DELIVERED = "ndif:probes:delivered"  # model key -> {"url": hash, "entry": ...}: its firing alert was taken there
WEBHOOK_TIMEOUT_S = 5.0  # one POST; only the courier's thread waits on it
# After a failed delivery the courier waits RETRY_FIRST_S, then twice as long
# after each further failure, up to RETRY_MAX_S: a receiver that restarts hears
# within seconds, one down for hours is tried once a minute, not hammered.
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0
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
    """One per beat process; the lease makes one of them probe (and its courier deliver)."""

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
        self.leading = False
        self.courier = Courier(self)

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
        self.runner.stop()

    def lead(self) -> bool:
        """Take or renew the lease. On taking it, the models red now are sent again (:meth:`resend`)."""
        leads = bool(self.redis.set(LEADER, self.me, nx=True, px=self.lease_ms))
        if not leads and self.redis.get(LEADER) == self.me.encode():
            self.redis.pexpire(LEADER, self.lease_ms)
            leads = True
        if leads and not self.leading:
            self.resend()
        self.leading = leads
        return leads

    def resend(self) -> None:
        """Forget that the webhook took the alerts of the models red now, so the courier sends
        them again. Called when this beat starts leading: a beat restarted, or took over from
        one that stopped, and the receiver may have lost what it was told meanwhile."""
        red = [row["model_key"] for row in results(self.redis) if not row.get("ok")]
        if red:
            self.redis.hdel(DELIVERED, *red)

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
                    log.warning("%s", alert_text(gone, "resolved", NOT_DEPLOYED))
        self.courier.wake.set()
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
        history.record_probe(self.redis, model_key, ok, entry["latency_s"], entry["at"])  # the dashboard's charts
        # The log says each change; the webhook hears of it from the courier (deliver).
        if not ok and (previous is None or previous.get("ok")):
            log.warning("%s", alert_text(entry, "firing"))
        elif ok and previous is not None and not previous.get("ok"):
            log.warning("%s", alert_text(entry, "resolved"))
        self.courier.wake.set()
        return entry

    def deliver(self) -> bool:
        """POST to the webhook every alert it has not taken (:func:`pending`), marking each
        taken. True when all were taken (or there is no webhook to send to); False at the
        first that was not: the courier tries again after its backoff."""
        url = self.settings.alert_webhook_url
        if not url:
            return True
        try:
            config.check_alert_webhook_url(url)
        except ValueError as error:
            self.notices.warn("webhook-url", f"no alert can be sent: {error}")
            return True  # retrying cannot help; a restart with a good URL sends what is red
        for entry, status, note in pending(self.redis, url):
            try:
                self.post(url, alert_payload(entry, status, note, self.settings.api_url))
            except Exception as error:  # noqa: BLE001 - urllib's errors, http.client's, anything: retried
                self.notices.warn("webhook", f"the alert webhook ({shown_url(url)}) did not take the {status} alert "
                                             f"of {entry.get('repo')}: {_why(error, url)}; retrying with backoff "
                                             f"(up to {RETRY_MAX_S:.0f} s apart)")
                return False
            if status == "firing":
                told = {"url": url_hash(url), "at": time.time(),
                        "entry": {k: entry.get(k) for k in ("model_key", "repo", "dtype")}}
                self.redis.hset(DELIVERED, entry["model_key"], json.dumps(told))
            else:
                self.redis.hdel(DELIVERED, entry["model_key"])
            self.notices.cleared("webhook", "the alert webhook takes alerts again")
        return True


class Courier(threading.Thread):
    """Delivers the prober's alerts in a thread of its own, so a webhook that is down
    or slow never holds up the probes. Woken after every round; after a failed
    delivery it waits :func:`retry_delay` and tries again, while its prober leads."""

    def __init__(self, prober: Prober) -> None:
        super().__init__(name="ndif-alert-courier", daemon=True)
        self.prober = prober
        self.wake = threading.Event()

    def run(self) -> None:
        failures = 0
        stopping = self.prober.stopping
        while not stopping.is_set():
            if failures:
                stopping.wait(retry_delay(failures))
            else:
                self.wake.wait(RETRY_MAX_S)
                self.wake.clear()
            if stopping.is_set() or not self.prober.leading:
                failures = 0
                continue
            try:
                taken = self.prober.deliver()
            except Exception as error:  # noqa: BLE001 - Redis away, say: the courier must outlive it
                log.error("alert delivery failed: %s", _why(error, self.prober.settings.alert_webhook_url))
                taken = False
            failures = 0 if taken else failures + 1


def retry_delay(failures: int) -> float:
    """Seconds to wait after ``failures`` failed deliveries in a row (1, 2, 4 ... at most RETRY_MAX_S)."""
    return min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** max(0, failures - 1))


def url_hash(url: str) -> str:
    """Which URL took an alert, as Redis keeps it: a hash, since the URL often holds a token."""
    return hashlib.sha256(url.encode()).hexdigest()[:16]


NOT_DEPLOYED = "no longer deployed"


def pending(client: redis.Redis, url: str) -> list[tuple[dict, str, str]]:
    """``(entry, status, note)`` of every alert the webhook at ``url`` has not taken: ``firing``
    for a red model it was not told of, ``resolved`` for a model it was told of that is green
    now or no longer probed. Marks left by another URL, of models not red now, are dropped:
    that receiver is no longer ours, and this one never heard of them."""
    token = url_hash(url)
    current = {row["model_key"]: row for row in results(client)}
    told = {field.decode(): json.loads(raw) for field, raw in client.hgetall(DELIVERED).items()}
    out = []
    for key, row in current.items():
        if not row.get("ok") and told.get(key, {}).get("url") != token:
            out.append((row, "firing", ""))
    for key, mark in sorted(told.items()):
        row = current.get(key)
        if mark.get("url") != token:
            if row is None or row.get("ok"):
                client.hdel(DELIVERED, key)
        elif row is None:
            out.append(({**mark["entry"], "ok": True, "error": "", "at": time.time()}, "resolved", NOT_DEPLOYED))
        elif row.get("ok"):
            out.append((row, "resolved", ""))
    return out


def alert_text(entry: dict, status: str, note: str = "") -> str:
    """One line for the log and for a chat webhook."""
    if status == "firing":
        return f"{ALERT}: the health probe of {entry.get('repo')} failed: {entry.get('error')}"
    return f"{ALERT} resolved: {entry.get('repo')} {note or 'answers its probe correctly again'}"


def alert_payload(entry: dict, status: str, note: str, farm: str) -> dict:
    """The JSON the webhook gets (docs/monitoring.md shows one)."""
    return {
        "alert": ALERT, "status": status, "model": entry.get("repo"), "model_key": entry.get("model_key"),
        "error": entry.get("error") or None, "latency_s": entry.get("latency_s"),
        "worker": entry.get("worker"), "at": entry.get("at"), "farm": farm, "text": alert_text(entry, status, note),
    }


def _why(error: BaseException, url: str) -> str:
    """What went wrong with a POST, without the URL's path, query or password: urllib
    repeats the whole URL in some messages (an unknown scheme, a control character)."""
    if isinstance(error, urllib.error.HTTPError):
        return f"it answered {error.code}"
    reason = error.reason if isinstance(error, urllib.error.URLError) else error
    text = str(reason) or type(reason).__name__
    if not url:
        return text
    try:
        parts = urlsplit(url)
        secrets = [url, parts.path, parts.query, parts.fragment, parts.password or "", parts.username or ""]
    except ValueError:
        return type(reason).__name__  # a URL urllib cannot even split: say nothing of its text
    for secret in secrets:
        if len(secret) > 1:
            text = text.replace(secret, "...")
    return text


def shown_url(url: str) -> str:
    """The webhook's scheme and host only: its path often holds a token."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "an unreadable URL"
    return f"{parts.scheme}://{parts.hostname or ''}{':' + str(port) if port else ''}/..."
