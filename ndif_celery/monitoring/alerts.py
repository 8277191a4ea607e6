"""Probe alerts: when a red probe turns its alert on, and its delivery to the webhook.

A probe judged red (``ndif_celery.monitoring.probes``) turns the alert on only
after failing for :data:`ALERT_AFTER_S` (consecutive failures a minute apart
or more), as docs/monitoring.md promises: one probe lost to a restart or a
blip pages no one.

The webhook (``NDIF_ALERT_WEBHOOK_URL``, when set) is told the current state
of every model, not a stream of events. ``ndif:probes:delivered`` holds, per
model key, that its ``firing`` alert was taken, and by which URL (a hash of
it: Redis need not hold the token). A :class:`Courier` thread compares it
with the probes' results after every round: a red model the URL was not told
of gets ``firing``, a model it was told of that is green again (or no longer
deployed) gets ``resolved``. So an alert a down receiver missed is sent once
it is back, and once taken it is not sent again. A failed POST is retried
with backoff (:data:`RETRY_FIRST_S` doubling to :data:`RETRY_MAX_S`) in that
thread, so the probes never wait on the webhook. A changed URL has not been
told anything, so it gets every red model; a beat that starts leading forgets
what was delivered for the models red now (:func:`resend`) and sends them
again, since the last receiver may have lost them while no beat led.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Callable
from urllib.parse import urlsplit

import redis

from ndif_celery import config
from ndif_celery.notices import Notices
from ndif_celery.policy import model_policy

if TYPE_CHECKING:
    from . import probes

log = logging.getLogger("ndif_celery.alerts")

ALERT = "NdifProbeFailing"
# A red probe alerts once it has failed this long (its first and latest failure
# this far apart): one probe lost to a restart or a blip does not page anyone.
ALERT_AFTER_S = 60.0
DELIVERED = "ndif:probes:delivered"  # model key -> {"url": hash, "entry": ...}: its firing alert was taken there
WEBHOOK_TIMEOUT_S = 5.0  # one POST; only the courier's thread waits on it
# After a failed delivery the courier waits RETRY_FIRST_S, then twice as long
# after each further failure, up to RETRY_MAX_S: a receiver that restarts hears
# within seconds, one down for hours is tried once a minute, not hammered.
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0
NOT_DEPLOYED = "no longer deployed"


def alerting(row: dict) -> bool:
    """Whether a result's alert is on: red, its failures spanning :data:`ALERT_AFTER_S`."""
    if row.get("ok"):
        return False
    failed_at = row.get("failed_at", row.get("at")) or 0.0
    return failed_at - (row.get("since") or failed_at) >= ALERT_AFTER_S


def resend(client: redis.Redis, rows: list[dict]) -> None:
    """Forget that the webhook took the alerts of the models red in ``rows`` (the probes'
    results), so the courier sends them again. Called when a beat starts leading: a beat
    restarted, or took over from one that stopped, and the receiver may have lost what
    it was told meanwhile."""
    red = [row["model_key"] for row in rows if alerting(row)]
    if red:
        client.hdel(DELIVERED, *red)


def url_hash(url: str) -> str:
    """Which URL took an alert, as Redis keeps it: a hash, since the URL often holds a token."""
    return hashlib.sha256(url.encode()).hexdigest()[:16]


def pending(client: redis.Redis, url: str, rows: list[dict]) -> list[tuple[dict, str, str]]:
    """``(entry, status, note)`` of every alert the webhook at ``url`` has not taken, from
    ``rows`` (the probes' results): ``firing`` for a model red for a minute (:func:`alerting`)
    it was not told of, ``resolved`` for a model it was told of that is green now or no
    longer probed. Marks left by another URL, of models not red now, are dropped: that
    receiver is no longer ours, and this one never heard of them."""
    token = url_hash(url)
    current = {row["model_key"]: row for row in rows}
    told = {field.decode(): json.loads(raw) for field, raw in client.hgetall(DELIVERED).items()}
    out = []
    for key, row in current.items():
        if alerting(row) and told.get(key, {}).get("url") != token:
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


