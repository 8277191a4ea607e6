"""The result store: the filesystem backend, its download route, and what the
S3 backend does without a server (presigning, refusing bad endpoints).

No mocks: files are written to a temp dir and the route runs in a real Flask
app. S3 against moto's server is tests/e2e/store/test_store.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from urllib.parse import urlencode, urlsplit

import pytest
from flask import Flask

from ndif_celery import config
from ndif_celery.errors import Refused
from ndif_celery.store import FilesystemStore, S3Store, StoreUnavailable, open_store
from tests.support.paths import ROOT
from tests.support.stacks.servers import free_port
from tests.support.clients.signed_urls import sigv4_ok, url_query
from web.app import refused

PAYLOAD = bytes(range(256)) * 1000 + b"tail"


# --------------------------------------------------------------- filesystem


@pytest.fixture
def fs_store(tmp_path) -> FilesystemStore:
    return FilesystemStore(tmp_path / "results", "http://api.test:8001/", "s3cr3t", 600)


def test_filesystem_round_trip(fs_store):
    assert fs_store.put("job-1/result.pt", PAYLOAD) == len(PAYLOAD)
    assert fs_store.get("job-1/result.pt") == PAYLOAD
    assert fs_store.path("job-1/result.pt").read_bytes() == PAYLOAD
    # No temporary files are left next to the result.
    assert os.listdir(fs_store.path("job-1/result.pt").parent) == ["result.pt"]

    url = fs_store.url("job-1/result.pt")
    parts = urlsplit(url)
    assert (parts.scheme, parts.netloc, parts.path) == ("http", "api.test:8001", "/results/job-1/result.pt")
    q = url_query(url)
    assert int(q["expires"]) - time.time() == pytest.approx(600, abs=5)
    assert fs_store.verify("job-1/result.pt", q["expires"], q["signature"])

    fs_store.delete("job-1/result.pt")
    with pytest.raises(FileNotFoundError):
        fs_store.get("job-1/result.pt")
    fs_store.delete("job-1/result.pt")  # deleting twice is fine


def test_filesystem_put_memoryview_and_overwrite(fs_store):
    import array

    words = array.array("I", range(1000))  # itemsize 4: size must count bytes
    assert fs_store.put("k", memoryview(words)) == 4000
    assert fs_store.get("k") == words.tobytes()
    assert fs_store.put("k", b"new") == 3
    assert fs_store.get("k") == b"new"


def test_filesystem_rejects_tampering_and_expiry(fs_store):
    fs_store.put("a", b"x")
    q = url_query(fs_store.url("a"))
    exp, sig = q["expires"], q["signature"]
    assert fs_store.verify("a", exp, sig)
    flipped = ("0" if sig[0] != "0" else "1") + sig[1:]
    assert not fs_store.verify("a", exp, flipped)
    assert not fs_store.verify("b", exp, sig)  # signature is bound to the key
    assert not fs_store.verify("a", str(int(exp) + 1000), sig)  # ...and to the expiry
    assert not fs_store.verify("a", "soon", sig)
    assert not fs_store.verify("a", exp, "")
    assert not fs_store.verify("a", exp, "é" * 64)
    assert not fs_store.verify("a", None, None)
    # Another secret signs differently.
    other = FilesystemStore(fs_store.root, fs_store.base_url, "other", 600)
    assert not other.verify("a", exp, sig)

    past = int(time.time()) - 10
    good_but_old = fs_store.sign("a", past)
    assert fs_store.signature_valid("a", past, good_but_old)
    assert not fs_store.verify("a", past, good_but_old)


@pytest.mark.parametrize(
    "key",
    ["", "/etc/passwd", "../x", "a/../../x", "a/..", "..", ".", "a//b", "a/", "a\\b",
     "..\\x", ".hidden", "a/.tmp-123", "a\nb", "a\x00b"],
)
def test_filesystem_rejects_unsafe_keys(fs_store, key):
    with pytest.raises(ValueError):
        fs_store.path(key)
    with pytest.raises(ValueError):
        fs_store.put(key, b"x")
    with pytest.raises(ValueError):
        fs_store.url(key)


def test_filesystem_rejects_symlink_out_of_root(fs_store, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"nope")
    fs_store.root.mkdir(parents=True)
    (fs_store.root / "link").symlink_to(outside)
    with pytest.raises(ValueError):
        fs_store.get("link/secret")


def test_filesystem_ping(tmp_path):
    FilesystemStore(tmp_path / "new" / "dir", "http://x", "k", 1).ping()
    assert (tmp_path / "new" / "dir").is_dir()
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(StoreUnavailable, match=str(blocker)):
        FilesystemStore(blocker / "sub", "http://x", "k", 1).ping()


# ------------------------------------------------------------ download route


@pytest.fixture
def client(fs_store):
    from web.results import bp

    app = Flask("test_results")
    app.config["NDIF_STORE"] = fs_store
    app.register_blueprint(bp)
    app.register_error_handler(Refused, refused)  # as create_app does: refusals answer {"detail": ...}
    return app.test_client()


def _path_andurl_query(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.path}?{parts.query}"


def test_route_serves_signed_url(client, fs_store):
    fs_store.put("job 7/out.bin", PAYLOAD)
    response = client.get(_path_andurl_query(fs_store.url("job 7/out.bin")))
    assert response.status_code == 200, response.get_json()
    assert response.data == PAYLOAD
    assert response.mimetype == "application/octet-stream"
    assert response.headers["Content-Length"] == str(len(PAYLOAD))


def test_route_rejects_tampered_and_expired(client, fs_store):
    fs_store.put("r", b"data")
    q = url_query(fs_store.url("r"))

    tampered = dict(q, signature=q["signature"][::-1])
    response = client.get(f"/results/r?{urlencode(tampered)}")
    assert response.status_code == 403
    assert "invalid" in response.get_json()["detail"]

    # A valid signature for another key does not open this one.
    fs_store.put("s", b"other")
    response = client.get(f"/results/s?{urlencode(q)}")
    assert response.status_code == 403
    assert "invalid" in response.get_json()["detail"]

    past = int(time.time()) - 5
    expired = {"expires": past, "signature": fs_store.sign("r", past)}
    response = client.get(f"/results/r?{urlencode(expired)}")
    assert response.status_code == 403
    assert "expired" in response.get_json()["detail"]

    for args in ({}, {"expires": q["expires"]}, {"signature": q["signature"]}):
        response = client.get(f"/results/r?{urlencode(args)}")
        assert response.status_code == 403
        assert "missing" in response.get_json()["detail"]


def test_route_missing_result_is_404(client, fs_store):
    url = fs_store.url("never/stored")
    response = client.get(_path_andurl_query(url))
    assert response.status_code == 404
    assert response.get_json()["detail"].startswith("No result")

    fs_store.put("gone", b"x")
    url = fs_store.url("gone")
    fs_store.delete("gone")
    response = client.get(_path_andurl_query(url))
    assert response.status_code == 404


def test_route_with_s3_store_points_elsewhere(fs_store):
    from web.results import bp

    app = Flask("test_results_s3")
    app.config["NDIF_STORE"] = S3Store(
        "http://127.0.0.1:1", "", "a", "b", "bucket", "us-east-1", True, 60
    )
    app.register_blueprint(bp)
    app.register_error_handler(Refused, refused)  # as create_app does: refusals answer {"detail": ...}
    q = url_query(fs_store.url("r"))
    response = app.test_client().get(f"/results/r?{urlencode(q)}")
    assert response.status_code == 404
    assert response.get_json()["detail"] == "results are served by the object store"


def test_web_results_does_not_import_torch():
    code = "import sys, web.results; sys.exit('torch' in sys.modules)"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# ----------------------------------------------------------------------- S3


def test_s3_presign_needs_no_server():
    port = free_port()  # nothing listens here
    store = S3Store(f"http://127.0.0.1:{port}", f"https://files.example:{port}", "ak", "sk",
                    "bucket", "eu-central-1", True, 10**9)
    t0 = time.monotonic()
    url = store.url("a/b")
    assert time.monotonic() - t0 < 1
    assert url.startswith(f"https://files.example:{port}/bucket/a/b?")
    assert "eu-central-1" in url_query(url)["X-Amz-Credential"]
    assert int(url_query(url)["X-Amz-Expires"]) == 7 * 24 * 3600  # clamped to the S3 limit
    assert sigv4_ok(url, "sk", "eu-central-1")


def test_s3_rejects_bad_endpoints_and_keys():
    with pytest.raises(ValueError):
        S3Store("127.0.0.1:9000", "", "a", "b", "x", "us-east-1", True, 1)
    with pytest.raises(ValueError):
        S3Store("http://127.0.0.1:9000/prefix", "", "a", "b", "x", "us-east-1", True, 1)
    store = S3Store("http://127.0.0.1:9000", "", "a", "b", "x", "us-east-1", True, 1)
    with pytest.raises(ValueError):
        store.url("../x")


# ---------------------------------------------------------------- open_store


def test_open_store_filesystem(tmp_path):
    settings = config.load({"NDIF_HOME": str(tmp_path), "NDIF_API_URL": "http://api.test:9/"})
    store = open_store(settings)
    assert isinstance(store, FilesystemStore)
    assert store.root == tmp_path.resolve() / "results"
    assert store.base_url == "http://api.test:9"
    assert store.url_ttl_s == settings.result_url_ttl_s
    store.ping()
    store.put("x", b"1")
    q = url_query(store.url("x"))
    # Another process of the same stack (same NDIF_HOME) accepts the URL.
    again = open_store(config.load({"NDIF_HOME": str(tmp_path)}))
    assert again.verify("x", q["expires"], q["signature"])


# --------------------------------------------------------------- bytes kept per key


def test_a_keys_stored_bytes_are_reserved_then_given_back_by_the_sweep(fs_store, redis_client):
    """What ``deliver`` and the expiry sweep do with a key's quota, against a
    real Redis and store: over the quota nothing is counted, and the sweep that
    deletes a result gives its bytes back; another key's count is its own."""
    from ndif_celery.state import expiry, jobs
    from ndif_celery.state.byte_quotas import RESULTS

    try:
        assert RESULTS.reserve(redis_client, "key:1", "job-a", 600, quota=1000) is None
        assert RESULTS.reserve(redis_client, "key:1", "job-b", 600, quota=1000) == 600  # would make 1200
        assert RESULTS.reserve(redis_client, "key:2", "job-c", 900, quota=1000) is None
        assert (RESULTS.used(redis_client, "key:1"), RESULTS.used(redis_client, "key:2")) == (600, 900)
        fs_store.put(jobs.result_key("job-a"), b"x" * 600)
        redis_client.zadd(jobs.ENDED, {"job-a": time.time() - 100})
        assert expiry.sweep(redis_client, fs_store, ttl_s=10)["jobs"] == 1
        assert (RESULTS.used(redis_client, "key:1"), RESULTS.used(redis_client, "key:2")) == (0, 900)
        assert RESULTS.reserve(redis_client, "key:1", "job-b", 600, quota=1000) is None
        RESULTS.release(redis_client, ["job-b", "job-b", "never-counted"])  # an upload failed: once
        assert RESULTS.used(redis_client, "key:1") == 0
    finally:
        redis_client.delete(RESULTS.totals, RESULTS.sizes, jobs.ENDED, expiry.EXPIRED)
