"""Request bodies' places and schedule, in-process (fast tier): the real Flask
app (Flask's test client) against a real embedded Redis, and ``web.uploads``
called directly.

A web process reads NDIF_WEB_UPLOADS bodies at once. One client address holds
at most NDIF_UPLOADS_PER_ADDRESS of them (an IPv6 client by its /64), one key
at most NDIF_WEB_UPLOADS_PER_KEY, and a body that sends nothing is cut after
NDIF_UPLOAD_FIRST_BYTE_S. The attacks on a real stack, by raw sockets:
tests/e2e/api/test_upload_slots.py.
"""

from __future__ import annotations

import io
import json

import pytest

from ndif_celery import config
from ndif_celery.accounts import db
from tests.support.cases.tiny_model import REPO_ID, client_model

MODEL_KEY = client_model(REPO_ID).to_model_key()


@pytest.fixture(scope="module")
def settings(embedded_settings):
    return embedded_settings


@pytest.fixture(scope="module")
def app(settings):
    from web.app import create_app

    return create_app(settings)


@pytest.fixture(scope="module")
def auth_app(settings, tmp_path_factory):
    """The same web with auth on (its defaults), keys in a SQLite database of its own."""
    from web.app import create_app

    home = tmp_path_factory.mktemp("auth_on")
    on = config.load({"NDIF_HOME": str(home), "NDIF_REDIS_URL": settings.redis_url, "NDIF_AUTH": "1",
                      "NDIF_DATABASE_URL": f"sqlite:///{home / 'keys.db'}", "NDIF_AUTH_CACHE_S": "0"})
    return create_app(on)


def submit(app, address: str = "127.0.0.1", key: str | None = None):
    envelope = json.dumps({"model_key": MODEL_KEY, "session_id": "", "compress": False, "env": {}})
    return app.test_client().post(
        "/request", data={"data": envelope, "blob": (io.BytesIO(b"a payload"), "request")},
        headers={"ndif-api-key": key} if key else {}, environ_base={"REMOTE_ADDR": address})


def held(app, count: int, address: str, owner: str | None = None) -> list:
    """``count`` bodies being read for ``address`` (and ``owner``), as a slow client's would be."""
    from web.uploads import Upload

    watcher = app.config["NDIF_UPLOADS"]
    uploads = [Upload(io.BytesIO(), 1, app.config["NDIF_SETTINGS"], None, address=address, owner=owner)
               for _ in range(count)]
    for upload in uploads:
        watcher.add(upload)
    return uploads


def let_go(app, uploads: list) -> None:
    for upload in uploads:
        app.config["NDIF_UPLOADS"].discard(upload)


# --- who counts as one address ---------------------------------------------------------------------


