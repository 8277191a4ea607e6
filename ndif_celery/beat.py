"""``ndif-celery beat``: Celery beat (the periodic cleanup), the farm's watchdog and its health probes.

The beat is the one farm process that runs no job, loads no model and imports
no torch, so it is where the watchdog (``ndif_celery.farm.watchdog``) lives: it
must keep looking when every worker is dead. ``celery -A ndif_celery.beat:app
beat`` configures the same app as the workers' (``celery_app.lazy_app``: the
schedule sends the cleanup by name) and starts the watchdog's thread when beat
starts (``beat_init``), only in a beat process, and with ``NDIF_PROBE_INTERVAL_S``
set the health probes' thread (``ndif_celery.monitoring.probes``), and with
``NDIF_LAUNCHER`` set the elastic workers' (``ndif_celery.farm.elastic``), each
leading by a lease of its own.
"""

from __future__ import annotations

from celery.signals import beat_init

from . import config
from .celery_app import lazy_app
from .farm.elastic import Elastic
from .farm.watchdog import FarmWatchdog
from .monitoring.probes import Prober

app = lazy_app()


@beat_init.connect
def _start_watchdog(**_) -> None:
    settings = config.load()
    FarmWatchdog(settings).start()
    if settings.launcher:
        Elastic(settings).start()  # workers from the cluster's scheduler while jobs wait
    if settings.probe_interval_s > 0:
        # The probes' traces run in a child (ndif_celery.monitoring.probe_runner): the beat itself never imports torch.
        Prober(settings).start()
