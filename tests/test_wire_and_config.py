"""The pieces the web relies on without a running stack: envelope validation,
queue naming, configuration, and the rule that the web never imports torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ndif_celery import config, wire
from ndif_celery.celery_app import queue_for

ROOT = Path(__file__).resolve().parent.parent
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


def test_every_variable_in_the_code_is_documented():
    code = set(re.findall(r'"(NDIF_[A-Z_]+)"', (ROOT / "ndif_celery" / "config.py").read_text()))
    documented = set(re.findall(r"`(NDIF_[A-Z_]+)`", (ROOT / "docs" / "configuration.md").read_text()))
    assert code, "no variables found in config.py"
    assert code - documented == set(), "undocumented NDIF_* variables"


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
