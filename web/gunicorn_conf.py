"""gunicorn settings for the web, derived from the ``NDIF_*`` environment.

Threaded workers: each blocking client holds one websocket (one thread) open
for the life of its job, so threads, not processes, are the unit of capacity.
``deploy/gunicorn.conf.py`` re-exports this for operators who run gunicorn
themselves.
"""

from ndif_celery import config as _config

_settings = _config.load()

bind = f"{_settings.api_host}:{_settings.api_port}"
workers = _settings.web_workers
worker_class = "gthread"
threads = _settings.web_threads
# Websockets live as long as their job; gthread's timeout only watches the
# worker's main loop, so it can stay short.
timeout = 120
graceful_timeout = 30
keepalive = 5
accesslog = "-"
errorlog = "-"
loglevel = _settings.log_level.lower()
proc_name = "ndif-celery-web"
