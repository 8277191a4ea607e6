"""The intake of ``POST /request``: from what the client sent to a QUEUED job.

The route (``web/routes.py``) only reads the HTTP request and answers. This
module is the pipeline: one named step each, in the order a request meets
them. The order is part of the contract. A request wrong in two ways is
refused for the first, as on NDIF: a bad envelope before an old client.
The steps:

    envelope -> version gate -> model policy (and a deployment's users) -> session -> payload
             -> limits -> turn -> park (QUEUED, the Celery message at its turn) -> controller

Before any of this, the web checks what the headers tell. It checks the key,
and the client's nnsight against the versions the farm runs
(:func:`check_runtime`). ``web/uploads.py`` checks the body's size, the key's
rate and concurrency, and room to read the body. A request refused there is
never read. The runtime comes before the envelope because another client
version sends another body. A 0.7 client gets the sentence about versions,
not one about form fields.

Every refusal raises ``errors.Refused`` (or a subclass) before the job is
parked. So a refused request leaves no job in Redis
(tests/inprocess/ndif_celery/test_intake.py). Settings, Redis and the Celery
app are passed in, with no Flask. The fast tier and any other front end can
drive it directly.
"""

from __future__ import annotations

import hmac
import uuid
import zlib
from typing import Callable, Mapping, Optional

import redis
import zstandard
from celery import Celery

from . import config, messages, socketio_wire, statuses, wire
from .accounts import auth, limits
from .celery_app import PRIORITY_FIRST, PRIORITY_NORMAL, queue_for
from .errors import Refused
from .farm import deployments
from .monitoring import probes
from .policy import client_versions
from .policy import model_policy
from .state import byte_quotas, jobs, queues, registry, run_times, turns


def accept(
    client: redis.Redis,
    celery: Celery,
    settings: config.Settings,
    identity: auth.Identity,
    data: Optional[str],
    blob: Optional[bytes],
    headers: Mapping[str, str],
    arrived: Optional[float] = None,
    runtime: str = "",
    held: str = "",
) -> jobs.Job:
    """Check the request for ``identity``, then park, enqueue and return the job.

    ``data`` is the envelope form field. ``blob`` is the payload part, None
    when absent. A 0.6/0.7 client's envelope is in its headers
    (``socketio_wire``). ``arrived`` is when the request reached the web, for
    the job's timeline. ``runtime`` is the nnsight runtime that serves the
    client (:func:`check_runtime`). ``held`` is the quantization the request's
    URL asked for (``web.dtype_path``), "" for none."""
    protocol = check_protocol(headers, runtime)
    codec = client_versions.payload_codec(runtime or client_versions.MAIN)
    envelope = socketio_wire.envelope(headers, codec) if protocol else wire.parse_envelope(data)
    # After the envelope, as on NDIF: NDIF_MIN_NNSIGHT_VERSION, NDIF_MIN_PYTHON_VERSION.
    client_versions.check_client(headers, settings.min_nnsight_version, settings.min_python_version)
    # What the checks read, in one round trip: the farm's offer, the session's owner.
    reads = client.pipeline(transaction=False)
    repo = wire.repo_id(envelope.model_key)
    registry.read_offer(reads, repo)
    run_times.read(reads, envelope.model_key)
    reads.get(jobs.session_owner_key(envelope.session_id or "-"))
    answers = reads.execute()
    offer = registry.decode_offer(answers, repo)
    per_job = run_times.per_job_s(answers[-2])
    admit_model(client, settings, identity, envelope, offer, runtime, held)
    probe = check_probe(client, settings, identity, headers, envelope.model_key, offer.keys)
    owner = answers[-1]
    unclaimed = bool(protocol and envelope.session_id and owner == b"")  # a Socket.IO socket no key claimed
    if not unclaimed:
        check_session(identity, envelope.session_id, owner)
    blob = check_payload(blob, envelope.compress, settings, envelope.codec)
    if unclaimed:  # the first key whose request passes its checks claims it. A race has one winner.
        check_session(identity, envelope.session_id, jobs.claim_session(client, envelope.session_id, identity.owner))
        # The socket is the key's now. It counts like the key's /subscribe sockets; the web renews it.
        limits.claim_socket(client, identity, envelope.session_id, settings)
    job = jobs.Job(
        id=uuid.uuid4().hex,
        model_key=envelope.model_key,
        session_id=envelope.session_id,
        compress=envelope.compress,
        env=envelope.env,
        received_at=arrived or jobs.now(),
        payload_bytes=len(blob),
        trusted=identity.trusted,
        priority="priority" in identity.tags,
        owner=identity.owner,
        protocol=protocol,
    )
    queue = queue_for(job.model_key)
    depths = limits.check_and_count(client, identity, queue, settings)  # the queue's lists, in serving order
    served_with = len(queues.lists_up_to(queue, PRIORITY_FIRST if job.priority else PRIORITY_NORMAL))
    if settings.fair_turns:  # behind the lists served first, then its place among the keys' turns
        position = sum(depths[:served_with - 1]) + turns.plan(client, job, queue, settings.job_ttl_s, first=probe) + 1
    else:  # first in, first out: behind every job in its list or a list served first
        position = sum(depths[:served_with]) + 1
    job.queued_at = jobs.now()
    job.queued_position = position
    wait = run_times.wait_s(position, per_job, registry.lanes(offer.workers, offer.deployments, job.model_key,
                                                                job.queued_at))
    limits.reserve_parked(client, identity, job, settings)
    try:
        park(client, celery, job, blob, messages.queued(job.model_key, position, wait), settings)
    except BaseException:
        byte_quotas.PARKED.release(client, [byte_quotas.payload_entry(job.id)])
        raise
    if probe:  # the beat finds its probe in the line by this id (probes.queued_behind)
        probes.note_sent(client, job.model_key, job.id)
    # The controller deploys the model if no worker serves it (``ndif_celery.farm.controller``).
    # A served model needs nothing of it now: its ticks tell positions and add replicas.
    if job.model_key not in offer.serving:
        registry.wake_controller_once(client, queue)
    return job


