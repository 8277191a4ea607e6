"""The worker's own job function in the test process, for the modules that run
jobs through it (``models/test_resident.py``, ``job/test_gather.py``,
``job/test_deliveries.py``, ``job/test_life.py``, ``test_worker.py``,
``test_execute.py``): a ``WorkerState`` on the tiny model, the real intake
(Flask's test client), a real embedded Redis and the filesystem store; no
Celery worker, no gunicorn. Each module gets its own (module scope, as the
embedded Redis); the jobs they post and read back: ``tests/support/cases/worker_jobs.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from ndif_celery.celery_app import make_app
from tests.support.cases.tiny_model import REPO_ID, client_model
from tests.support.cases.worker_jobs import CHECK_EVERY, PROMPT


@pytest.fixture(scope="module")
def settings(embedded_settings):
    # Co-batching off: each job runs alone, so the chain is what runs the waiting
    # ones (a co-batch's hand-over is tested end to end, tests/e2e/sharing/test_cobatch_e2e.py).
    return dataclasses.replace(embedded_settings, models="*", trusted_check_every=CHECK_EVERY, cobatch_max=1)


@pytest.fixture(scope="module")
def client_lm():
    return client_model(REPO_ID)


@pytest.fixture(scope="module")
def worker(settings):
    from workers.worker import WorkerState

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NDIF_MODELS", "*")  # what the worker's own load (and reload) reads
        state = WorkerState("w@pipeline", settings, make_app(settings))
        state.models.load(client_model(REPO_ID).to_model_key())
        yield state


@pytest.fixture(scope="module")
def web(settings):
    from web.app import create_app

    return create_app(settings).test_client()


@pytest.fixture
def redis(redis_client, worker):
    """An empty Redis; the worker's model pristine (a test may leave it written)."""
    worker.models.restore_if_changed(client_model(REPO_ID).to_model_key())
    return redis_client


@pytest.fixture(scope="module")
def reference(client_lm):
    """The logits of the pristine model, run locally."""
    with client_lm.trace(PROMPT):
        out = client_lm.lm_head.output.save()
    return out
