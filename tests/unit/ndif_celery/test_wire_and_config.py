"""The pieces the web relies on without a running stack: envelope validation,
queue naming, configuration, and the rule that the web never imports torch."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest

from ndif_celery import config, wire
from ndif_celery.celery_app import queue_for
from tests.support.paths import ROOT

KEY = 'nnsight.modeling.transformers.TransformersModel:{"repo_id": "openai-community/gpt2", "revision": null, "task": "text-generation"}'


def test_envelope_round_trip():
    envelope = wire.parse_envelope(
        json.dumps({"model_key": KEY, "session_id": "ab" * 16, "compress": True, "env": {"attn_implementation": "eager"}})
    )
    assert envelope.model_key == KEY and envelope.compress is True
    assert envelope.env == {"attn_implementation": "eager"}


@pytest.mark.parametrize(
    "raw, words",
    [
        ("", "not valid JSON"),
        ("null", "must be a JSON object"),
        (json.dumps({"model_key": 3}), "model_key"),
        (json.dumps({"model_key": KEY, "compress": "yes"}), "'compress'"),
        (json.dumps({"model_key": KEY, "env": []}), "'env'"),
        (json.dumps({"model_key": KEY, "session_id": "../../etc"}), "session_id"),
        (json.dumps({"model_key": "builtins.eval:1+1"}), "Unknown model class 'builtins.eval'"),
        (json.dumps({"model_key": "x" * 5000}), "too long"),
    ],
)
def test_bad_envelopes_name_the_problem(raw, words):
    with pytest.raises(wire.WireError) as caught:
        wire.parse_envelope(raw)
    assert words in caught.value.detail


def test_repo_fields_as_nnsight_status_reads_them():
    assert wire.repo_fields(KEY) == {
        "repo_id": "openai-community/gpt2",
        "revision": None,
        "task": "text-generation",
    }


def test_queue_names_are_readable_stable_and_distinct():
    other = KEY.replace("gpt2", "gpt2-medium")
    assert queue_for(KEY) == queue_for(KEY)
    assert queue_for(KEY) != queue_for(other)
    assert queue_for(KEY).startswith("ndif.model.openai-community-gpt2.")
    assert re.fullmatch(r"[A-Za-z0-9_.-]+", queue_for(KEY))


def test_response_json_refuses_statuses_the_client_would_reject():
    with pytest.raises(ValueError):
        wire.response_json("id", "FINISHED")
    frame = json.loads(wire.response_json("id", wire.RUNNING, "go"))
    assert frame == {"id": "id", "status": "RUNNING", "description": "go", "data": None, "meta": None}


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


def test_the_web_never_imports_torch(tmp_path):
    script = (
        "import sys\n"
        "from ndif_celery import config\n"
        "from web.app import create_app\n"
        f"app = create_app(config.load({{'NDIF_HOME': {str(tmp_path)!r}}}))\n"
        "assert app.url_map is not None\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'nnsight') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
