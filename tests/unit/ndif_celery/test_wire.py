"""The wire format the web relies on without a running stack: envelopes
validated with a named problem, repo fields as the client reads them, and
only statuses the client accepts."""

from __future__ import annotations

import json

import pytest

from ndif_celery import wire


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


def test_response_json_refuses_statuses_the_client_would_reject():
    with pytest.raises(ValueError):
        wire.response_json("id", "FINISHED")
    frame = json.loads(wire.response_json("id", wire.RUNNING, "go"))
    assert frame == {"id": "id", "status": "RUNNING", "description": "go", "data": None, "meta": None}
