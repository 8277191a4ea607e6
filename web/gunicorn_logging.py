"""gunicorn's logger for the web: repeated records bounded in every web process.

gunicorn builds its logger in the master before it forks the workers, so the
limit installed here (``ndif_celery.log_limits``) is in every web process, on
gunicorn's loggers and on those of the app and its libraries (engine.io logs
a traceback per malformed Socket.IO packet). Named by ``logger_class`` in
``web/gunicorn_conf.py``, so an operator's own gunicorn gets it too.
"""

from __future__ import annotations

from gunicorn import glogging

from ndif_celery import config, log_limits


class Logger(glogging.Logger):
    """gunicorn's own, plus the farm's limit on repeated records."""

    def setup(self, cfg) -> None:
        super().setup(cfg)
        settings = config.load()
        log_limits.install(settings.log_repeats, settings.log_repeat_window_s)
