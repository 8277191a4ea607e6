"""``ndif-celery beat``: Celery beat (the periodic cleanup) plus the farm's watchdog.

The beat is the one farm process that runs no job, loads no model and imports
no torch, so it is where the watchdog (``ndif_celery.watchdog``) lives: it
must keep looking when every worker is dead. ``celery -A ndif_celery.beat:app
beat`` configures the same app as the workers' (``celery_app.lazy_app``: the
schedule sends the cleanup by name) and starts the watchdog's thread when beat
starts (``beat_init``), only in a beat process.
"""

from __future__ import annotations

from celery.signals import beat_init

from . import config
from .celery_app import lazy_app
from .watchdog import Watchdog

app = lazy_app()


@beat_init.connect
def _start_watchdog(**_) -> None:
    Watchdog(config.load()).start()
