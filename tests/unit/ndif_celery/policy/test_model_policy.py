"""The model policy (``ndif_celery/policy/model_policy.py``): a model key is code.

Unit tests of the pure functions: which keys, revisions, tasks and envs pass,
what a key is reduced to, who may load what. The attacks that reach them
through a real stack are tests/e2e/access/test_model_policy.py.
"""

from __future__ import annotations

import json

import pytest

from ndif_celery import config
from ndif_celery.policy import model_policy
from ndif_celery.policy.model_policy import ModelPolicy, PolicyError
from tests.support.cases.tiny_model import REPO_ID, client_model

KEY = 'nnsight.modeling.transformers.TransformersModel:{"repo_id": "ndif-celery/tiny-gpt2", "revision": null, "task": "text-generation"}'
CLS = model_policy.TRANSFORMERS_MODEL


def _key(**suffix) -> str:
    return f"{CLS}:{json.dumps(suffix)}"


# --- the pure functions -------------------------------------------------------------


def test_the_clients_own_key_is_canonical(model):
    assert model_policy.parse(model.to_model_key()).key == model.to_model_key() == KEY
    remote_code = client_model(REPO_ID, trust_remote_code=True).to_model_key()
    parsed = model_policy.parse(remote_code)
    assert parsed.trust_remote_code and parsed.key == remote_code
    # An explicit false is what nnsight leaves out: the same deployment.
    assert model_policy.parse(_key(repo_id=REPO_ID, revision=None, trust_remote_code=False,
                                   task="text-generation")).key == KEY


@pytest.mark.parametrize("suffix, words", [
    ({"repo_id": REPO_ID, "revision": None, "task": "text-generation", "device_map": "auto"}, "'device_map'"),
    ({"repo_id": REPO_ID, "task": "text-generation", "cache_dir": "/tmp"}, "'cache_dir'"),
    ({"repo_id": REPO_ID, "task": "text-generation", "torch_dtype": "float16"}, "'torch_dtype'"),
    ({"repo_id": "/etc", "task": "text-generation"}, "is a path"),
    ({"repo_id": "../../home", "task": "text-generation"}, "is a path"),
    ({"repo_id": "~root/x", "task": "text-generation"}, "is a path"),
    ({"repo_id": "tests", "task": "text-generation"}, "local path"),  # exists in the cwd
    ({"repo_id": "a/b/c", "task": "text-generation"}, "not a Hugging Face hub id"),
    ({"repo_id": "x" * 97, "task": "text-generation"}, "too long"),
    ({"repo_id": 7, "task": "text-generation"}, "'repo_id' must be a string"),
    ({"task": "text-generation"}, "no 'repo_id'"),
    ({"repo_id": REPO_ID, "revision": "../../x", "task": "text-generation"}, "'revision'"),
    ({"repo_id": REPO_ID, "revision": "-rf", "task": "text-generation"}, "'revision'"),
    ({"repo_id": REPO_ID, "revision": 3, "task": "text-generation"}, "'revision'"),
    ({"repo_id": REPO_ID, "task": "rm -rf"}, "'task'"),
    ({"repo_id": REPO_ID, "task": "text-generation-" + "x" * 20}, "'task'"),
    ({"repo_id": REPO_ID}, "no 'task'"),
    ({"repo_id": REPO_ID, "task": "text-generation", "trust_remote_code": "yes"}, "'trust_remote_code'"),
])
def test_a_key_is_reduced_to_what_nnsight_sends(suffix, words):
    with pytest.raises(PolicyError) as caught:
        model_policy.parse(_key(**suffix))
    assert words in caught.value.detail and caught.value.status == 422


@pytest.mark.parametrize("key, words", [
    ("nnsight.modeling.vllm.VLLM:meta-llama/Llama-3-8B", "is not served here"),
    ("nnsight.modeling.diffusion.DiffusionModel:{}", "has no 'repo_id'"),
    ("nnsight.modeling.diffusion.StableDiffusionModel:{}", "is not served here"),
    (f"{CLS}:not json", "JSON object"),
    (f"{CLS}:[1, 2]", "JSON object"),
    ("os.system:ls", "Unknown model class"),
])
def test_only_the_classes_served_are_built(key, words):
    with pytest.raises(PolicyError, match=words):
        model_policy.parse(key)


