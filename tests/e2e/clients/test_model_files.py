"""A researcher with no hub access builds the model from the farm's ``/hub``.

The real nnsight clients (0.8.1, and 0.7.0 on its runtime) run in a child
process with an empty Hugging Face cache, ``HF_HUB_OFFLINE`` unset and
``HF_ENDPOINT`` pointed at the farm's ``/hub`` (the hub itself is out of
reach here): the config, the tokenizer and the repo's canonical id come from
the farm, the trace runs remotely and saves exactly what the same trace saves
locally, and no weight file reaches the client's cache. With auth on,
``HF_TOKEN`` carries the NDIF key; a repo the model policy refuses gets 403,
and no key 401, both read by the client as the farm's sentence.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid

import pytest
import torch

from tests.support.cases.tiny_model import PROMPT, REPO_ID

OUTSIDE = "ndif-celery/not-listed-here"  # a repo this farm's NDIF_MODELS does not list
LAYER = 2

# The README snippet (as docs/researchers.md gives it offline), the tokenizer given: nnsight
# 0.8.1 on transformers 5 does not find one for a pre-built meta model by itself.
SNIPPET = """
import json, sys
import torch
import nnsight
from nnsight.modeling.transformers import TransformersModel
from transformers import AutoTokenizer
nnsight.CONFIG.API.HOST = sys.argv[1]
repo, prompt, layer, out = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
model = TransformersModel(repo, task="text-generation", tokenizer=AutoTokenizer.from_pretrained(repo))
with model.trace(prompt, remote=True):
    hidden = model.transformer.h[layer].output.save()
torch.save(hidden, out)
print(json.dumps({"ran": True, "key": model.to_model_key()}))
"""

# The 0.7.0 client as its users write it: LanguageModel loads the tokenizer itself.
SNIPPET_070 = """
import json, sys
import torch
import nnsight
import os
from nnsight import CONFIG, LanguageModel
CONFIG.API.HOST = sys.argv[1]
CONFIG.API.APIKEY = os.environ["NDIF_API_KEY"]
repo, prompt, layer, out = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
model = LanguageModel(repo)
with model.trace(prompt, remote=True):
    hidden = model.transformer.h[layer].output.save()
torch.save(hidden, out)
print(json.dumps({"ran": True, "version": nnsight.__version__}))
"""

CONFIG_ONLY = """
import json, sys
from transformers import AutoConfig
try:
    AutoConfig.from_pretrained(sys.argv[1])
    print(json.dumps({"read": True}))
except Exception as error:
    print(json.dumps({"error": type(error).__name__, "said": str(error)}))
