"""``GET /metrics`` (Prometheus), and every answered request counted for it.

The series come from Redis (``ndif_celery.monitoring.metrics``). Each answered
request is counted in Redis by :func:`count_request` (after_request), so every
web process and host adds to the same ``ndif_http_requests_total``.

``/metrics`` stays open, like Flower's, for Prometheus. With ``NDIF_AUTH=1``
its per-key series (``ndif_usage_*{key}``) go only to a scraper that shows
``NDIF_METRICS_TOKEN`` or an admin key as a bearer token (``Authorization:
Bearer ...``, which Prometheus sends from its ``authorization`` setting) or in
``ndif-api-key``: anyone else sees the farm's totals.
"""

from __future__ import annotations

import redis
from flask import Blueprint, Response, current_app, request

from ndif_celery.accounts.auth import AuthError
from ndif_celery.monitoring import metrics

from .identity import identify

bp = Blueprint("prometheus", __name__)


# --- request counting ---------------------------------------------------------------


def _counting_client(app) -> redis.Redis:
    """A Redis client that gives up at once: counting a request must never hold
    its answer back (the main client waits out a Redis restart)."""
    client = app.config.get("NDIF_METRICS_REDIS")
    if client is None:
        client = app.config["NDIF_METRICS_REDIS"] = redis.Redis.from_url(
            app.config["NDIF_SETTINGS"].redis_url, socket_timeout=0.5, socket_connect_timeout=0.5,
        )
    return client


@bp.after_app_request
def count_request(response):
    """Counted once the answer has gone out (``call_on_close``), off its path."""
    rule = request.url_rule.rule if request.url_rule is not None else "<unmatched>"
    client, method, status = _counting_client(current_app), request.method, response.status_code

    def count() -> None:
        try:
            metrics.count_request(client, rule, method, status)
        except (redis.RedisError, OSError):
            pass  # Redis away: this request goes uncounted

    response.call_on_close(count)
    return response


# --- /metrics -----------------------------------------------------------------------


@bp.get("/metrics")
def scrape():
    from prometheus_client import CONTENT_TYPE_LATEST

    settings = current_app.config["NDIF_SETTINGS"]
    per_key = not settings.auth or _scraper_may_see_keys(settings)
    client = current_app.config["NDIF_REDIS"]
    return Response(metrics.render(client, settings.usage_top_keys, per_key), content_type=CONTENT_TYPE_LATEST)


def _scraper_may_see_keys(settings) -> bool:
    """Whether the caller showed ``NDIF_METRICS_TOKEN`` or an admin key (bearer or ``ndif-api-key``)."""
    import hmac

    from ndif_celery.accounts.auth import HEADER

    shown = request.headers.get("Authorization", "")
    token = shown[len("Bearer "):].strip() if shown.startswith("Bearer ") else request.headers.get(HEADER, "")
    if not token:
        return False
    if settings.metrics_token and hmac.compare_digest(token.encode(), settings.metrics_token.encode()):
        return True
    try:
        return "admin" in identify(token).tags
    except AuthError:
        return False