def test_revisions_and_tasks_nnsight_uses_pass():
    for revision in ("refs/pr/12", "v1.0", "a" * 40, "release_2-b"):
        assert model_policy.parse(_key(repo_id=REPO_ID, revision=revision, task="text-generation")).revision == revision
    for task in ("feature-extraction", "text-classification", "image-text-to-text", "automatic-speech-recognition"):
        assert model_policy.parse(_key(repo_id="gpt2", revision=None, task=task)).task == task


@pytest.mark.parametrize("task", ["text2text-generation", "translation_en_to_fr", "summarization", "vqa"])
def test_a_task_transformers_removed_is_refused_saying_what_serves_instead(task):
    with pytest.raises(PolicyError) as caught:
        model_policy.parse(_key(repo_id="t5-small", revision=None, task=task))
    assert f"{task!r} was removed in transformers 5" in caught.value.detail and "use the" in caught.value.detail


def test_the_default_branch_and_task_aliases_are_one_key():
    """What the hub loads for revision None is "main"; transformers takes each
    alias for its task. Either way one canonical key, so one deployment and
    one access check."""
    from transformers.pipelines import TASK_ALIASES

    assert model_policy.parse(_key(repo_id=REPO_ID, revision="main", task="text-generation")).key == KEY
    for alias, task in TASK_ALIASES.items():
        if alias in model_policy.TASKS:
            assert model_policy.TASK_ALIASES[alias] == task, alias
            named = model_policy.parse(_key(repo_id=REPO_ID, revision=None, task=alias))
            assert named.key == model_policy.parse(_key(repo_id=REPO_ID, revision=None, task=task)).key
    assert model_policy.parse(_key(repo_id=REPO_ID, revision=None, task="ner")).task == "token-classification"


SHA_1, SHA_2 = "1" * 40, "2" * 40
REFS = {"main": SHA_1, "v1": SHA_1, "v2": SHA_2}


def _named(revision, task="text-generation"):
    return model_policy.parse(_key(repo_id=REPO_ID, revision=revision, task=task))


def test_the_same_weights_under_a_branch_a_tag_and_their_commit():
    same, may_be = model_policy.same_weights, model_policy.may_be_same_weights
    for a, b in [(None, SHA_1), (None, "v1"), ("v1", SHA_1), ("v2", SHA_2)]:
        assert same(_named(a), _named(b), REFS) and may_be(_named(a), _named(b), REFS), (a, b)
    for a, b in [(None, "v2"), (SHA_1, SHA_2), ("v1", "v2")]:
        assert not same(_named(a), _named(b), REFS) and not may_be(_named(a), _named(b), REFS), (a, b)
    # A branch whose commit nobody recorded: not known to be the same, nor known to differ.
    assert not same(_named("v3"), _named(SHA_1), REFS) and may_be(_named("v3"), _named(SHA_1), REFS)
    assert not may_be(_named(None), model_policy.parse(_key(repo_id="org/other", revision=None,
                                                              task="text-generation")), REFS)


def test_a_key_naming_deployed_weights_is_that_deployment():
    """Another name of an offered model's weights is the offered key, for every
    key: one deployment, not a copy. An untrusted key cannot deploy another
    revision or task of an offered repo, even one NDIF_MODELS lists."""
    deployed = _named(SHA_1).key
    listed = ModelPolicy(models=("ndif-celery/*",))
    for policy in (ModelPolicy(), listed):
        for trusted in (True, False):
            for revision in (None, "main", "v1", SHA_1):
                assert policy.admit(_named(revision).key, {}, trusted, {deployed}, lambda repo: REFS)[0] == deployed
    classifier = _named(None, "text-classification").key
    assert listed.admit(_key(repo_id=REPO_ID, revision="main", task="sentiment-analysis"), {}, False,
                        {classifier}, lambda repo: REFS)[0] == classifier
    for other in (_named("v2").key, _named(None, "token-classification").key):
        with pytest.raises(PolicyError, match="cannot deploy another revision or task of it") as caught:
            listed.admit(other, {}, False, {deployed}, lambda repo: REFS)
        assert caught.value.status == 403
        assert listed.admit(other, {}, True, {deployed}, lambda repo: REFS)[0] == other  # trusted: its own


