"""A filesystem result store is one directory shared by every web and worker host.

On two hosts without a shared mount a worker wrote each result into its own
``NDIF_RESULTS_DIR`` and the web looked in another: the client's download URL
404'd after a COMPLETED. Each web and worker process now compares its
directory's marker with the one the farm recorded in Redis, and a different
directory is refused with what to do instead (``store_fs.check_shared``).
Fast tier: real directories, a real embedded Redis, the real app factory.
"""

from __future__ import annotations

import threading

import pytest

from ndif_celery import config
from ndif_celery.store.fs import MARKER, SHARED_KEY, FilesystemStore, NotShared, check_shared


def _store(path) -> FilesystemStore:
    return FilesystemStore(path, "http://web:8001", "secret", 60)


def test_processes_on_the_shared_directory_agree_and_another_directory_is_refused(tmp_path, redis_client):
    shared = tmp_path / "shared"
    ids = []
    threads = [threading.Thread(target=lambda: ids.append(check_shared(_store(shared), redis_client, "h")))
               for _ in range(8)]  # a web's processes and a worker, starting together
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(ids) == 8 and len(set(ids)) == 1 and (shared / MARKER).read_text() == ids[0]
    assert redis_client.get(SHARED_KEY).decode() == ids[0]

    with pytest.raises(NotShared) as refused:
        check_shared(_store(tmp_path / "other-host"), redis_client, "gpu-host-2")
    message = str(refused.value)
    assert "gpu-host-2" in message and "NDIF_OBJECT_STORE_URL" in message and "MinIO" in message
    assert check_shared(_store(shared), redis_client, "h") == ids[0]  # the farm's own directory still is


def test_the_web_refuses_to_start_on_a_directory_the_workers_do_not_use(tmp_path, embedded_settings, redis_client):
    from web.app import create_app

    check_shared(_store(tmp_path / "workers-dir"), redis_client, "gpu-host")
    env = {"NDIF_REDIS_URL": embedded_settings.redis_url, "NDIF_HOME": str(tmp_path / "web-home"),
           "NDIF_RESULTS_DIR": str(tmp_path / "web-dir"), "NDIF_DATABASE_URL": f"sqlite:///{tmp_path}/web.db"}
    with pytest.raises(NotShared, match="not the result directory the farm's other hosts use"):
        create_app(config.load(env))
    env["NDIF_RESULTS_DIR"] = str(tmp_path / "workers-dir")
    assert create_app(config.load(env)).config["NDIF_STORE"].root == (tmp_path / "workers-dir")
