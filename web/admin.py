"""The dashboard's admin actions: deploy, evict, scale, kill, schedule add and remove.

Each is a form on ``/dashboard`` that POSTs to ``/dashboard/actions/<action>``
and runs the same farm function the CLI does (``ndif_celery.farm``). Who may:

- only an API key tagged ``admin``, shown as the dashboard's HTTP Basic
  password; with ``NDIF_AUTH`` off there are no keys, so there are no actions
  (anyone who reaches the page would be an operator);
- only from the dashboard's own page: every form carries a token made from
  the key (an HMAC with a farm secret kept in Redis), and a request whose
  ``Origin`` or ``Sec-Fetch-Site`` says it came from another site is refused.
  A browser sends Basic credentials with any request to the host, so without
  the token another site's page could post a form as the operator.

Every action an admin key sends, done, refused or failed, is written to the
audit log (``ndif_celery.accounts.audit``) before the answer; the answer is a
redirect to the dashboard, which shows that entry.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from typing import Callable, Optional
from urllib.parse import urlsplit

import redis
from flask import Blueprint, current_app, redirect, request

from ndif_celery import messages
from ndif_celery.accounts import audit
from ndif_celery.accounts.auth import Identity
from ndif_celery.farm import actions
from ndif_celery.farm import deployments, schedules
from ndif_celery.farm.deployments import DeploymentsError
from ndif_celery.policy import held_formats, model_policy

from .operators import challenge, ledger_engine, sign_in

bp = Blueprint("admin", __name__)
log = logging.getLogger("ndif_celery.web")

SECRET = "ndif:dashboard:secret"  # the farm's CSRF secret: made once, shared by every web process
FIELD = "csrf"


class ActionError(ValueError):
    """An action the farm cannot do as asked; the message says why."""


# --- who may act ------------------------------------------------------------------------


def token_for(client: redis.Redis, identity: Identity) -> str:
    """The forms' token for this key: stable across processes and restarts, useless for another key."""
    client.set(SECRET, secrets.token_hex(32), nx=True)
    secret = client.get(SECRET)
    return hmac.new(secret, f"{identity.owner}".encode(), hashlib.sha256).hexdigest()


def _same_site() -> bool:
    """False when the browser says the form came from another site (or from nowhere: ``null``)."""
    if request.headers.get("Sec-Fetch-Site", "same-origin") not in ("same-origin", "none"):
        return False
    origin = request.headers.get("Origin")
    if origin is None:
        return True  # not sent by older browsers and by tools; the token still decides
    return origin != "null" and urlsplit(origin).netloc == request.host


# --- the actions --------------------------------------------------------------------------


def _dtype(form) -> Optional[str]:
    """The form's dtype as the farm keeps it (a quantization by its canonical name), or None."""
    dtype = (form.get("dtype") or "").strip() or None
    try:
        return held_formats.check(dtype) if dtype is not None else None
    except held_formats.FormatError as error:
        raise ActionError(error.detail) from None


def _model_key(form) -> str:
    """The deployment the form names: its model, task and, for a quantized one, dtype."""
    model = (form.get("model") or "").strip()
    if not model:
        raise ActionError("give a model (a repo id such as openai-community/gpt2)")
    try:
        key = actions.model_key_for(model, task=(form.get("task") or "text-generation").strip(), dtype=_dtype(form))
        settings = current_app.config["NDIF_SETTINGS"]
        model_policy.ModelPolicy.from_settings(settings).check_model(model_policy.parse(key))
    except model_policy.PolicyError as error:
        raise ActionError(error.detail) from None
    return key


def _whole(form, name: str, default: int, low: int = 1, high: int = deployments.MAX_REPLICAS) -> int:
    raw = (form.get(name) or "").strip() or str(default)
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise ActionError(f"{name} must be a whole number from {low} to {high}, got {raw[:20]!r}")
    return int(raw)


def _deploy(client, celery, settings, form) -> tuple[str, str]:
    key = _model_key(form)
    dtype = _dtype(form)
    replicas = _whole(form, "replicas", 1)
    actions.deploy(client, key, bool(form.get("pin")), replicas, dtype)
    return model_policy.parse(key).repo_id, f"deployment requested: {replicas} replica(s)" + (
        ", pinned" if form.get("pin") else "")


