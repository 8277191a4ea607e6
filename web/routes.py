"""The HTTP endpoints nnsight 0.8.1 calls (and a few it doesn't: /ping, /env).

``POST /request`` is the whole intake: validate the envelope, park the payload
in Redis, enqueue a JSON-only Celery message on the model's queue, tell the
client it is QUEUED. It answers RECEIVED in the HTTP body, as NDIF does.
"""

from __future__ import annotations

import json
import uuid

import redis
import zstandard
from flask import Blueprint, Response, current_app, jsonify, request

from ndif_celery import auth, cleanup, environment, jobs, limits, model_policy, queues, registry, statuses, versions, wire
from ndif_celery.celery_app import PRIORITY_FIRST, PRIORITY_NORMAL, queue_for, send_job

bp = Blueprint("api", __name__)


def _redis() -> redis.Redis:
    return current_app.config["NDIF_REDIS"]


def _settings():
    return current_app.config["NDIF_SETTINGS"]


def _fail(detail: str, status: int):
    return jsonify(detail=detail), status


@bp.get("/ping")
def ping():
    return jsonify("pong")


def identify() -> auth.Identity:
    """The caller's identity; raises AuthError (turned into its JSON refusal)."""
    return current_app.config["NDIF_AUTH"].identify(request.headers.get(auth.HEADER), request.remote_addr)


@bp.post("/request")
def submit():
    identity = identify()
    try:
        envelope = wire.parse_envelope(request.form.get("data"))
    except wire.WireError as error:
        return _fail(error.detail, error.status)
    settings = _settings()
    try:  # after the envelope, as NDIF: NDIF_MIN_NNSIGHT_VERSION / NDIF_MIN_PYTHON_VERSION
        versions.check_client(request.headers, settings.min_nnsight_version, settings.min_python_version)
    except versions.VersionRefused as error:
        return _fail(error.detail, error.status)
    client = _redis()
    try:  # the key and env as nnsight sends them, canonical; what this key may load (ndif_celery.model_policy)
        offered = () if identity.trusted else model_policy.offered_keys(client)
        envelope.model_key, envelope.env = model_policy.Policy.from_settings(settings).admit(
            envelope.model_key, envelope.env, identity.trusted, offered)
    except model_policy.PolicyError as error:
        return _fail(error.detail, error.status)
    if envelope.session_id and client.get(jobs.session_owner_key(envelope.session_id)) != identity.owner.encode():
        return _fail("session_id was not opened by this API key (open /subscribe with the same key).", 403)
    blob_file = request.files.get("blob")
    if blob_file is None:
        return _fail("Missing file part 'blob' (the serialized request payload).", 400)
    blob = blob_file.read()
    if not blob:
        return _fail("The 'blob' part is empty: there is no request payload to run.", 400)
    limits.check_payload(len(blob), settings)
    if envelope.compress:
        problem = _zstd_problem(blob)
        if problem:
            return _fail(problem, 400)

    job = jobs.Job(
        id=uuid.uuid4().hex,
        model_key=envelope.model_key,
        session_id=envelope.session_id,
        compress=envelope.compress,
        env=envelope.env,
        received_at=jobs.now(),
        payload_bytes=len(blob),
        trusted=identity.trusted,
        priority="priority" in identity.tags,
        owner=identity.owner,
    )
    queue = queue_for(job.model_key)
    depths = limits.check_and_count(client, identity, queue, settings)
    ahead = queues.lists_up_to(queue, PRIORITY_FIRST if job.priority else PRIORITY_NORMAL)
    position = sum(depths[: len(ahead)]) + 1
    received = wire.response_json(job.id, wire.RECEIVED, wire.RECEIVED_DESCRIPTION)
    # One round trip for the job's state, its QUEUED status (the first the
    # client sees after RECEIVED, before the job is visible to any worker) and
    # the queue's registration; then the message; then the controller.
    pipe = client.pipeline(transaction=False)
    pipe.set(jobs.payload_key(job.id), blob, ex=settings.job_ttl_s)
    pipe.set(jobs.owner_key(job.id), job.owner, ex=settings.job_ttl_s)
    pipe.set(jobs.message_key(job.id), jobs.dumps(job.to_message()), ex=settings.job_ttl_s)
    if job.session_id:
        pipe.sadd(jobs.session_jobs_key(job.session_id), job.id)
        pipe.expire(jobs.session_jobs_key(job.session_id), settings.job_ttl_s)
    limits.track(pipe, job)
    pipe.sadd(registry.QUEUES, queue)
    pipe.hset(registry.QUEUE_MODELS, queue, job.model_key)
    statuses.StatusChannel(client, job, settings.job_ttl_s).send(
        wire.QUEUED, f"Your job is queued for {wire.repo_fields(job.model_key)['repo_id']} (position {position}).",
        pipe=pipe,
    )
    pipe.execute()
    send_job(current_app.config["NDIF_CELERY"], job)
    # The controller deploys the model if no worker holds it (``workers.controller``).
    registry.wake_controller_once(client, queue)
    return Response(received, mimetype="application/json")


def _zstd_problem(blob: bytes) -> str:
    """Why a payload declared compressed is not a zstd frame, or ''."""
    try:
        params = zstandard.get_frame_parameters(blob)
    except zstandard.ZstdError as error:
        return f"The payload is declared compressed but is not a valid zstd frame ({error})."
    if params.content_size in (0, zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
        return "The payload is declared compressed but its zstd frame has no content size."
    return ""


@bp.get("/response/<job_id>")
def response(job_id: str):
    identity = identify()
    client = _redis()
    latest = jobs.latest_status(client, job_id) if wire.JOB_ID.match(job_id) else None
    if latest is None:
        ttl_s = current_app.config["NDIF_SETTINGS"].job_ttl_s
        if wire.JOB_ID.match(job_id) and cleanup.expired(client, job_id, ttl_s):
            return Response(cleanup.expired_response(job_id, ttl_s), mimetype="application/json")
        return _fail(f"No response for request {job_id}.", 404)
    if client.get(jobs.owner_key(job_id)) != identity.owner.encode():
        return _fail(f"Request {job_id} was submitted with another API key.", 403)
    return Response(_fresh_url(latest, job_id), mimetype="application/json")


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
    status["data"] = current_app.config["NDIF_STORE"].url(cleanup.result_key(job_id))
    return json.dumps(status).encode()


@bp.get("/status")
def status():
    return Response(registry.cached_status(_redis()), mimetype="application/json")


@bp.get("/env")
def env():
    raw = _redis().get(registry.ENV)
    if raw is not None:
        return Response(raw, mimetype="application/json")
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
        return _fail("Service temporarily unavailable: the broker cannot be reached.", 503)
    return jsonify(status="connected")

