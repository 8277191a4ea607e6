"""The model policy (``ndif_celery/policy/model_policy.py``): a model key is code.

Attacks against real stacks (the pure functions they reach are
tests/unit/ndif_celery/policy/test_model_policy.py): raw HTTP
with crafted model keys and envs, a job put on the broker directly (as if the
web were bypassed), and the real client. Each attack is refused with an error
naming the problem, loads nothing (no marker from a repo's own code, no
DEPLOYING, no load in the worker log), and the stack still serves a correct
trace afterwards.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

import httpx
import nnsight
import pytest
import torch

from ndif_celery import config
from ndif_celery.policy import model_policy
from tests.support.stacks.stack import Stack
from tests.support.cases.tiny_model import PROMPT, REPO_ID, client_model

KEY = 'nnsight.modeling.transformers.TransformersModel:{"repo_id": "ndif-celery/tiny-gpt2", "revision": null, "task": "text-generation"}'
CLS = model_policy.TRANSFORMERS_MODEL


def _key(**suffix) -> str:
    return f"{CLS}:{json.dumps(suffix)}"


# --- the pure functions -------------------------------------------------------------


# --- attacks on real stacks ----------------------------------------------------------

REMOTE_CODE = "ndif-policy/remote-code"
ADAPTER = "ndif-policy/lora-adapter"
UNLISTED = "ndif-policy/unlisted"


def _copy_repo(src_hub: Path, dst_hub: Path, src: str, dst: str) -> Path:
    target = dst_hub / f"models--{dst.replace('/', '--')}"
    shutil.copytree(src_hub / f"models--{src.replace('/', '--')}", target, symlinks=True)
    (snapshot,) = (target / "snapshots").iterdir()
    return snapshot


@pytest.fixture(scope="module")
def cache(tmp_path_factory, hf_home):
    """A private HF cache: the tiny model, a copy whose config names its own code
    (which writes a marker when imported), a copy nobody lists, and a PEFT adapter."""
    root = tmp_path_factory.mktemp("policy-hf")
    marker = root / "REMOTE-CODE-RAN"
    hub = root / "hf" / "hub"
    hub.mkdir(parents=True)
    _copy_repo(hf_home / "hub", hub, REPO_ID, REPO_ID)
    _copy_repo(hf_home / "hub", hub, REPO_ID, UNLISTED)
    evil = _copy_repo(hf_home / "hub", hub, REPO_ID, REMOTE_CODE)
    (evil / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\n"
        "from transformers import GPT2Config, GPT2LMHeadModel\n"
        "class EvilConfig(GPT2Config):\n    pass\n"
        "class EvilModel(GPT2LMHeadModel):\n    config_class = EvilConfig\n"
    )
    config_path = evil / "config.json"
    cfg = json.loads(config_path.read_text())
    cfg["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    config_path.unlink()  # a copy, not the shared cache's file
    config_path.write_text(json.dumps(cfg))
    adapter = hub / f"models--{ADAPTER.replace('/', '--')}"
    (adapter / "refs").mkdir(parents=True)
    (adapter / "refs" / "main").write_text("a" * 40)
    snap = adapter / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "base_model_name_or_path": REPO_ID, "r": 4, "target_modules": ["c_attn"]}))
    (snap / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    return {"hf_home": root / "hf", "marker": marker}


def _stack(home: Path, hf: Path, **env) -> Stack:
    # Fork zygotes (from the worker's fork server): what a model may be loaded as is
    # decided before any zygote, and an exec'd one per model load costs an interpreter.
    stack = Stack(home, env={"HF_HOME": str(hf), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                             "NDIF_ISOLATION": "fork", **env})
    stack.start()
    return stack


@pytest.fixture(scope="module")
def auth_stack(tmp_path_factory, cache):
    """Auth on, the product defaults: NDIF_MODELS and NDIF_TRUST_REMOTE_CODE empty."""
    stack = _stack(tmp_path_factory.mktemp("policy-auth"), cache["hf_home"], NDIF_AUTH="1", NDIF_AUTH_CACHE_S="0",
                   NDIF_MODELS="", NDIF_TRUST_REMOTE_CODE="")
    keys = {}
    for name, flags in (("trusted", ["--trusted"]), ("untrusted", [])):
        result = stack.cli("keys", "create", "--email", f"{name}@example.org", *flags)
        assert result.returncode == 0, result.stderr
        keys[name] = result.stdout.strip().splitlines()[-1]
    stack.keys = keys
    saved = nnsight.CONFIG.API.HOST, nnsight.CONFIG.API.APIKEY
    nnsight.CONFIG.API.HOST = stack.url
    yield stack
    nnsight.CONFIG.API.HOST, nnsight.CONFIG.API.APIKEY = saved
    stack.discard()


def _post(stack, model_key: str, key: str = "", env: dict | None = None) -> httpx.Response:
    envelope = {"model_key": model_key, "session_id": "", "compress": False, "env": env or {}}
    headers = {"ndif-api-key": key} if key else {}
    return httpx.post(f"{stack.url}/request", data={"data": json.dumps(envelope)},
                      files={"blob": ("request", b"payload", "application/octet-stream")}, headers=headers, timeout=30)


def _worker_log(stack) -> str:
    return "".join(p.read_text(errors="replace") for p in stack.logs_dir.glob("worker*.log"))


def _deployed(stack) -> set:
    return {e["repo_id"] for e in stack.farm()["deployments"].values() if e["deployment_level"] == "HOT"}


def _serves(model, api_key: str = "", isolated: bool | None = None) -> None:
    nnsight.CONFIG.API.APIKEY = api_key
    with model.trace(PROMPT, remote=True) as tracer:
        remote = model.transformer.h[2].output.save()
    with model.trace(PROMPT):
        local = model.transformer.h[2].output.save()
    assert torch.equal(remote, local)
    if isolated is not None:
        assert tracer.backend.meta["isolated"] is isolated


def test_an_untrusted_key_cannot_deploy_a_model(auth_stack, model):
    """Nothing deployed yet: the untrusted key's request for the cached tiny
    model is refused at intake, and nothing is placed or loaded."""
    response = _post(auth_stack, KEY, auth_stack.keys["untrusted"])
    assert response.status_code == 403, response.text
    assert "not deployed on this farm, and untrusted keys cannot deploy new models" in response.json()["detail"]
    time.sleep(1)
    assert REPO_ID not in _deployed(auth_stack)
    assert "placing" not in _worker_log(auth_stack) and "loaded in" not in _worker_log(auth_stack)
    # A trusted key deploys it; then the untrusted key runs on it (in its jail).
    _serves(model, auth_stack.keys["trusted"], isolated=False)
    _serves(model, auth_stack.keys["untrusted"], isolated=True)


def test_trust_remote_code_for_an_unlisted_repo_is_refused(auth_stack, cache, model):
    evil = _key(repo_id=REMOTE_CODE, revision=None, trust_remote_code=True, task="text-generation")
    for who in ("trusted", "untrusted"):
        response = _post(auth_stack, evil, auth_stack.keys[who])
        assert response.status_code == 403, response.text
        assert f"trust_remote_code is refused for '{REMOTE_CODE}'" in response.json()["detail"]
    # The real client, asking for remote code, is told the same.
    nnsight.CONFIG.API.APIKEY = auth_stack.keys["trusted"]
    with pytest.raises(Exception, match="trust_remote_code is refused"):
        with client_model(REPO_ID, trust_remote_code=True).trace(PROMPT, remote=True):
            pass
    time.sleep(1)
    assert not cache["marker"].exists(), "the repo's own code ran"
    assert REMOTE_CODE not in _deployed(auth_stack)
    _serves(model, auth_stack.keys["trusted"])


@pytest.mark.parametrize("suffix, words", [
    ({"repo_id": "/etc", "revision": None, "task": "text-generation"}, "is a path"),
    ({"repo_id": "..", "revision": None, "task": "text-generation"}, "is a path"),
    ({"repo_id": REPO_ID, "revision": None, "task": "text-generation", "device_map": "auto"}, "'device_map'"),
    ({"repo_id": REPO_ID, "revision": None, "task": "text-generation", "trust_remote_code": True,
      "code_revision": "x"}, "'code_revision'"),
    ({"repo_id": REPO_ID, "revision": None, "task": "text-generation", "_v": 1}, "'_v'"),
])
def test_paths_and_loader_kwargs_are_refused(auth_stack, model, suffix, words):
    response = _post(auth_stack, _key(**suffix), auth_stack.keys["trusted"])
    assert response.status_code == 422, response.text
    assert words in response.json()["detail"]
    _serves(model, auth_stack.keys["trusted"])


@pytest.mark.parametrize("env, words", [
    ({"peft": "/etc/passwd"}, "is a path"),
    ({"peft": ADAPTER, "extra": 1}, "'extra' is not allowed"),
    ({"attn_implementation": "kernels-community/flash-attn"}, "'attn_implementation'"),
])
def test_the_env_cannot_name_paths_or_code(auth_stack, model, env, words):
    response = _post(auth_stack, KEY, auth_stack.keys["trusted"], env=env)
    assert response.status_code == 422, response.text
    assert words in response.json()["detail"]
    _serves(model, auth_stack.keys["trusted"])


def test_a_job_put_on_the_broker_directly_is_refused_by_the_worker(auth_stack, cache, model):
    """Defence in depth: the web is bypassed (a job message sent straight to the
    broker, as anyone holding the broker could). The controller and worker
    refuse the key: ERROR naming the reason, no load, no remote code."""
    from ndif_celery.celery_app import make_app, queue_for, send_job
    from ndif_celery.state import jobs, registry

    settings = config.load(auth_stack.env)
    client = jobs.connect(settings.redis_url, 5)
    app = make_app(settings)
    cases = {
        _key(repo_id=REMOTE_CODE, revision=None, trust_remote_code=True, task="text-generation"): "trust_remote_code",
        _key(repo_id=REPO_ID, revision=None, task="text-generation", device_map="auto"): "'device_map'",
        f'{CLS}:{{"repo_id": "{UNLISTED}",  "revision": null, "task": "text-generation"}}': "canonical form",
        _key(repo_id=UNLISTED, revision=None, task="text-generation"): "untrusted keys cannot deploy",
    }
    for model_key, words in cases.items():
        job = jobs.Job(id=uuid.uuid4().hex, model_key=model_key, received_at=jobs.now(), payload_bytes=7,
                       trusted=model_key.find("trust_remote") >= 0 or "device_map" in model_key, owner="broker")
        queue = queue_for(model_key)
        client.set(jobs.payload_key(job.id), b"payload", ex=600)
        client.set(jobs.message_key(job.id), jobs.dumps(job.to_message()), ex=600)
        client.sadd(registry.QUEUES, queue)
        client.hset(registry.QUEUE_MODELS, queue, model_key)
        send_job(app, job)
        registry.wake_controller(client, queue)
        latest = _final(client, job.id)
        assert latest["status"] == "ERROR" and words in latest["description"], (model_key, latest)
    assert not cache["marker"].exists(), "the repo's own code ran"
    assert _deployed(auth_stack) <= {REPO_ID}
    assert "loaded in" not in _worker_log(auth_stack).replace(f"{REPO_ID} loaded in", "")
    _serves(model, auth_stack.keys["trusted"])


def _final(client, job_id: str, timeout_s: float = 60) -> dict:
    from ndif_celery.state import jobs

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        latest = jobs.latest_status(client, job_id)
        if jobs.ended(latest):
            return json.loads(latest)
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not end: {latest!r}")


def test_status_lists_only_runnable_models(auth_stack, model):
    listed = {e["repo_id"] for e in auth_stack.farm()["deployments"].values()}
    assert ADAPTER not in listed, "a PEFT adapter is not a model anyone can run"
    assert {REPO_ID, UNLISTED, REMOTE_CODE} <= listed
    _serves(model, auth_stack.keys["trusted"])


@pytest.fixture(scope="module")
def listed_stack(tmp_path_factory, cache):
    """Auth off, every request untrusted, NDIF_MODELS naming the tiny model only."""
    stack = _stack(tmp_path_factory.mktemp("policy-listed"), cache["hf_home"], NDIF_DEFAULT_TRUSTED="0",
                   NDIF_MODELS=f"{REPO_ID}, ndif-celery/other-*", NDIF_EXECUTION_TIMEOUT_S="20")
    saved = nnsight.CONFIG.API.HOST, nnsight.CONFIG.API.APIKEY
    nnsight.CONFIG.API.HOST, nnsight.CONFIG.API.APIKEY = stack.url, ""
    yield stack
    nnsight.CONFIG.API.HOST, nnsight.CONFIG.API.APIKEY = saved
    stack.discard()


def test_a_listed_model_is_deployed_for_an_untrusted_key(listed_stack, model):
    assert REPO_ID not in _deployed(listed_stack)
    _serves(model, isolated=True)  # first request: deployed, run jailed
    assert REPO_ID in _deployed(listed_stack)


def test_an_unlisted_model_is_not_served_here(listed_stack, model):
    response = _post(listed_stack, _key(repo_id=UNLISTED, revision=None, task="text-generation"))
    assert response.status_code == 403
    assert f"Model '{UNLISTED}' is not served here" in response.json()["detail"]
    listed = {e["repo_id"] for e in listed_stack.farm()["deployments"].values()}
    assert listed == {REPO_ID}, "/status offers only what NDIF_MODELS allows"
    _serves(model, isolated=True)