def _evict(client, celery, settings, form) -> tuple[str, str]:
    key = _model_key(form)
    workers = actions.evict(client, celery, key)
    repo = model_policy.parse(key).repo_id
    return repo, f"evicting from {', '.join(sorted(workers))}" if workers else "not deployed; its wish is forgotten"


def _scale(client, celery, settings, form) -> tuple[str, str]:
    key = _model_key(form)
    replicas = _whole(form, "replicas", 1)
    evicted = deployments.scale(client, celery, key, replicas)
    said = f"{replicas} replica(s) requested"
    return model_policy.parse(key).repo_id, said + (f"; evicting on {', '.join(sorted(evicted))}" if evicted else "")


def _kill(client, celery, settings, form) -> tuple[str, str]:
    job_id = (form.get("job_id") or "").strip()
    if not job_id or len(job_id) > 64 or not job_id.isalnum():
        raise ActionError("give the job id to kill (as `ndif-celery jobs` and the recent jobs show it)")
    return job_id, actions.kill(client, celery, job_id, settings.job_ttl_s, messages.CANCELLED)


def _schedule_add(client, celery, settings, form) -> tuple[str, str]:
    key = _model_key(form)
    repo = model_policy.parse(key).repo_id
    try:
        start = schedules.parse_when(form.get("start") or "", option="from")
        end = schedules.parse_when(form.get("end") or "", option="to")
        # Checked against the live workers: a window nobody can meet is otherwise silent until it opens.
        # (A deploy or scale here waits on nothing: its unmet reason shows in the wanted table at once.)
        entry = schedules.add(client, key, repo, start, end, _whole(form, "replicas", 1), settings=settings)
    except schedules.ScheduleError as error:
        raise ActionError(str(error)) from None
    return repo, f"window {entry['id']}: {schedules.iso(start)} to {schedules.iso(end)}"


def _schedule_remove(client, celery, settings, form) -> tuple[str, str]:
    schedule_id = (form.get("id") or "").strip()
    entry = schedules.remove(client, schedule_id) if schedule_id else None
    if entry is None:
        raise ActionError(f"no scheduled window {schedule_id[:64]!r}")
    return schedule_id, f"removed the window of {entry['repo']}"


ACTIONS: dict[str, Callable] = {
    "deploy": _deploy, "evict": _evict, "scale": _scale, "kill": _kill,
    "schedule-add": _schedule_add, "schedule-remove": _schedule_remove,
}


@bp.post("/dashboard/actions/<action>")
def act(action: str):
    settings = current_app.config["NDIF_SETTINGS"]
    if not settings.auth:
        return challenge("Admin actions need NDIF_AUTH=1 and an admin API key; with auth off the dashboard is "
                         "read-only.", 403)
    identity, refusal = sign_in()
    if refusal is not None:
        return refusal
    client = current_app.config["NDIF_REDIS"]
    form = request.form
    detail = {name: form.get(name)[:200] for name in form if name != FIELD}
    target = (form.get("model") or form.get("job_id") or form.get("id") or "")[:300]
    if action not in ACTIONS:
        return challenge(f"No admin action {action[:40]!r}; the actions are {', '.join(ACTIONS)}.", 404)
    sent = form.get(FIELD, "")
    if not _same_site() or not hmac.compare_digest(sent.encode(), token_for(client, identity).encode()):
        _audit(identity, action, target, detail, audit.REFUSED,
               "not sent from this farm's dashboard (missing or wrong form token, or another site)")
        return challenge("This action was not sent from this farm's dashboard page (its form token is missing or "
                       "wrong, or it came from another site); nothing was done.", 403)
    try:
        target, message = ACTIONS[action](client, current_app.config["NDIF_CELERY"], settings, form)
        outcome = audit.DONE
    except (ActionError, DeploymentsError, actions.FarmError) as error:
        outcome, message = audit.REFUSED, str(error)
    except Exception as error:  # noqa: BLE001 - recorded and shown; the page stays up
        log.exception("dashboard action %s failed", action)
        outcome, message = audit.FAILED, f"{type(error).__name__}: {error}"
    entry = _audit(identity, action, target, detail, outcome, message)
    return redirect(f"{request.script_root}/dashboard?said={entry}#actions", 303)


def _audit(identity: Identity, action: str, target: str, detail: dict, outcome: str, message: str) -> int:
    log.info("dashboard action %s %s by %s: %s %s", action, target, identity.owner, outcome, message)
    return audit.record(ledger_engine(), identity.owner, identity.email, action, target, detail, outcome, message,
                        request.remote_addr)
