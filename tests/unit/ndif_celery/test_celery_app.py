"""Per-model queue names: readable, stable and distinct."""

from __future__ import annotations

import re

from ndif_celery.celery_app import queue_for


KEY = 'nnsight.modeling.transformers.TransformersModel:{"repo_id": "openai-community/gpt2", "revision": null, "task": "text-generation"}'


def test_queue_names_are_readable_stable_and_distinct():
    other = KEY.replace("gpt2", "gpt2-medium")
    assert queue_for(KEY) == queue_for(KEY)
    assert queue_for(KEY) != queue_for(other)
    assert queue_for(KEY).startswith("ndif.model.openai-community-gpt2.")
    assert re.fullmatch(r"[A-Za-z0-9_.-]+", queue_for(KEY))
