"""A trusted request's changes to the shared model are put back (``workers.baseline``).

In-process: the tiny GPT-2 as a worker loads it, and real payloads of the
real client run through the trusted path (``cobatch.run_alone``: the request
scope, deserialize, run). One request changes the generation config, the
config, the tokenizer and its native backend, a module's attribute and
hooks, an envoy's slot; the next request reads them all back, and a walk of
everything a later user can read (``tests/support/cases/model_state.py``) matches
a fresh load of the model.
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.support.cases.model_state import (CHANGED, change_everything, differences, read_back, readable_state,
                                        what_a_user_reads)
from tests.support.clients.remote import recorded_request
from tests.support.cases.tiny_model import PROMPT, client_model, worker_loaded
from workers import baseline, execute
from workers.cobatch import Request, run_alone

@pytest.fixture(scope="module")
def server():
    return worker_loaded()[1]


@pytest.fixture(scope="module")
def client():
    return client_model()


@pytest.fixture(scope="module")
def as_loaded():
    """What a user reads off a fresh load, and everything readable of it."""
    _, fresh = worker_loaded()
    return what_a_user_reads(fresh), readable_state(fresh)


def served(server, client, block, env: dict | None = None) -> dict:
    """``block``'s saves, run as the worker runs a trusted request on ``server``."""
    request, blob = recorded_request(block, client)
    outcome = run_alone(server, Request("job", blob, request.compress, env if env is not None else request.env or {}),
                        "")
    assert outcome.error is None, outcome.error
    return outcome.saved


def test_the_next_request_reads_the_model_as_loaded(server, client, as_loaded):
    expected, everything = as_loaded
    changed = served(server, client, change_everything)["seen"]
    # The first request really changed the shared model, each field as it meant to.
    assert {name: changed[name] for name in CHANGED} == CHANGED
    assert changed["hooks"] == expected["hooks"] + 1 and changed["note"] and changed["vocab"] == expected["vocab"] + 2
    assert {name: expected[name] for name in CHANGED} != CHANGED

    saved = served(server, client, read_back)
    assert saved["seen"] == expected
    assert differences(everything, saved["state"]) == []


def test_what_is_put_back_is_the_same_objects(server, client):
    """In place: every holder of the config or the tokenizer sees the restore."""
    module, tokenizer = server._module, server.tokenizer
    config, generation, backend = module.config, module.generation_config, tokenizer._tokenizer
    served(server, client, change_everything)
    assert module.config is config and module.transformer.h[0].attn.config is config
    assert module.generation_config is generation and server.tokenizer is tokenizer
    assert tokenizer._tokenizer is backend and backend.truncation is None and backend.padding is None
    assert server.pipeline.tokenizer is tokenizer and "[PAD]" not in tokenizer.get_vocab()


def test_an_unfinished_restore_is_finished_before_the_next_request(server, client, as_loaded):
    """A job interrupted while its changes were put back (its deadline, a kill):
    the next request finds them put back before it runs."""
    server._module.generation_config.max_new_tokens = 11
    server.tokenizer.padding_side = "right"
    baseline.of(server).dirty = True
    assert served(server, client, read_back)["seen"] == as_loaded[0]


def test_a_request_that_changes_nothing_finds_nothing_to_put_back(server, client):
    served(server, client, read_back)
    assert baseline.of(server).changed() == []
    assert len(baseline.of(server)) > 1000  # every module, its hook tables, the configs, the tokenizer


def test_an_adapter_the_farm_swaps_in_stays_while_the_users_changes_go(server, client, monkeypatch):
    """A PEFT adapter comes from the request's env: the farm changes the tree,
    not the user. The tree as the swap left it is kept; a swap back to none
    leaves the base tree again."""
    real = execute.adapter()

    def set_env(model, env):  # the tree change a PEFT swap makes, without an adapter to fetch
        wanted = (env or {}).get("peft")
        if wanted != model.__dict__.get("peft"):
            model.__dict__["peft"] = wanted
            layer = model._module.transformer.h[0].__dict__
            layer.update(lora=wanted) if wanted else layer.pop("lora", None)

    shim = types.SimpleNamespace(**{name: getattr(real, name) for name in dir(real) if not name.startswith("__")})
    shim.set_env = set_env
    monkeypatch.setattr(execute, "adapter", lambda: shim)
    try:
        seen = served(server, client, change_everything, env={"peft": "org/adapter"})["seen"]
        assert seen["max_new_tokens"] == 3
        assert server.__dict__["peft"] == "org/adapter" and server._module.transformer.h[0].lora == "org/adapter"
        assert server._module.generation_config.max_new_tokens is None, "the user's change stayed"
        served(server, client, read_back, env={})
        assert server.__dict__.get("peft") is None and "lora" not in vars(server._module.transformer.h[0])
    finally:
        execute._PERSISTENT.pop(server._module, None)


def test_tensors_moved_into_shared_memory_are_the_ones_kept(client):
    """Moving the weights into shared memory (for a zygote) makes new buffer
    objects: the baseline is retaken, so a request never puts the old ones back."""
    from workers.models.resident import Resident

    key, model = worker_loaded()
    model._module.transformer.h[0].register_buffer("probe", torch.arange(4.0))
    resident = Resident(key, model, None)
    try:
        resident.share()
        moved = model._module.transformer.h[0]._buffers["probe"]
        served(model, client, read_back)
        assert model._module.transformer.h[0]._buffers["probe"] is moved
    finally:
        resident.close()
