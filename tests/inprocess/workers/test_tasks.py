"""The worker's entry module, without a stack (fast tier).

``celery -A workers.tasks:app`` imports ``workers.tasks`` in the worker, in
beat and in Flower, so importing it must load no settings, edit no
environment and import no torch; the worker sets its environment at
``worker_init``, before torch. Each check runs in a fresh interpreter: this
one has long imported torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.paths import ROOT


def _python(code: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(environ, **env),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_the_entry_module_loads_no_settings_no_environment_no_torch():
    found = _python(
        "import json, os, sys\n"
        "before = dict(os.environ)\n"
        "import workers.tasks as tasks\n"
        "print(json.dumps({'heavy': [m for m in ('torch', 'nnsight', 'transformers', 'workers.worker',\n"
        "                  'workers.isolation.forkserver') if m in sys.modules], 'env_same': dict(os.environ) == before,\n"
        "                  'configured': tasks.app.configured, 'settings': tasks.this_worker.settings is not None}))",
        NDIF_WORKER_GPUS="3", NDIF_TORCH_THREADS="2",
    )
    assert found == {"heavy": [], "env_same": True, "configured": False, "settings": False}


def test_the_app_is_configured_from_the_environment_on_first_use():
    found = _python(
        "import json\n"
        "from workers.tasks import app\n"
        "print(json.dumps({'broker': app.conf.broker_url, 'late': app.conf.task_acks_late,\n"
        "                  'every': app.conf.beat_schedule['ndif-cleanup']['schedule']}))",
        NDIF_REDIS_URL="redis://127.0.0.1:6390/2", NDIF_CLEANUP_INTERVAL_S="77",
    )
    assert found == {"broker": "redis://127.0.0.1:6390/2", "late": True, "every": 77.0}


def test_worker_init_sets_the_environment_before_torch():
    found = _python(
        "import json, os, sys\n"
        "from workers import tasks\n"
        "tasks._on_init(sender=None)\n"
        "print(json.dumps({'gpus': os.environ.get('CUDA_VISIBLE_DEVICES'), 'omp': os.environ.get('OMP_NUM_THREADS'),\n"
        "                  'torch': 'torch' in sys.modules, 'fork_server': tasks.this_worker.fork_server is not None}))",
        NDIF_WORKER_GPUS="3", NDIF_TORCH_THREADS="2", NDIF_ISOLATION="zygote",
    )
    assert found == {"gpus": "3", "omp": "2", "torch": False, "fork_server": False}


def test_torch_threads_setting_reaches_the_workers_torch():
    """NDIF_TORCH_THREADS sets the intra-op threads of the worker's torch (what a
    trusted job in the worker sees): set at ``worker_init``, before torch."""
    found = _python(
        "import json\n"
        "from workers import tasks\n"
        "tasks._on_init(sender=None)\n"
        "import torch\n"
        "print(json.dumps({'threads': torch.get_num_threads()}))",
        NDIF_TORCH_THREADS="1",
    )
    assert found == {"threads": 1}
    import torch

    assert torch.get_num_threads() > 1, "this machine has one core: the test shows nothing"


def test_a_workers_entry_stops_naming_its_job_as_soon_as_the_job_ends(embedded_settings, redis_client):
    """Not at the next heartbeat (``registry.HEARTBEAT_S``): ``/status``, the
    watchdog and ``ndif-celery kill`` read the entry, and for up to a heartbeat
    it would name a job that had ended, and a job lost in delivery could go unnoticed."""
    from ndif_celery.celery_app import make_app
    from ndif_celery.state import registry
    from workers.worker import WorkerState

    worker = WorkerState("w@entry", embedded_settings, make_app(embedded_settings))

    def entry() -> dict:
        return json.loads(redis_client.hget(registry.WORKERS, "w@entry"))

    pipe = redis_client.pipeline()
    worker.slot.begin("a" * 32, pipe)
    pipe.execute()
    assert entry()["current_job"] == "a" * 32
    worker.slot.end()
    assert entry()["current_job"] is None and entry()["batch"] == []