"""


def run_offline_client(tmp_path, stack, script: str, *args: str, key: str = "", python: str = sys.executable) -> dict:
    """``script`` under a client (the farm's own, or ``python``'s) in a child process
    that can reach only the farm: a fresh HF cache, no offline switch, HF_ENDPOINT at ``/hub``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NDIF_", "HF_", "TRANSFORMERS_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=f"{stack.url}/hub", HF_HUB_DISABLE_TELEMETRY="1")
    if key:
        env.update(HF_TOKEN=key, NDIF_API_KEY=key)
    done = subprocess.run([str(python), "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=240)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, f"the client failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return json.loads(lines[-1])


def cached_files(tmp_path) -> set:
    """The files the child's HF cache holds, by their names in the repo."""
    return {p.name for p in (tmp_path / "hf" / "hub").glob("models--*/snapshots/*/*")}


def local_layer(model):
    with model.trace(PROMPT):
        local = model.transformer.h[LAYER].output.save()
    return local


@pytest.mark.pools("fs")
def test_the_snippet_runs_with_only_the_farm_as_its_hub(fs_stack, model, tmp_path):
    out = tmp_path / "hidden.pt"
    said = run_offline_client(tmp_path, fs_stack, SNIPPET, fs_stack.url, REPO_ID, PROMPT, str(LAYER), str(out))
    assert said["ran"] and json.loads(said["key"].split(":", 1)[1])["repo_id"] == REPO_ID, said
    assert torch.equal(torch.load(out), local_layer(model))
    files = cached_files(tmp_path)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= files, files
    assert not any(name.endswith((".safetensors", ".bin")) for name in files), files
    assert not [p for p in (tmp_path / "hf").rglob("*") if p.is_file() and p.stat().st_size > 1024 * 1024]


@pytest.fixture(scope="module")
def farm(tmp_path_factory, hf_home):
    """A farm of this module's own: auth on, NDIF_MODELS listing only the tiny model
    (the policy refuses every other repo), a worker of the nnsight 0.7.0 runtime;
    with that client's interpreter."""
    from tests.support.clients import client_envs
    from tests.support.stacks.stack import Stack, offline_env

    home = tmp_path_factory.mktemp("model-files")
    runtime = client_envs.shared("0.7.0")
    client_envs.link_into(home, runtime)
    env = {**offline_env(hf_home), "NDIF_AUTH": "1", "NDIF_AUTH_CACHE_S": "0", "NDIF_MODELS": REPO_ID,
           "NDIF_RUNTIMES": "0.7.0"}
    stack = Stack(home, env=env)
    stack.start()
    try:
        stack.until(lambda: "0.7.0" in {info.get("nnsight") for info in stack.operator_farm()["cluster"]["workers"].values()},
                    "the 0.7.0 runtime's worker to register", timeout_s=180)
        yield stack, runtime.interpreter
    finally:
        stack.discard()


def test_the_070_client_runs_with_only_the_farm_as_its_hub(farm, model, tmp_path):
    stack, python = farm
    out = tmp_path / "hidden.pt"
    said = run_offline_client(tmp_path, stack, SNIPPET_070, stack.url, REPO_ID, PROMPT, str(LAYER), str(out),
                              python=python, key=_key(stack, "--trusted"))
    assert said == {"ran": True, "version": "0.7.0"}, said
    assert torch.equal(torch.load(out), local_layer(model))  # the same weights and torch: the 0.8.1 client's local value
    assert not any(name.endswith((".safetensors", ".bin")) for name in cached_files(tmp_path))


def _key(stack, *flags) -> str:
    result = stack.cli("keys", "create", "--email", f"model-files-{uuid.uuid4().hex[:8]}@example.org", *flags)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_with_auth_on_hf_token_carries_the_ndif_key(farm, model, tmp_path):
    stack, _ = farm
    out = tmp_path / "hidden.pt"
    said = run_offline_client(tmp_path, stack, SNIPPET, stack.url, REPO_ID, PROMPT, str(LAYER), str(out),
                              key=_key(stack, "--trusted"))
    assert said["ran"], said
    assert torch.equal(torch.load(out), local_layer(model))


def test_a_repo_the_policy_refuses_is_403_and_no_key_401(farm, tmp_path):
    stack, _ = farm
    key = _key(stack, "--trusted")
    for path in (f"/hub/api/models/{OUTSIDE}", f"/hub/{OUTSIDE}/resolve/main/config.json"):
        request = urllib.request.Request(stack.url + path, headers={"Authorization": f"Bearer {key}"})
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(request, timeout=30)
        assert answer.value.code == 403
        assert "NDIF_MODELS does not list it" in json.loads(answer.value.read())["detail"]
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(stack.url + path, timeout=30)
        assert answer.value.code == 401 and "HF_TOKEN" in json.loads(answer.value.read())["detail"]
    # The client shows the farm's sentence (huggingface_hub's GatedRepoError, as transformers words it).
    refused = run_offline_client(tmp_path, stack, CONFIG_ONLY, OUTSIDE, key=key)
    assert "read" not in refused and "NDIF_MODELS does not list it" in refused["said"], refused
    missing = run_offline_client(tmp_path, stack, CONFIG_ONLY, REPO_ID)
    assert "read" not in missing and "HF_TOKEN" in missing["said"], missing
    listed = run_offline_client(tmp_path, stack, CONFIG_ONLY, REPO_ID, key=_key(stack))  # untrusted, but listed
    assert listed == {"read": True}, listed