def test_an_address_counts_as_itself_and_an_ipv6_one_by_its_64():
    from web.identity import client_network

    assert client_network("192.0.2.7") == "192.0.2.7"
    assert client_network("2001:db8:1:2:aaaa::1") == client_network("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert client_network("2001:db8:1:3::1") != client_network("2001:db8:1:2::1")
    assert client_network("::ffff:192.0.2.7") == "192.0.2.7"  # an IPv4 client of a dual-stack socket
    assert client_network(None) == client_network("") == ""  # a UNIX socket: one party


# --- the schedule ------------------------------------------------------------------------------------


def test_a_body_that_has_not_begun_is_late_after_the_first_byte_deadline(settings):
    from web.uploads import Upload

    assert (settings.upload_first_byte_s, settings.upload_grace_s) == (2.0, 10.0), "the defaults"
    upload = Upload(io.BytesIO(), 100_000, settings, None)
    upload.started = 0.0
    assert upload.late(1.9) is None
    reason = upload.late(2.1)
    assert reason and "did not begin" in reason and "within 2 s (NDIF_UPLOAD_FIRST_BYTE_S)" in reason, reason
    upload.received = 1  # begun: the rate's grace applies, and after it the rate
    assert upload.late(9.9) is None
    reason = upload.late(10.5)
    assert reason and "NDIF_UPLOAD_MIN_BYTES_PER_S" in reason, reason
    empty = Upload(io.BytesIO(), 0, settings, None)  # nothing to send: never late
    empty.started = 0.0
    assert empty.late(60.0) is None


def test_the_first_read_asks_for_one_byte_so_it_returns_once_the_body_begins(settings):
    """gunicorn's body read waits until the size asked for is in: a first read
    of 64 KiB would see a slow but begun body as not begun."""
    from web.uploads import Upload

    class Recording(io.BytesIO):
        asked: list = []

        def read(self, size=-1):
            self.asked.append(size)
            return super().read(size)

    stream = Recording(b"x" * 100)
    upload = Upload(stream, 100, settings, None)
    assert upload.read(65536) == b"x" and upload.received == 1  # a short read, as a raw stream may give
    assert upload.read(65536) == b"x" * 99 and stream.asked == [1, 65536]
    whole = Upload(io.BytesIO(b"y" * 100), 100, settings, None)
    assert whole.read() == b"y" * 100  # read() with no size still reads it all


def test_a_late_body_is_refused_408_with_the_sentence_naming_the_setting(settings):
    from web.uploads import Upload, UploadTooSlow

    upload = Upload(io.BytesIO(b"never read"), 10, settings, None)
    upload.started -= settings.upload_first_byte_s + 0.5
    with pytest.raises(UploadTooSlow) as cut:
        upload.read(10)
    assert cut.value.status == 408 and "NDIF_UPLOAD_FIRST_BYTE_S" in cut.value.detail


# --- shares of a process's places --------------------------------------------------------------------


def test_one_address_holds_at_most_its_share_of_a_web_process_and_others_still_get_in(app, redis_client, settings):
    """NDIF_UPLOADS_PER_ADDRESS bodies from one address: its next is refused
    429 from its headers, nothing queued; another address is served."""
    share = settings.uploads_per_address
    assert share == 8, "the default"
    hog = held(app, share, "127.0.0.2")
    try:
        before = redis_client.dbsize()
        refused = submit(app, "127.0.0.2")
        assert refused.status_code == 429, refused.get_json()
        assert f"at most {share} request bodies per web process (NDIF_UPLOADS_PER_ADDRESS)" in refused.get_json()["detail"]
        assert redis_client.dbsize() == before
        assert submit(app, "127.0.0.1").status_code == 200
    finally:
        let_go(app, hog)
    assert submit(app, "127.0.0.2").status_code == 200


def test_an_ipv6_host_holds_one_share_whatever_addresses_of_its_64_it_uses(app):
    hog = held(app, app.config["NDIF_SETTINGS"].uploads_per_address, "2001:db8:0:7::/64")
    try:
        response = submit(app, "2001:db8:0:7:1234::42")
        assert response.status_code == 429 and "NDIF_UPLOADS_PER_ADDRESS" in response.get_json()["detail"]
        assert submit(app, "2001:db8:0:8::1").status_code == 200
    finally:
        let_go(app, hog)


def test_a_place_is_freed_once_and_only_once(app):
    watcher = app.config["NDIF_UPLOADS"]
    (upload,) = held(app, 1, "192.0.2.9", owner="key:1")
    watcher.discard(upload)
    watcher.discard(upload)  # a second discard of the same body frees nothing more
    assert (len(watcher.reading), dict(watcher.by_address), dict(watcher.by_owner)) == (0, {}, {})


def test_filling_a_process_takes_as_many_addresses_as_its_places_over_the_share(settings):
    """The bound in numbers: 64 places, 8 per address, so 8 addresses fill
    a process and a ninth gets 503; 7 leave 8 places to everyone else."""
    from ndif_celery.errors import Refused
    from web.uploads import Upload, Watcher

    watcher = Watcher(settings.web_uploads)
    share = settings.uploads_per_address
    admitted = refused = 0
    for attacker in range(settings.web_uploads // share - 1):
        for _ in range(share + 5):
            try:
                watcher.add(Upload(io.BytesIO(), 1, settings, None, address=f"10.0.0.{attacker}"), per_address=share)
                admitted += 1
            except Refused as error:
                assert error.status == 429
                refused += 1
    assert (admitted, settings.web_uploads - len(watcher.reading)) == (56, 8), "seven addresses leave a share free"
    for victim in range(share):
        watcher.add(Upload(io.BytesIO(), 1, settings, None, address="10.0.1.1"), per_address=share)
    with pytest.raises(Refused) as full:
        watcher.add(Upload(io.BytesIO(), 1, settings, None, address="10.0.1.2"), per_address=share)
    assert full.value.status == 503


def test_with_auth_on_one_key_holds_at_most_its_share_of_a_process_from_any_addresses(auth_app, redis_client):
    """NDIF_WEB_UPLOADS_PER_KEY (auth on: 8) bodies of one key, from eight
    addresses: the key's next is refused 429 from yet another address, and
    another key from that address is served."""
    on = auth_app.config["NDIF_SETTINGS"]
    assert (on.web_uploads_per_key, on.uploads_per_key) == (8, 16), "the auth-on defaults"
    engine = db.engine_for(on.database_url)
    greedy, other = db.create_key(engine, "greedy@example.org", ("trusted",)), db.create_key(engine, "other@example.org", ("trusted",))
    owner = auth_app.config["NDIF_AUTH"].identify(greedy, "127.0.0.1").owner
    hog = [upload for n in range(on.web_uploads_per_key) for upload in held(auth_app, 1, f"127.0.1.{n}", owner)]
    try:
        refused = submit(auth_app, "127.0.2.1", key=greedy)
        assert refused.status_code == 429, refused.get_json()
        assert "already sending 8 request bodies to this web process (NDIF_WEB_UPLOADS_PER_KEY)" in refused.get_json()["detail"]
        assert submit(auth_app, "127.0.2.1", key=other).status_code == 200
    finally:
        let_go(auth_app, hog)
    assert submit(auth_app, "127.0.2.1", key=greedy).status_code == 200
