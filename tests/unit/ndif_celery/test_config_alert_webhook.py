"""``config.check_alert_webhook_url``: the one check of ``NDIF_ALERT_WEBHOOK_URL``
that ``up``, ``doctor`` and the beat make. A bad value is named with what is
wrong, never repeated: a webhook's path and query often hold a token."""

from __future__ import annotations

import pytest

from ndif_celery import config


@pytest.mark.parametrize("url", [
    "", "http://127.0.0.1:9000/hook", "https://hooks.example.org/services/T0/B0/abc?token=x",
    "HTTPS://Hooks.Example.org", "http://user:pass@alerts.internal:8080/a", "http://[::1]:9000/hook",
    "http://alertmanager/api/v2/alerts",
])
def test_an_http_or_https_url_with_a_host_passes(url):
    config.check_alert_webhook_url(url)


@pytest.mark.parametrize("url, problem", [
    ("htp://x/secret-token", "must begin with http:// or https://"),
    ("ftp://files.example.org/secret-token", "must begin with http:// or https://"),
    ("secret-token:1234", "must begin with http:// or https://"),
    ("http://", "names no host"),
    ("http:/secret-token", "names no host"),
    ("http:///secret-token", "names no host"),
    ("http://?secret-token", "names no host"),
    ("not a url", "holds a space"),
    ("http://hooks.example.org/secret-token /x", "holds a space"),
    ("http://hooks.example.org/secret-token\n", "control character"),
    ("http://[::1/secret-token", "is not a URL"),
    ("http://hooks.example.org:99999/secret-token", "is not a URL"),
    ("http://hooks.example.org:port/secret-token", "is not a URL"),
    ("http://hooks.example.org:0/secret-token", "port must be from 1 to 65535"),
    ("http://hooks!example/secret-token", "names no host"),
])
def test_a_malformed_url_is_named_with_what_is_wrong_and_not_repeated(url, problem):
    with pytest.raises(ValueError) as refused:
        config.check_alert_webhook_url(url)
    message = str(refused.value)
    assert message.startswith("NDIF_ALERT_WEBHOOK_URL") and problem in message
    assert "secret-token" not in message and "url" not in message.replace("URL", "")