def shown_deployment(entry: dict) -> str:
    """A deployment as people read it: its repo and the nnsight that serves it."""
    nnsight = entry.get("nnsight") or model_policy.runtime_of(entry.get("model_key") or "")
    return f"{entry.get('repo')} (nnsight {nnsight})"


def alert_text(entry: dict, status: str, note: str = "") -> str:
    """One line for the log and for a chat webhook."""
    if status == "firing":
        return f"{ALERT}: the health probe of {shown_deployment(entry)} failed: {entry.get('error')}"
    return f"{ALERT} resolved: {shown_deployment(entry)} {note or 'answers its probe correctly again'}"


def alert_payload(entry: dict, status: str, note: str, farm: str) -> dict:
    """The JSON the webhook gets (docs/monitoring.md shows one)."""
    return {
        "alert": ALERT, "status": status, "model": entry.get("repo"),
        "nnsight": entry.get("nnsight") or model_policy.runtime_of(entry.get("model_key") or ""),
        "model_key": entry.get("model_key"), "error": entry.get("error") or None,
        "latency_s": entry.get("latency_s"), "worker": entry.get("worker"), "at": entry.get("at"),
        "failing_since": None if status != "firing" else entry.get("since"),
        "farm": farm, "text": alert_text(entry, status, note),
    }


def post_json(url: str, payload: dict, timeout_s: float = WEBHOOK_TIMEOUT_S) -> None:
    """POST ``payload`` as JSON; raises OSError (urllib's errors) when it was not taken (2xx)."""
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "ndif-celery"})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:  # noqa: S310 - the operator's URL
        if not 200 <= answer.status < 300:
            raise OSError(f"the webhook answered {answer.status}")


def retry_delay(failures: int) -> float:
    """Seconds to wait after ``failures`` failed deliveries in a row (1, 2, 4 ... at most RETRY_MAX_S)."""
    return min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** max(0, failures - 1))


class Courier(threading.Thread):
    """Delivers a prober's alerts in a thread of its own, so a webhook that is down
    or slow never holds up the probes. Woken after every round; after a failed
    delivery it waits :func:`retry_delay` and tries again, while its prober leads."""

    def __init__(self, prober: "probes.Prober", post: Callable[[str, dict], None] = post_json) -> None:
        super().__init__(name="ndif-alert-courier", daemon=True)
        self.prober = prober
        self.post = post
        self.wake = threading.Event()
        self.notices = Notices(log)

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
                taken = self.deliver()
            except Exception as error:  # noqa: BLE001 - Redis away, say: the courier must outlive it
                log.error("alert delivery failed: %s", _why(error, self.prober.settings.alert_webhook_url))
                taken = False
            failures = 0 if taken else failures + 1

    def deliver(self) -> bool:
        """POST to the webhook every alert it has not taken (:func:`pending`), marking each
        taken. True when all were taken (or there is no webhook to send to); False at the
        first that was not: the courier tries again after its backoff."""
        settings, client = self.prober.settings, self.prober.redis
        url = settings.alert_webhook_url
        if not url:
            return True
        try:
            config.check_alert_webhook_url(url)
        except ValueError as error:
            self.notices.warn("webhook-url", f"no alert can be sent: {error}")
            return True  # retrying cannot help; a restart with a good URL sends what is red
        for entry, status, note in pending(client, url, self.prober.results()):
            try:
                self.post(url, alert_payload(entry, status, note, settings.api_url))
            except Exception as error:  # noqa: BLE001 - urllib's errors, http.client's, anything: retried
                self.notices.warn("webhook", f"the alert webhook ({shown_url(url)}) did not take the {status} alert "
                                             f"of {entry.get('repo')}: {_why(error, url)}; retrying with backoff "
                                             f"(up to {RETRY_MAX_S:.0f} s apart)")
                return False
            if status == "firing":
                told = {"url": url_hash(url), "at": time.time(),
                        "entry": {k: entry.get(k) for k in ("model_key", "repo", "nnsight", "dtype")}}
                client.hset(DELIVERED, entry["model_key"], json.dumps(told))
            else:
                client.hdel(DELIVERED, entry["model_key"])
            self.notices.cleared("webhook", "the alert webhook takes alerts again")
        return True


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