def check_runtime(client: redis.Redis, settings: config.Settings, headers: Mapping[str, str],
                  added_here: Callable[[], set] = set) -> str:
    """Before the body is read: the client's nnsight must be one this farm runs.

    The rules are ``policy.client_versions``. The live workers are read only
    for a version other than the farm's own. NDIF_MIN_NNSIGHT_VERSION is
    checked first, so a client below it reads NDIF's own sentence. Returns the
    runtime that serves the client: its version (with its Python minor for a
    bytecode client's runtime on another minor), or "" for the farm's own."""
    reported = headers.get(client_versions.NNSIGHT_HEADER)
    if reported:
        client_versions.check_nnsight(reported, settings.min_nnsight_version)
    client_versions.check_served_at_all(reported)
    workers: Optional[dict] = None

    def live() -> dict:  # read once, and only for a version other than the farm's own
        nonlocal workers
        if workers is None:
            workers = registry.live_workers(client)
        return workers

    client_versions.check_runtime(reported, client_versions.MAIN,
                                  lambda: client_versions.served(live(), client_versions.MAIN), added_here)
    if reported and client_versions.sends_bytecode(reported):
        said = headers.get(client_versions.PYTHON_HEADER)
        client_versions.check_python_minor(reported, said, client_versions.python_minors(live(), reported))
        return client_versions.runtime_for(live(), reported, said)
    return client_versions.as_runtime(reported)


def check_protocol(headers: Mapping[str, str], runtime: str) -> str:
    """The protocol the request came in (``jobs.Job.protocol``).

    It must be its client version's: a 0.6/0.7 client's envelope in headers,
    or the form."""
    spoken = socketio_wire.PROTOCOL if socketio_wire.speaks(headers) else ""
    expected = client_versions.protocol_of(runtime or client_versions.MAIN)
    if spoken != expected:
        version = client_versions.release_of(runtime) or client_versions.MAIN
        flag = (socketio_wire.ZLIB if client_versions.payload_codec(version) == wire.ZLIB
                else socketio_wire.COMPRESS)
        said = (f"its envelope in the {socketio_wire.MODEL_KEY} and {flag} headers" if expected
                else "a multipart form with the fields 'data' and 'blob'")
        raise Refused(f"An nnsight {version} client sends {said}; this request does not. "
                      "Is the nnsight-version header the client's own?", 400)
    return spoken


def admit_model(client: redis.Redis, settings: config.Settings, identity: auth.Identity,
                envelope: wire.Envelope, offer: registry.Offer, runtime: str = "", held: str = "") -> None:
    """Make the key and env in ``envelope`` canonical, and check what this key may load.

    Canonical means the deployment serving the same weights under the same
    ``runtime``, if one does. What a key may load is ``policy.model_policy``."""
    envelope.model_key, envelope.env = model_policy.ModelPolicy.from_settings(settings).admit(
        envelope.model_key, envelope.env, identity.trusted, offer.keys,
        lambda repo_id: offer.refs_of(client, repo_id), runtime=runtime, held=held)
    # A deployment that lists its ``users`` (``deploy -f``) serves only them.
    deployments.check_access(client, identity, envelope.model_key, offer)


def check_probe(client: redis.Redis, settings: config.Settings, identity: auth.Identity,
                headers: Mapping[str, str], model_key: str, offered: set) -> bool:
    """Whether the request is the health probe's (``ndif_celery.monitoring.probes``).

    The probe's key is ``NDIF_PROBE_API_KEY``. Its job takes a turn of its own
    at the front of the line (``turns.plan``'s ``first``). A probe never
    deploys a model. Else a probe sent just as the model was evicted would
    load it again. So it is refused here when the model is not deployed. Its
    owner is recorded (``probes.OWNER``) for the controller. The controller
    fails a probe's job left waiting for an evicted model, rather than load
    the model again."""
    if not settings.probe_api_key:
        return False
    sent = headers.get(auth.HEADER) or ""
    if not hmac.compare_digest(sent.encode(), settings.probe_api_key.encode()):
        return False
    if identity.key_id is not None:
        client.set(probes.OWNER, identity.owner, ex=86400)
    if model_key not in offered:
        raise Refused("The health probe does not deploy models, and this one is not deployed now.", 409)
    return True


