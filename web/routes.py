"""The HTTP endpoints nnsight 0.8.1 calls (and a few it doesn't: /ping, /env).

``POST /request`` reads the body within the bounds of ``web/uploads.py`` (the
key and its limits checked first, a read deadline), then hands it to the intake
(``ndif_celery.intake``: validate, park the payload in Redis, enqueue a
JSON-only Celery message on the model's queue, tell the client it is QUEUED)
and answers RECEIVED in the HTTP body, as NDIF does. Every refusal here raises
``errors.Refused``, answered by the app's one handler (``web/app.py``).
"""

from __future__ import annotations

import json

import redis
from flask import Blueprint, Response, current_app, jsonify, request

from ndif_celery import intake, messages, socketio_wire, wire
from ndif_celery.accounts import auth
from ndif_celery.errors import Refused
from ndif_celery.farm import actions
from ndif_celery.host import environment, runtimes
from ndif_celery.policy import client_versions
from ndif_celery.state import expiry
from ndif_celery.state import jobs, registry

from . import dtype_path, uploads
from .identity import identify

bp = Blueprint("api", __name__)


def _redis() -> redis.Redis:
    return current_app.config["NDIF_REDIS"]


def _settings():
    return current_app.config["NDIF_SETTINGS"]


def _added_runtimes() -> set:
    """The runtimes added on this web's host: a refused client is told whether to add one or start its worker."""
    return {client_versions.release_of(runtime.version) for runtime in runtimes.listing(_settings().home)}


@bp.get("/ping")
def ping():
    return jsonify("pong")


@bp.post("/request")
def submit():
    arrived = jobs.now()
    identity = identify()
    # The key, the client's nnsight, its limits and the body's size are checked before the body is read.
    runtime = intake.check_runtime(_redis(), _settings(), request.headers, _added_runtimes)
    pinned, release = port_runtime(), client_versions.release_of(runtime) or client_versions.MAIN
    if pinned and pinned != release:
        raise Refused(f"This port serves nnsight {pinned} clients, and yours is nnsight "
                      f"{release}: use the farm's API port ({_settings().api_port}).", 400)
    with uploads.reading(_redis(), _settings(), identity):
        if socketio_wire.speaks(request.headers):  # a 0.6/0.7 client: the payload is the body
            data, blob = None, request.get_data(cache=False)
        else:
            data = request.form.get("data")
            blob_file = request.files.get("blob")
            blob = None if blob_file is None else blob_file.read()
    job = intake.accept(_redis(), current_app.config["NDIF_CELERY"], _settings(), identity, data, blob,
                        request.headers, arrived, runtime=runtime, held=request.environ.get(dtype_path.ENVIRON_KEY, ""))
    return Response(wire.response_json(job.id, wire.RECEIVED, wire.RECEIVED_DESCRIPTION), mimetype="application/json")


@bp.get("/response/<job_id>")
def response(job_id: str):
    identity = identify()
    client = _redis()
    latest = jobs.latest_status(client, job_id) if wire.JOB_ID.match(job_id) else None
    if latest is None:
        ttl_s = current_app.config["NDIF_SETTINGS"].job_ttl_s
        if wire.JOB_ID.match(job_id) and expiry.expired(client, job_id, ttl_s):
            return Response(expiry.expired_response(job_id, ttl_s), mimetype="application/json")
        raise Refused(f"No response for request {job_id}.", 404)
    pipe = client.pipeline(transaction=False)
    pipe.get(jobs.owner_key(job_id))
    pipe.exists(jobs.gone_key(job_id))
    owner, gone = pipe.execute()
    if owner != identity.owner.encode():
        raise Refused(f"Request {job_id} was submitted with another API key.", 403)
    if gone:  # its client is back: its closed websocket does not cancel it
        client.delete(jobs.gone_key(job_id))
    return Response(_fresh_url(latest, job_id), mimetype="application/json")


@bp.post("/cancel/<job_id>")
def cancel(job_id: str):
    """The job's owner ends it: taken out of its queue, or interrupted where it
    runs (as ``ndif-celery kill``); another key is refused (403)."""
    identity = identify()
    client = _redis()
    owner = client.get(jobs.owner_key(job_id)) if wire.JOB_ID.match(job_id) else None
    if owner is None:
        raise Refused(f"No request {job_id} to cancel (unknown, or expired).", 404)
    if owner != identity.owner.encode():
        raise Refused(f"Request {job_id} was submitted with another API key; only its owner may cancel it.", 403)
    if jobs.finished(client, job_id):
        raise Refused(f"Request {job_id} has already ended.", 409)
    try:
        done = actions.kill(client, current_app.config["NDIF_CELERY"], job_id, _settings().job_ttl_s,
                            messages.CANCELLED_BY_OWNER)
    except actions.FarmError:
        raise Refused(f"Request {job_id} has already ended.", 409) from None
    return jsonify(id=job_id, cancelled=done)


def _fresh_url(latest: bytes, job_id: str) -> bytes:
    """A stored COMPLETED status with a newly signed result URL.

    The URL in the stored status was signed when the job completed and lives
    ``NDIF_RESULT_URL_TTL_S``; the result itself lives ``NDIF_JOB_TTL_S``. Each
    poll signs a new one, so a result collected late still downloads."""
    if b'"COMPLETED"' not in latest:
        return latest
    status = json.loads(latest)
    if status.get("status") != wire.COMPLETED or not isinstance(status.get("data"), str):
        return latest
    status["data"] = current_app.config["NDIF_STORE"].url(jobs.result_key(job_id))
    return json.dumps(status).encode()


def port_runtime() -> str:
    """The runtime whose own port (``NDIF_RUNTIME_PORTS``) the request came in
    on, or "" (the API's port). The socket's own port, not the Host header:
    a proxy may rewrite that."""
    ports = _settings().runtime_ports
    if not ports:
        return ""
    sock = request.environ.get("gunicorn.socket")
    try:
        port = sock.getsockname()[1] if sock is not None else int(request.environ.get("SERVER_PORT") or 0)
    except (OSError, ValueError, IndexError):
        return ""
    return next((version for version, own in ports.items() if own == port), "")


@bp.get("/status")
def status():
    runtime = port_runtime()
    if runtime:
        document = json.loads(registry.cached_status(_redis()))
        return jsonify(registry.runtime_status(document, runtime))
    return Response(registry.cached_status(_redis()), mimetype="application/json")


@bp.get("/env")
def env():
    """The workers' environment, which ``nnsight.compare()`` holds against the
    client's: on a runtime's port, that runtime's workers'."""
    runtime = port_runtime()
    raw = _redis().get(registry.env_key(runtime))
    if raw is not None:
        return Response(raw, mimetype="application/json")
    if runtime:
        raise Refused(f"No worker of the nnsight {runtime} runtime has started on this farm yet "
                      f"(ndif-celery worker --nnsight {runtime}).", 503)
    return jsonify(environment.local_env())


@bp.get("/whoami")
def whoami():
    # As NDIF: anything short of an unreachable database answers, anonymously if need be.
    try:
        identity = identify()
    except auth.AuthError as error:
        if error.status == 503:
            raise
        identity = auth.Identity()
    return jsonify(email=identity.email, tags=list(identity.tags))


@bp.get("/connected")
def connected():
    try:
        _redis().ping()
    except redis.RedisError:
        raise Refused("Service temporarily unavailable: the broker cannot be reached.", 503) from None
    return jsonify(status="connected")

