"""Configuration: defaults and named errors, exactly the ``VARIABLES`` table
read, docs/configuration.md true to it both ways, and
``check_alert_webhook_url``, the one check of ``NDIF_ALERT_WEBHOOK_URL`` that
``up``, ``doctor`` and the beat make (a bad value is named with what is wrong,
never repeated: a webhook's path and query often hold a token)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from ndif_celery import config
from tests.support.paths import ROOT


def documented_rows() -> dict:
    """docs/configuration.md's table rows: ``{name: default cell}``, each name
    once, each inside a table (a row after prose renders as a paragraph)."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    lines = text.splitlines()
    stray = [line[:40] for before, line in zip(lines, lines[1:]) if line.startswith("| `NDIF_") and not before.startswith("|")]
    assert not stray, f"rows outside a table: {stray}"
    rows = re.findall(r"^\| `(NDIF_[A-Z0-9_]+)` \| (.+?) \| .+ \|$", text, flags=re.MULTILINE)
    names = [name for name, _ in rows]
    assert len(names) == len(set(names)), f"documented twice: {sorted({n for n in names if names.count(n) > 1})}"
    return dict(rows)


def test_config_defaults_and_errors(tmp_path):
    settings = config.load({"NDIF_HOME": str(tmp_path)})
    assert settings.api_port == 8001 and settings.embedded_redis
    assert settings.redis_url == "redis://127.0.0.1:6380/0"
    assert settings.max_inline_bytes == 4 * 1024 * 1024
    assert not settings.uses_s3
    # The generated secret is kept, so every process of the stack agrees.
    assert config.load({"NDIF_HOME": str(tmp_path)}).secret_key == settings.secret_key
    with pytest.raises(ValueError, match="NDIF_API_PORT must be an integer"):
        config.load({"NDIF_HOME": str(tmp_path), "NDIF_API_PORT": "eighty"})
    with pytest.raises(ValueError, match="NDIF_OBJECT_STORE_VERIFY"):
        config.load({"NDIF_HOME": str(tmp_path), "NDIF_OBJECT_STORE_VERIFY": "maybe"})
    # A socket lease shorter than two renewals would drop live sockets' counts.
    with pytest.raises(ValueError, match="NDIF_SOCKET_LEASE_S must be at least 10"):
        config.load({"NDIF_HOME": str(tmp_path), "NDIF_SOCKET_LEASE_S": "5"})
    assert config.load({"NDIF_HOME": str(tmp_path)}).socket_lease_s == 30.0


def test_the_docs_table_is_config_variables_both_ways():
    """config.VARIABLES is the one declaration of each setting; the docs' rows
    are hand-written (paragraphs with links) and held to it: the same names,
    and each default cell saying the table's default."""
    table = {var.name: var for var in config.VARIABLES}
    assert len(table) == len(config.VARIABLES), "a variable declared twice in config.VARIABLES"
    assert len({var.attr for var in config.VARIABLES}) == len(config.VARIABLES), "an attribute declared twice"
    rows = documented_rows()
    assert set(table) - set(rows) == set(), "in config.VARIABLES, not in docs/configuration.md"
    assert set(rows) - set(table) == set(), "in docs/configuration.md, not in config.VARIABLES"
    for name, cell in rows.items():
        var = table[name]
        assert var.doc and "\n" not in var.doc, f"{name}: a one-line doc in config.VARIABLES"
        if var.shown is not None:
            assert cell.startswith(var.shown), f"{name}: the docs' default should begin {var.shown!r}, is {cell!r}"
        elif callable(var.default):
            raise AssertionError(f"{name}: a derived default needs `shown`, how the docs say it")
        elif var.default == "":
            assert cell.startswith(("unset", "empty", "(empty")), f"{name}: the docs' default should say unset/empty, is {cell!r}"
        else:
            written = re.match(r"`([^`]*)`", cell)
            assert written, f"{name}: the docs' default should begin with the value in backticks, is {cell!r}"
            assert var.parse(name, written.group(1)) == var.parse(name, str(var.default)), (
                f"{name}: the docs say {written.group(1)!r}, config.VARIABLES {var.default!r}")
        if var.auth_on is not None:
            assert f"auth on: `{var.auth_on}`" in cell, f"{name}: the docs' default should say auth on: `{var.auth_on}`"
    assert set(config.AUTH_ON_DEFAULTS) == {name for name, cell in rows.items() if "auth on:" in cell}


def test_load_reads_exactly_the_table(tmp_path):
    """load() asks the environment for the table's variables and no other,
    and a Settings has an attribute per row (plus the derived embedded_redis)."""
    seen = set()

    class Recorder(dict):
        def get(self, key, default=None):
            seen.add(key)
            return super().get(key, default)

    settings = config.load(Recorder(NDIF_HOME=str(tmp_path)))
    assert seen == {var.name for var in config.VARIABLES}
    assert {f.name for f in dataclasses.fields(settings)} == {var.attr for var in config.VARIABLES} | {"embedded_redis"}


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
