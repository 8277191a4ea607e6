"""What one user's block changes on a resident model never reaches the next user.

One stack (auth on, untrusted keys jailed in forked children) runs the farm's
own worker and a 0.7.0 and a 0.5.15 runtime's. Key A's block changes what it can reach on
the resident model (``tests/support/cases/model_state.py``: the generation config,
the config, the tokenizer and its native backend, a module's attribute and
hooks, an envoy's slot). A later block of key B, on the same worker and the
same resident model, reads every one of them as loaded, and a walk of all it
can read matches a fresh load of the model. With the real 0.8.1 client on
the farm's own runtime, and the real 0.7.0 and 0.5.15 clients on their own.

Trusted keys run in the worker's process, where ``workers.baseline`` puts the
model back after each request; untrusted keys run in a jailed child, and what
one changes dies with it.
"""

from __future__ import annotations

import json

import nnsight
import pytest

from ndif_celery.policy import model_policy
from tests.support.clients import client_envs
from tests.support.cases import model_state
from tests.support.cases.model_state import CHANGED, change_everything, differences, read_back
from tests.support.paths import ROOT
from tests.support.clients.remote import client_pointed_at
from tests.support.cases.tiny_model import PROMPT, REPO_ID, worker_loaded

nnsight.register(model_state)  # its blocks' helpers run on the farm

RUNTIMES = ("0.7.0", "0.5.15")
WHO = {"trusted-a": True, "trusted-b": True, "untrusted-c": False, "untrusted-d": False}


@pytest.fixture(scope="module")
def farm(tmp_path_factory, hf_home):
    runtimes = [client_envs.shared(version) for version in RUNTIMES]
    with client_envs.runtimes_stack(tmp_path_factory.mktemp("residue-farm"), hf_home, runtimes,
                                    {"NDIF_ISOLATION": "fork"}) as stack:
        keys = {who: stack.create_key(f"{who}@example.org", trusted=trusted) for who, trusted in WHO.items()}
        yield {"stack": stack, "pythons": {runtime.version: runtime.interpreter for runtime in runtimes},
               "keys": keys}


# -- the farm's own client (0.8.1) ---------------------------------------------------------


@pytest.fixture(scope="module")
def as_loaded():
    """What a user reads off a fresh load as the farm's own worker loads it, and all it can read."""
    _, fresh = worker_loaded()
    return model_state.what_a_user_reads(fresh), model_state.readable_state(fresh)


def _as(farm, who: str, block, model) -> dict:
    with client_pointed_at(farm["stack"].url):
        nnsight.CONFIG.API.APIKEY = farm["keys"][who]
        return block(model)


def test_a_trusted_users_changes_never_reach_the_next_user(farm, model, as_loaded):
    expected, everything = as_loaded
    first = _as(farm, "trusted-a", change_everything, model)
    _changed_as_meant(first["seen"], expected)
    later = _as(farm, "trusted-b", read_back, model)
    assert later["model"] == first["model"], "the later request ran on another model: nothing was left to find"
    assert later["seen"] == expected
    _same_state(everything, later["state"])


def test_an_untrusted_users_changes_die_with_its_child(farm, model):
    """A jailed child's model is its zygote's skeleton, not the worker's load: its
    reference is what a fresh child reads before any change."""
    before = _as(farm, "untrusted-d", read_back, model)
    _changed_as_meant(_as(farm, "untrusted-c", change_everything, model)["seen"], before["seen"])
    later = _as(farm, "untrusted-d", read_back, model)
    assert later["seen"] == before["seen"]
    _same_state(before["state"], later["state"])


def _same_state(expected: dict, found: dict) -> None:
    found = differences(expected, found, limit=40)
    assert not found, "what a later user reads differs from the model as loaded:\n" + "\n".join(found)


def _changed_as_meant(seen: dict, expected: dict) -> None:
    """The first block really changed the model it ran on, each field as it meant to."""
    assert {name: seen[name] for name in CHANGED} == CHANGED
    assert {name: expected[name] for name in CHANGED} != CHANGED
    assert seen["hooks"] == expected["hooks"] + 1 and seen["note"] and seen["vocab"] == expected["vocab"] + 2


