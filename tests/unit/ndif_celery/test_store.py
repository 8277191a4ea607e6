"""The store package's face (``ndif_celery/store/__init__.py``): a backend's
module loads only when it is opened or named, so a filesystem farm never loads
the S3 client. Each backend itself is tests/inprocess/ndif_celery/store/."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.support.paths import ROOT

LOADED = "import sys; print(sorted(m for m in sys.modules if m.startswith(('ndif_celery.store', 'minio'))))"


def loaded_after(code: str) -> list:
    """The store and S3 client modules a fresh interpreter holds after ``code``."""
    result = subprocess.run([sys.executable, "-c", f"{code}\n{LOADED}"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, check=True)
    return ast.literal_eval(result.stdout)


def test_importing_the_package_loads_no_backend():
    assert loaded_after("import ndif_celery.store") == ["ndif_celery.store", "ndif_celery.store.base"]


def test_a_backend_loads_when_named():
    assert loaded_after("from ndif_celery.store import FilesystemStore") == [
        "ndif_celery.store", "ndif_celery.store.base", "ndif_celery.store.fs"]
    assert "minio" in loaded_after("from ndif_celery.store import S3Store")


def test_the_public_face_is_whole():
    from ndif_celery import store

    for name in store.__all__:
        assert getattr(store, name) is not None, name
    assert set(store.Store.__args__) == {store.FilesystemStore, store.S3Store}
