"""The result store: filesystem backend, its download route, and S3 via moto.

No mocks: files are written to a temp dir, the route runs in a real Flask app,
and S3 is moto's HTTP server in its own process, reached over loopback.
About 400 lines: the same promises checked on both backends, side by side.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

import httpx
import pytest
from flask import Flask

from ndif_celery import config
from ndif_celery.errors import Refused
from ndif_celery.store import FilesystemStore, S3Store, StoreUnavailable, open_store
from tests.servers import MotoServer, free_port
from web.app import refused

ROOT = Path(__file__).resolve().parent.parent
PAYLOAD = bytes(range(256)) * 1000 + b"tail"


# --------------------------------------------------------------- filesystem


@pytest.fixture
def fs_store(tmp_path) -> FilesystemStore:
    return FilesystemStore(tmp_path / "results", "http://api.test:8001/", "s3cr3t", 600)


def _query(url: str) -> dict:
    return dict(parse_qsl(urlsplit(url).query))


def test_filesystem_round_trip(fs_store):
    assert fs_store.put("job-1/result.pt", PAYLOAD) == len(PAYLOAD)
    assert fs_store.get("job-1/result.pt") == PAYLOAD
    assert fs_store.path("job-1/result.pt").read_bytes() == PAYLOAD
    # No temporary files are left next to the result.
    assert os.listdir(fs_store.path("job-1/result.pt").parent) == ["result.pt"]

    url = fs_store.url("job-1/result.pt")
    parts = urlsplit(url)
    assert (parts.scheme, parts.netloc, parts.path) == ("http", "api.test:8001", "/results/job-1/result.pt")
    q = _query(url)
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
    q = _query(fs_store.url("a"))
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


def _path_and_query(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.path}?{parts.query}"


def test_route_serves_signed_url(client, fs_store):
    fs_store.put("job 7/out.bin", PAYLOAD)
    response = client.get(_path_and_query(fs_store.url("job 7/out.bin")))
    assert response.status_code == 200, response.get_json()
    assert response.data == PAYLOAD
    assert response.mimetype == "application/octet-stream"
    assert response.headers["Content-Length"] == str(len(PAYLOAD))


def test_route_rejects_tampered_and_expired(client, fs_store):
    fs_store.put("r", b"data")
    q = _query(fs_store.url("r"))

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
    response = client.get(_path_and_query(url))
    assert response.status_code == 404
    assert response.get_json()["detail"].startswith("No result")

    fs_store.put("gone", b"x")
    url = fs_store.url("gone")
    fs_store.delete("gone")
    response = client.get(_path_and_query(url))
    assert response.status_code == 404


def test_route_with_s3_store_points_elsewhere(fs_store):
    from web.results import bp

    app = Flask("test_results_s3")
    app.config["NDIF_STORE"] = S3Store(
        "http://127.0.0.1:1", "", "a", "b", "bucket", "us-east-1", True, 60
    )
    app.register_blueprint(bp)
    app.register_error_handler(Refused, refused)  # as create_app does: refusals answer {"detail": ...}
    q = _query(fs_store.url("r"))
    response = app.test_client().get(f"/results/r?{urlencode(q)}")
    assert response.status_code == 404
    assert response.get_json()["detail"] == "results are served by the object store"


def test_web_results_does_not_import_torch():
    code = "import sys, web.results; sys.exit('torch' in sys.modules)"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# ----------------------------------------------------------------------- S3


@pytest.fixture(scope="module")
def moto():
    with MotoServer() as server:
        yield server


def _s3(server: MotoServer, bucket: str, public_url: str = "", ttl: int = 300) -> S3Store:
    return S3Store(
        endpoint_url=server.url,
        public_url=public_url,
        access_key=server.access_key,
        secret_key=server.secret_key,
        bucket=bucket,
        region=server.region,
        verify=True,
        url_ttl_s=ttl,
    )


def _sigv4_ok(url: str, secret_key: str, region: str) -> bool:
    """Check a presigned GET URL's SigV4 signature against the host it names.

    moto does not verify presigned signatures, so this recomputes one
    independently of the minio SDK: it proves the URL was signed for the
    host in it rather than signed for one host and rewritten to another.
    """
    parts = urlsplit(url)
    params = parse_qsl(parts.query, keep_blank_values=True)
    given = dict(params)["X-Amz-Signature"]
    canonical_query = "&".join(
        f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}"
        for k, v in sorted(params)
        if k != "X-Amz-Signature"
    )
    canonical_request = "\n".join([
        "GET", parts.path, canonical_query, f"host:{parts.netloc}", "", "host", "UNSIGNED-PAYLOAD",
    ])
    amz_date = dict(params)["X-Amz-Date"]
    scope = f"{amz_date[:8]}/{region}/s3/aws4_request"
    string_to_sign = "\n".join([
        "AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical_request.encode()).hexdigest(),
    ])
    key = ("AWS4" + secret_key).encode()
    for part in (amz_date[:8], region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    expected = hmac.new(key, string_to_sign.encode(), hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, given)


def test_s3_put_get_delete_creates_bucket(moto):
    store = _s3(moto, "auto-created")
    assert store.put("job-1/result.pt", PAYLOAD) == len(PAYLOAD)
    assert store.get("job-1/result.pt") == PAYLOAD
    # The bucket really exists on the server now.
    assert httpx.head(f"{moto.url}/auto-created", trust_env=False).status_code == 200

    store.delete("job-1/result.pt")
    with pytest.raises(FileNotFoundError):
        store.get("job-1/result.pt")
    store.delete("job-1/result.pt")  # deleting twice is fine

    # A second store on the same, now existing, bucket works as well.
    other = _s3(moto, "auto-created")
    other.ping()
    assert other.put("m", memoryview(b"view")) == 4
    assert store.get("m") == b"view"


def test_s3_bucket_created_by_another_store_in_between(moto):
    first, second = _s3(moto, "raced"), _s3(moto, "raced")
    first.ping()
    second.ping()  # exists already: no error
    assert second.put("k", b"1") == 1 and first.get("k") == b"1"


def test_s3_presigned_url_downloads(moto):
    store = _s3(moto, "presign")
    store.put("dir/out.bin", PAYLOAD)
    url = store.url("dir/out.bin")
    parts = urlsplit(url)
    assert f"{parts.scheme}://{parts.netloc}" == moto.url
    assert int(_query(url)["X-Amz-Expires"]) == 300
    assert _sigv4_ok(url, moto.secret_key, moto.region)
    response = httpx.get(url, trust_env=False)
    assert response.status_code == 200
    assert response.content == PAYLOAD


def test_s3_presigned_url_uses_public_host(moto):
    public = f"http://localhost:{moto.port}"
    store = _s3(moto, "public", public_url=public)
    store.put("k", PAYLOAD)
    url = store.url("k")
    assert url.startswith(f"{public}/public/k?")
    assert _sigv4_ok(url, moto.secret_key, moto.region)
    # Rewriting the host of a URL signed for the endpoint is not the same thing.
    internal = _s3(moto, "public").url("k")
    assert not _sigv4_ok(internal.replace(moto.url, public), moto.secret_key, moto.region)
    response = httpx.get(url, trust_env=False)
    assert response.status_code == 200
    assert response.content == PAYLOAD


def test_s3_presign_needs_no_server():
    port = free_port()  # nothing listens here
    store = S3Store(f"http://127.0.0.1:{port}", f"https://files.example:{port}", "ak", "sk",
                    "bucket", "eu-central-1", True, 10**9)
    t0 = time.monotonic()
    url = store.url("a/b")
    assert time.monotonic() - t0 < 1
    assert url.startswith(f"https://files.example:{port}/bucket/a/b?")
    assert "eu-central-1" in _query(url)["X-Amz-Credential"]
    assert int(_query(url)["X-Amz-Expires"]) == 7 * 24 * 3600  # clamped to the S3 limit
    assert _sigv4_ok(url, "sk", "eu-central-1")


@pytest.mark.e2e  # starts a stack in its body
def test_s3_outage_and_recovery():
    with MotoServer() as server:
        store = _s3(server, "outage")
        store.put("before", b"1")
        server.stop()

        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable) as info:
            store.ping()
        assert server.url in str(info.value)
        assert time.monotonic() - t0 < 10  # fails fast, no long retry loop
        with pytest.raises(StoreUnavailable, match=server.url):
            store.put("during", b"2")
        with pytest.raises(StoreUnavailable, match=server.url):
            store.get("before")

        server.start()  # same URL, state lost: the bucket is gone
        store.ping()
        assert store.put("after", b"3") == 1
        assert store.get("after") == b"3"
        assert httpx.get(store.url("after"), trust_env=False).content == b"3"
        with pytest.raises(FileNotFoundError):
            store.get("before")

        # A store that had the bucket ready recreates it on put after a restart.
        server.stop()
        server.start()
        assert store.put("again", b"4") == 1
        assert store.get("again") == b"4"


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
    q = _query(store.url("x"))
    # Another process of the same stack (same NDIF_HOME) accepts the URL.
    again = open_store(config.load({"NDIF_HOME": str(tmp_path)}))
    assert again.verify("x", q["expires"], q["signature"])


def test_open_store_s3(tmp_path, moto):
    settings = config.load({
        "NDIF_HOME": str(tmp_path),
        "NDIF_OBJECT_STORE_URL": moto.url,
        "NDIF_OBJECT_STORE_PUBLIC_URL": f"http://localhost:{moto.port}",
        "NDIF_OBJECT_STORE_ACCESS_KEY": moto.access_key,
        "NDIF_OBJECT_STORE_SECRET_KEY": moto.secret_key,
        "NDIF_OBJECT_STORE_BUCKET": "from-settings",
        "NDIF_RESULT_URL_TTL_S": "120",
    })
    store = open_store(settings)
    assert isinstance(store, S3Store)
    assert (store.endpoint_url, store.bucket, store.url_ttl_s) == (moto.url, "from-settings", 120)
    store.ping()
    store.put("k", b"hello")
    url = store.url("k")
    assert url.startswith(f"http://localhost:{moto.port}/from-settings/k?")
    assert httpx.get(url, trust_env=False).content == b"hello"
