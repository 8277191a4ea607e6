"""The result store's S3 backend against moto's HTTP server, in its own
process, reached over loopback (no mocks): puts, gets, presigned downloads and
an outage and recovery. The filesystem backend and the route in a Flask app
are tests/inprocess/ndif_celery/store/test_store.py.
"""

from __future__ import annotations

import time
from urllib.parse import urlsplit

import httpx
import pytest

from ndif_celery import config
from ndif_celery.store import S3Store, StoreUnavailable, open_store
from tests.support.stacks.servers import MotoServer
from tests.support.clients.signed_urls import sigv4_ok, url_query

PAYLOAD = bytes(range(256)) * 1000 + b"tail"


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
    assert int(url_query(url)["X-Amz-Expires"]) == 300
    assert sigv4_ok(url, moto.secret_key, moto.region)
    response = httpx.get(url, trust_env=False)
    assert response.status_code == 200
    assert response.content == PAYLOAD


def test_s3_presigned_url_uses_public_host(moto):
    public = f"http://localhost:{moto.port}"
    store = _s3(moto, "public", public_url=public)
    store.put("k", PAYLOAD)
    url = store.url("k")
    assert url.startswith(f"{public}/public/k?")
    assert sigv4_ok(url, moto.secret_key, moto.region)
    # Rewriting the host of a URL signed for the endpoint is not the same thing.
    internal = _s3(moto, "public").url("k")
    assert not sigv4_ok(internal.replace(moto.url, public), moto.secret_key, moto.region)
    response = httpx.get(url, trust_env=False)
    assert response.status_code == 200
    assert response.content == PAYLOAD


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


# ---------------------------------------------------------------- open_store


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