def test_the_task_and_attention_lists_cover_the_installed_transformers():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.pipelines import SUPPORTED_TASKS, TASK_ALIASES

    from transformers.pipelines import REMOVED_TASKS

    assert set(SUPPORTED_TASKS) | set(TASK_ALIASES) <= model_policy.TASKS
    assert set(REMOVED_TASKS) == set(model_policy.REMOVED_TASKS)  # each refused, with transformers' advice
    for task, advice in REMOVED_TASKS.items():
        words = model_policy.REMOVED_TASKS[task].split()[:2]  # "the text-generation" -> `text-generation`
        assert words[-1].strip("`") in advice.replace("`", "") or "Diffusers" in advice, task
    shipped = {name.removeprefix("paged|") for name in ALL_ATTENTION_FUNCTIONS.keys()} | {"eager"}
    assert shipped <= model_policy.ATTENTION


@pytest.mark.parametrize("env, words", [
    ({"peft": "/home/user/adapter"}, "is a path"),
    ({"peft": "../adapter"}, "is a path"),
    ({"peft": ["a"]}, "'peft' must be a string"),
    ({"attn_implementation": "kernels-community/flash-attn"}, "'attn_implementation'"),
    ({"attn_implementation": {"": "sdpa"}}, "'attn_implementation'"),
    ({"attn_implementation": "sdpa", "trust_remote_code": True}, "'trust_remote_code' is not allowed in the request's env"),
])
def test_the_env_is_bounded(env, words):
    with pytest.raises(PolicyError) as caught:
        model_policy.check_env(env)
    assert words in caught.value.detail


def test_the_env_nnsight_sends_passes():
    assert model_policy.check_env({"attn_implementation": "sdpa"}) == {"attn_implementation": "sdpa"}
    assert model_policy.check_env({"attn_implementation": None}) == {"attn_implementation": None}
    assert model_policy.check_env({"attn_implementation": "paged|eager", "peft": "org/lora"}) == {
        "attn_implementation": "paged|eager", "peft": "org/lora"}
    assert model_policy.check_env({}) == {}


def test_who_may_load_what():
    open_farm, listed = ModelPolicy(), ModelPolicy(models=("ndif-celery/*",), trust_remote_code=("ndif-celery/custom-*",))
    other = _key(repo_id="someone/else", revision=None, task="text-generation")
    # NDIF_MODELS empty: trusted keys any hub id; untrusted only what is deployed (or the operator deployed).
    assert open_farm.admit(other, {}, trusted=True) == (other, {})
    with pytest.raises(PolicyError, match="untrusted keys cannot deploy new models") as caught:
        open_farm.admit(other, {}, trusted=False, offered={KEY})
    assert caught.value.status == 403
    assert open_farm.admit(KEY, {}, trusted=False, offered={KEY})[0] == KEY
    # Another revision of a deployed repo is another deployment.
    with pytest.raises(PolicyError, match="not deployed"):
        open_farm.admit(_key(repo_id=REPO_ID, revision="v2", task="text-generation"), {}, False, {KEY})
    # NDIF_MODELS set: listed repos for everyone, first deploys included; nothing else, for anyone.
    assert listed.admit(KEY, {}, trusted=False) == (KEY, {})
    for trusted in (True, False):
        with pytest.raises(PolicyError, match="not served here"):
            listed.admit(other, {}, trusted, offered={other})
    with pytest.raises(PolicyError, match="PEFT adapter 'someone/lora' is not served here"):
        listed.admit(KEY, {"peft": "someone/lora"}, trusted=True)
    # trust_remote_code: only listed repos, for everyone.
    for policy in (open_farm, listed):
        with pytest.raises(PolicyError, match="trust_remote_code is refused for 'ndif-celery/tiny-gpt2'"):
            policy.admit(_key(repo_id=REPO_ID, revision=None, trust_remote_code=True, task="text-generation"), {}, True)
    custom = _key(repo_id="ndif-celery/custom-1", revision=None, trust_remote_code=True, task="text-generation")
    assert listed.admit(custom, {}, trusted=True)[0] == custom