# -- the 0.7.0 and 0.5.15 clients on their runtimes -------------------------------------------

PREAMBLE = """
import json, linecache, sys
# nnsight reads a block's source with inspect: give this -c program's text a file's place.
_SOURCE = sys.orig_argv[sys.orig_argv.index("-c") + 1]
linecache.cache["<string>"] = (len(_SOURCE), None, _SOURCE.splitlines(keepends=True), "<string>")
import nnsight
PROMPT = __PROMPT__
"""

# Blocks run one after another by one older client, each with its key ("read_back=KEY ..."): what each read.
OLD_CLIENT = PREAMBLE + """
import types
import huggingface_hub
from nnsight import CONFIG, LanguageModel
CONFIG.API.HOST = sys.argv[1]
# These clients ask the hub for the repo's canonical id; the hub is out of reach here, and the id is the repo's.
huggingface_hub.HfApi.model_info = lambda self, repo_id, *args, **kwargs: types.SimpleNamespace(id=repo_id)
__BLOCKS__
model = LanguageModel(sys.argv[2])
for step in sys.argv[3:]:
    block, CONFIG.API.APIKEY = step.split("=")
    print(json.dumps({"block": block, **globals()[block](model)}))
"""

# A fresh load exactly as the runtime's worker loads it (its adapter), and what a user reads off it.
AS_LOADED = PREAMBLE + """
sys.path.insert(0, sys.argv[1])
from workers import adapters
__BLOCKS__
model = adapters.current().load(sys.argv[2], dispatch=True)
print(json.dumps({"seen": what_a_user_reads(model), "state": readable_state(model)}))
"""


def _script(template: str) -> str:
    return template.replace("__PROMPT__", repr(PROMPT)).replace("__BLOCKS__", model_state.SOURCE)


@pytest.fixture(scope="module", params=RUNTIMES)
def runtime(request):
    return request.param


@pytest.fixture(scope="module")
def runtime_as_loaded(farm, runtime):
    suffix = json.dumps({"repo_id": REPO_ID, "revision": model_policy.DEFAULT_BRANCH})
    key = model_policy.parse_client_key(f"{model_policy.LANGUAGE_MODEL}:{suffix}", runtime).key
    return client_envs.run(farm["pythons"][runtime], _script(AS_LOADED), str(ROOT), key)


def _old_client_runs(farm, runtime: str, *steps: tuple) -> list:
    return client_envs.run_all(farm["pythons"][runtime], _script(OLD_CLIENT), farm["stack"].url, REPO_ID,
                               *(f"{block}={farm['keys'][who]}" for block, who in steps), timeout_s=300)


def test_the_runtimes_next_trusted_user_reads_the_model_as_loaded(farm, runtime, runtime_as_loaded):
    changed, read = _old_client_runs(farm, runtime, ("change_everything", "trusted-a"), ("read_back", "trusted-b"))
    _changed_as_meant(changed["seen"], runtime_as_loaded["seen"])
    assert read["model"] == changed["model"], "the later request ran on another model: nothing was left to find"
    assert read["seen"] == runtime_as_loaded["seen"]
    _same_state(_the_workers(runtime_as_loaded["state"]), _the_workers(read["state"]))


def _the_workers(state: dict) -> dict:
    """A 0.5/0.6/0.7 block's ``model`` is its client's envoy, rebuilt from the payload
    for that request alone (its ``config`` and slots the client's); only the
    module tree and the tokenizer in it are the worker's (persistent ids)."""
    return {name: value for name, value in state.items() if name not in ("envoys", "config")}


def test_the_runtimes_untrusted_users_changes_die_with_its_child(farm, runtime):
    before, changed, read = _old_client_runs(farm, runtime, ("read_back", "untrusted-d"),
                                             ("change_everything", "untrusted-c"), ("read_back", "untrusted-d"))
    _changed_as_meant(changed["seen"], before["seen"])
    assert read["seen"] == before["seen"]
    _same_state(before["state"], read["state"])