def check_session(identity: auth.Identity, session_id: str, owner: Optional[bytes]) -> None:
    """Only the socket's owner may submit jobs that report to it.

    The owner (``owner``) is the key that opened a /subscribe socket, or that
    claimed a Socket.IO socket first."""
    if session_id and owner != identity.owner.encode():
        raise Refused("session_id was not opened by this API key (open /subscribe with the same key).", 403)


def check_payload(blob: Optional[bytes], compress: bool, settings: config.Settings,
                  codec: str = wire.ZSTD) -> bytes:
    """The payload: present and within ``NDIF_MAX_PAYLOAD_BYTES``.

    When declared compressed, it must be a zstd frame with its size. The
    worker decompresses into that size. A 0.5 client's zlib stream declares
    no size: it is inflated here, kept nowhere, and must stay within the
    same limit, so the worker's inflate is bounded."""
    if blob is None:
        raise Refused("Missing file part 'blob' (the serialized request payload).", 400)
    if not blob:
        raise Refused("The 'blob' part is empty: there is no request payload to run.", 400)
    limits.check_payload(len(blob), settings)
    if compress and codec == wire.ZLIB:
        problem = zlib_problem(blob, settings.max_payload_bytes)
        if problem:
            raise Refused(problem, 413 if "over" in problem else 400)
    elif compress:
        problem = zstd_problem(blob)
        if problem:
            raise Refused(problem, 400)
    return blob


_INFLATE_STEP = 1 << 20


def zlib_problem(blob: bytes, limit: int) -> str:
    """Why a payload declared zlib'd is not a whole zlib stream within ``limit`` bytes inflated, or ''."""
    inflater = zlib.decompressobj()
    size, rest = 0, blob
    try:
        while rest:
            size += len(inflater.decompress(rest, _INFLATE_STEP))
            if limit and size > limit:
                return (f"The payload inflates to over {limit} bytes, this server's limit "
                        "(NDIF_MAX_PAYLOAD_BYTES). Save less inside the trace, or pass large inputs by reference.")
            rest = inflater.unconsumed_tail
        size += len(inflater.flush())
    except zlib.error as error:
        return f"The payload is declared zlib-compressed but is not a valid zlib stream ({error})."
    if not inflater.eof:
        return "The payload is declared zlib-compressed but its zlib stream is cut short."
    if limit and size > limit:
        return (f"The payload inflates to over {limit} bytes, this server's limit (NDIF_MAX_PAYLOAD_BYTES). "
                "Save less inside the trace, or pass large inputs by reference.")
    return ""


def zstd_problem(blob: bytes) -> str:
    """Why a payload declared compressed is not a zstd frame, or ''."""
    try:
        params = zstandard.get_frame_parameters(blob)
    except zstandard.ZstdError as error:
        return f"The payload is declared compressed but is not a valid zstd frame ({error})."
    if params.content_size in (0, zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
        return "The payload is declared compressed but its zstd frame has no content size."
    return ""


def park(client: redis.Redis, celery: Celery, job: jobs.Job, blob: bytes, queued: str,
         settings: config.Settings) -> None:
    """Write the job in one round trip. The Celery message goes last.

    The round trip holds the job's state, its QUEUED status and the queue's
    registration. The status text is ``queued``, the first the client sees
    after RECEIVED. Last comes the Celery message (``queues.job_message``),
    moved to its turn. So a worker sees the job only once everything it
    reads is written."""
    queue = queue_for(job.model_key)
    pipe = client.pipeline(transaction=False)
    pipe.set(jobs.payload_key(job.id), blob, ex=settings.job_ttl_s)
    pipe.set(jobs.owner_key(job.id), job.owner, ex=settings.job_ttl_s)
    pipe.set(jobs.message_key(job.id), jobs.dumps(job.to_message()), ex=settings.job_ttl_s)
    byte_quotas.PARKED.add(pipe, job.owner, byte_quotas.records_entry(job.id), byte_quotas.RECORD_BYTES)
    if job.session_id:
        pipe.sadd(jobs.session_jobs_key(job.session_id), job.id)
        pipe.expire(jobs.session_jobs_key(job.session_id), settings.job_ttl_s)
    limits.track(pipe, job)
    pipe.zadd(jobs.OPEN, {job.id: job.received_at})  # until its final status (the beat's reconciler)
    pipe.sadd(registry.QUEUES, queue)
    pipe.hset(registry.QUEUE_MODELS, queue, job.model_key)
    statuses.StatusChannel(client, job, settings.job_ttl_s).send(
        wire.QUEUED, queued, pipe=pipe)
    pipe.lpush(*queues.job_message(celery, job))
    if settings.fair_turns:
        turns.place(pipe, job, queue, settings.job_ttl_s)
    pipe.execute()