def test_the_worker_loads_only_canonical_keys():
    assert ModelPolicy().loadable(KEY) == KEY
    spaced = KEY.replace('", "', '",  "')
    with pytest.raises(PolicyError, match="not in canonical form"):
        ModelPolicy().loadable(spaced)


def test_settings_and_operator_keys(tmp_path):
    settings = config.load({"NDIF_HOME": str(tmp_path), "NDIF_MODELS": " org/a , org/b-* ,",
                            "NDIF_TRUST_REMOTE_CODE": "org/b-1"})
    assert ModelPolicy.from_settings(settings) == ModelPolicy(models=("org/a", "org/b-*"), trust_remote_code=("org/b-1",))
    from ndif_celery.farm import actions

    assert actions.model_key_for(REPO_ID) == KEY
    with pytest.raises(ValueError, match="is a path"):
        actions.model_key_for("/srv/models/x")


# --- attacks on real stacks ----------------------------------------------------------


MAIN_KEY = _key(repo_id="org/a", revision=None, task="text-generation")
OLD_KEY = 'nnsight.modeling.language.LanguageModel:{"repo_id": "org/a", "revision": "main"}'


def test_a_runtimes_request_is_a_deployment_of_its_own():
    main, _ = ModelPolicy().admit(MAIN_KEY, {}, trusted=True)
    old, _ = ModelPolicy().admit(OLD_KEY, {}, trusted=True, offered=[main], runtime="0.7.0")
    # The 0.7 client's LanguageModel key is the language model's TransformersModel, for its runtime.
    assert old == main[:-1] + ', "nnsight": "0.7.0"}'
    assert model_policy.parse(old).main_key == main
    # Offered under the main runtime only: not the same deployment; offered under 0.7.0: that one.
    assert ModelPolicy().admit(OLD_KEY, {}, trusted=True, offered=[old], runtime="0.7.0")[0] == old
    assert ModelPolicy().admit(MAIN_KEY, {}, trusted=True, offered=[old])[0] == main
    # The status of a runtime's port shows the key as its clients write it.
    assert model_policy.family_key(old) == 'nnsight.modeling.language.LanguageModel:{"repo_id": "org/a", "revision": null}'
    assert model_policy.family_key(main) == main


def test_a_client_never_names_a_runtime_itself():
    named = MAIN_KEY[:-1] + ', "nnsight": "0.7.0"}'
    with pytest.raises(PolicyError, match="Field 'nnsight' is not allowed in a model_key"):
        ModelPolicy().admit(named, {}, trusted=True)
    with pytest.raises(PolicyError, match="must be an nnsight version"):
        model_policy.parse(MAIN_KEY[:-1] + ', "nnsight": "../x"}')
    # A 0.8 client's request never reads a LanguageModel key: only a runtime of the older clients does.
    with pytest.raises(PolicyError, match="is not served here"):
        ModelPolicy().admit(OLD_KEY, {}, trusted=True)


def test_an_untrusted_key_uses_a_runtimes_deployment_as_any_other():
    main, _ = ModelPolicy().admit(MAIN_KEY, {}, trusted=True)
    with pytest.raises(PolicyError, match="is not deployed on this farm for nnsight 0.7.0, and untrusted keys"):
        ModelPolicy().admit(OLD_KEY, {}, trusted=False, offered=[main], runtime="0.7.0")
    listed = ModelPolicy(models=("org/*",))
    assert listed.admit(OLD_KEY, {}, trusted=False, offered=[main], runtime="0.7.0")[0].endswith('"nnsight": "0.7.0"}')


# --- quantized deployments and classes served elsewhere ---------------------------------


def test_a_quantized_deployment_is_its_own_key_the_loader_reads():
    key = ModelPolicy().admit(KEY, {}, True, held="int4")[0]
    assert key == KEY[:-1] + ', "dtype": "nf4"}'
    parsed = model_policy.parse(key)
    assert parsed.held == "nf4" and parsed.main_key == KEY and parsed.key == key
    # nnsight's from_model_key turns each field into a loader argument: dtype="nf4" is its quantization.
    assert json.loads(key.partition(":")[2])["dtype"] == "nf4"
    assert not model_policy.same_model(parsed, model_policy.parse(KEY), {})


