"""The Flask app factory: the API the nnsight client talks to.

The web validates and enqueues; it never imports torch and never runs user
code. Everything it knows about a job comes from Redis (see
``ndif_celery.state.jobs``) and the result store.
"""

from __future__ import annotations

import os
import socket
from typing import Optional

import redis
from flask import Flask, jsonify
from werkzeug.exceptions import HTTPException

from ndif_celery import config
from ndif_celery.accounts.auth import Authenticator
from ndif_celery.celery_app import make_app
from ndif_celery.errors import Refused
from ndif_celery.state import jobs
from ndif_celery.store import FilesystemStore, open_store
from ndif_celery.store.fs import check_shared

from . import admin, dashboard, dtype_path, model_files, prometheus, results, routes, sio, subscribe, uploads
from .open_sockets import OpenSockets


def refused(error: Refused):
    """The one answer to every refusal (envelope, model policy, version, key,
    limits, ownership, result URLs), before a websocket upgrade too: the
    nnsight client reads ``body["detail"]`` and the status."""
    return jsonify(detail=error.detail), error.status


#: On every answer: a browser never guesses a type, and never sends this farm's URLs (job ids, tokens) elsewhere.
SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin"}
#: On every HTML page (the dashboard, its admin forms): no other site may frame it.
PAGE_HEADERS = {"X-Frame-Options": "DENY", "Content-Security-Policy": "frame-ancestors 'none'"}

#: The pages' templates, beside this file: for the name "ndif_celery.web" Flask would look in the working directory.
TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")


def secure_headers(response):
    """The browser-facing headers (``after_request``): the dashboard's forms post
    as same-origin, so a page of another site must not frame them."""
    response.headers.update(SECURITY_HEADERS)
    if response.mimetype == "text/html":
        response.headers.update(PAGE_HEADERS)
    return response


def create_app(settings: Optional[config.Settings] = None) -> Flask:
    settings = settings or config.load()
    app = Flask("ndif_celery.web", template_folder=TEMPLATES)
    app.config["NDIF_SETTINGS"] = settings
    app.config["NDIF_REDIS"] = jobs.connect(settings.redis_url, settings.redis_outage_s, settings.web_redis_connections)
    app.config["NDIF_CELERY"] = make_app(settings)
    app.config["NDIF_STORE"] = store = open_store(settings)
    if isinstance(store, FilesystemStore):
        # Downloads are served from this host's directory: it must be the workers' (store.fs.check_shared).
        # A client that does not retry: a web booting while Redis is away must not wait out an outage here.
        try:
            check_shared(store, jobs.connect(settings.redis_url), socket.gethostname())
        except (redis.ConnectionError, redis.TimeoutError) as error:
            app.logger.warning("could not check that the result directory is the workers' (Redis away): %s", error)
    app.config["NDIF_AUTH"] = Authenticator(settings)
    app.config["NDIF_UPLOADS"] = uploads.Watcher(settings.web_uploads)
    app.config["NDIF_OPEN_SOCKETS"] = OpenSockets(settings)
    app.json.sort_keys = False
    # Refuse absurd uploads before reading them; the exact check is on the blob.
    app.config["MAX_CONTENT_LENGTH"] = settings.max_payload_bytes + 1024 * 1024 if settings.max_payload_bytes else None

    app.register_blueprint(routes.bp)
    app.register_blueprint(results.bp)
    app.register_blueprint(prometheus.bp)  # /metrics, and every request counted
    app.register_blueprint(dashboard.bp)  # /dashboard
    app.register_blueprint(admin.bp)  # the dashboard's admin actions
    app.register_blueprint(model_files.bp)  # /hub: config and tokenizer files for clients without the hub
    app.config.setdefault("SOCK_SERVER_OPTIONS", subscribe.SERVER_OPTIONS)
    subscribe.sock.init_app(app)
    app.before_request(subscribe.open_socket)
    app.teardown_request(subscribe.close_socket)

    app.register_error_handler(Refused, refused)
    app.after_request(secure_headers)
    # nnsight 0.6/0.7 clients wait on a Socket.IO socket: their job's statuses are relayed there.
    app.wsgi_app = sio.wrap(app, settings.web_worker_class)
    # A quantized deployment is asked for by URL: /dtype/nf4/request is /request for it.
    app.wsgi_app = dtype_path.wrap(app.wsgi_app)

    @app.errorhandler(413)
    def too_large(error):
        return jsonify(
            detail=f"Request too large: this server accepts payloads of at most {settings.max_payload_bytes} "
            "bytes (NDIF_MAX_PAYLOAD_BYTES)."
        ), 413

    @app.errorhandler(HTTPException)
    def http_error(error: HTTPException):
        # The client reads body["detail"] of any failed request.
        return jsonify(detail=error.description or error.name), error.code

    @app.errorhandler(redis.ConnectionError)
    @app.errorhandler(redis.TimeoutError)
    def broker_down(error):
        app.logger.warning("Redis unreachable: %s", error)
        return jsonify(
            detail=f"The job broker (Redis) is unreachable, so this request could not be handled; "
            f"nothing was lost, please retry shortly. ({error})"
        ), 503

    @app.errorhandler(redis.exceptions.OutOfMemoryError)
    def broker_full(error):
        # Its memory bound reached (noeviction: NDIF_EMBEDDED_REDIS_MAX_MEMORY_MB, or the
        # operator's own maxmemory): new writes are refused, nothing queued is dropped.
        app.logger.warning("Redis is full: %s", error)
        return jsonify(
            detail="The job broker (Redis) is at its memory bound (NDIF_EMBEDDED_REDIS_MAX_MEMORY_MB, or its "
            "maxmemory), so this request was not queued; nothing queued was dropped. Retry when jobs have finished."
        ), 503

    @app.errorhandler(Exception)
    def unhandled(error: Exception):
        app.logger.exception("unhandled error")
        return jsonify(detail="Internal server error."), 500

    return app