@pytest.mark.parametrize("held, words", [("int9", "not a quantization nnsight loads"),
                                         ("float16", "not a quantization nnsight loads")])
def test_a_url_naming_no_quantization_is_refused(held, words):
    with pytest.raises(PolicyError) as caught:
        ModelPolicy().admit(KEY, {}, True, held=held)
    assert words in caught.value.detail and caught.value.status == 404


def test_a_client_cannot_write_the_held_format_into_its_key():
    with pytest.raises(PolicyError) as caught:
        model_policy.parse_client_key(KEY[:-1] + ', "dtype": "nf4"}')
    assert "asked for by URL" in caught.value.detail
    with pytest.raises(PolicyError):  # nor a format by another name: the key would reach the loader
        model_policy.parse(KEY[:-1] + ', "dtype": "bfloat16"}')


def test_a_model_held_only_quantized_serves_the_plain_url_and_several_must_be_chosen():
    policy = ModelPolicy()
    nf4, int8 = (policy.admit(KEY, {}, True, held=name)[0] for name in ("nf4", "int8"))
    assert policy.admit(KEY, {}, False, offered=[nf4])[0] == nf4  # the only one, as NDIF
    with pytest.raises(PolicyError) as caught:
        policy.admit(KEY, {}, False, offered=[nf4, int8])
    assert caught.value.status == 409 and "/dtype/int8" in caught.value.detail and "nf4" in caught.value.detail
    assert policy.admit(KEY, {}, False, offered=[nf4, int8], held="8bit")[0] == int8
    assert policy.admit(KEY, {}, False, offered=[nf4, int8, KEY])[0] == KEY  # the plain one, when there is one


def test_an_untrusted_key_cannot_deploy_a_quantization_nobody_offers():
    with pytest.raises(PolicyError) as caught:
        ModelPolicy().admit(KEY, {}, False, offered=[KEY], held="nf4")
    assert caught.value.status == 403


def test_a_runtime_client_cannot_ask_for_a_quantization():
    with pytest.raises(PolicyError) as caught:
        ModelPolicy().admit(KEY, {}, True, runtime="0.7.0", held="nf4")
    assert "loads no quantization" in caught.value.detail


def test_a_vllm_key_is_told_there_are_no_vllm_workers_and_what_to_use():
    from nnsight.modeling.vllm import VLLM
    from nnsight.util import to_import_path

    vllm = f"{to_import_path(VLLM)}:{REPO_ID}"  # as VLLM(REPO_ID).to_model_key() builds it
    with pytest.raises(PolicyError) as caught:
        ModelPolicy().admit(vllm, {}, True)
    assert "no vLLM workers" in caught.value.detail and f"LanguageModel('{REPO_ID}')" in caught.value.detail


def test_a_diffusion_key_has_no_task_and_is_canonical_as_the_client_sends_it():
    key = 'nnsight.modeling.diffusion.DiffusionModel:{"repo_id": "ndif-celery/tiny-sd", "revision": null}'
    assert ModelPolicy().admit(key, {}, True)[0] == key
    with pytest.raises(PolicyError, match="has no 'task'"):
        model_policy.parse(key[:-1] + ', "task": "text-to-image"}')


@pytest.mark.parametrize("component, words", [
    (["my_unet", "MyUNet"], "code of the repo's own"),
    (["diffusers", "UNet2DConditionModel; import os"], "is not [library, class]"),
    (["diffusers"], "is not [library, class]"),
])
def test_a_pipeline_component_outside_diffusers_and_transformers_is_refused(component, words):
    index = {"_class_name": "StableDiffusionPipeline", "requires_safety_checker": False,
             "text_encoder": ["transformers", "CLIPTextModel"], "safety_checker": [None, None], "unet": component}
    with pytest.raises(PolicyError) as caught:
        model_policy.check_pipeline_index(index, "org/sd")
    assert words in caught.value.detail and "'unet'" in caught.value.detail
    index["unet"] = ["diffusers", "UNet2DConditionModel"]
    model_policy.check_pipeline_index(index, "org/sd")
    with pytest.raises(PolicyError, match="no diffusers pipeline index"):
        model_policy.check_pipeline_index(None, "org/sd")
