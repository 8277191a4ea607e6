"""The tiny offline LLaVA, T5 and Whisper (``tests/support/cases/tiny_multimodal.py``)
trace with the real nnsight 0.8.1 client.

For each model one case (reads of an encoder or vision tower and of a text layer,
an in-place edit, ``generate`` with ``max_new_tokens=3``) runs three ways, and all
three must give exactly the same results:

* locally, on the client model;
* under ``remote="local"`` (nnsight's ``LocalSimulationBackend``: the request is
  serialized as for a server and run from the deserialized copy);
* locally on the model a server builds from the client's model key
  (``Remotable.from_model_key(key, dispatch=True)``): what a server is asked to
  reproduce.

T5 is the exception: transformers 5 has no pipeline task that loads
``T5ForConditionalGeneration`` by repo id, so its servable form is ``T5Model``
(task ``feature-extraction``, no ``generate``), and its generating form is a
local-only wrapped module whose key no server can load (see ``client_t5``).

The LLaVA tests need an image backend for its processor (Pillow or torchvision)
and are skipped without one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import pytest
import torch

from tests.support.cases import tiny_multimodal
from tests.support.cases.conformance import assert_same

LOCAL: dict = {}
SIMULATED = {"remote": "local"}
KEY = "nnsight.modeling.transformers.TransformersModel:"


@pytest.fixture(scope="module")
def built(hf_home) -> Path:
    for build in (tiny_multimodal.build_tiny_llava, tiny_multimodal.build_tiny_t5, tiny_multimodal.build_tiny_whisper):
        build(hf_home)
    return hf_home


def _needs_image_backend() -> None:
    try:
        import PIL  # noqa: F401
    except ImportError:
        pytest.importorskip("torchvision", reason="LLaVA's image processor needs Pillow or torchvision")
        pytest.skip("tiny_multimodal.image() makes a PIL image: needs Pillow")


@pytest.fixture(scope="module")
def vlm(built):
    _needs_image_backend()
    return tiny_multimodal.client_vlm()


@pytest.fixture(scope="module")
def t5(built):
    return tiny_multimodal.client_t5()


@pytest.fixture(scope="module")
def whisper(built):
    return tiny_multimodal.client_whisper()


# --- the checkpoints --------------------------------------------------------------


def _digests(root: Path) -> dict:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file() and not path.name.startswith(".lock")
    }


def test_builders_are_deterministic_and_idempotent(built, tmp_path):
    builders = (tiny_multimodal.build_tiny_llava, tiny_multimodal.build_tiny_t5, tiny_multimodal.build_tiny_whisper)
    for folder in ("a", "b"):
        for build in builders:
            assert build(tmp_path / folder) in (tiny_multimodal.LLAVA_REPO_ID, tiny_multimodal.T5_REPO_ID, tiny_multimodal.WHISPER_REPO_ID)
    first, second = _digests(tmp_path / "a"), _digests(tmp_path / "b")
    assert first == second, [name for name in first if first[name] != second.get(name)]
    # The session's cache holds the very same snapshots (a stale one built by
    # older code would differ here: bump tiny_multimodal.BUILD_FORMAT when a builder changes).
    for repo_id in (tiny_multimodal.LLAVA_REPO_ID, tiny_multimodal.T5_REPO_ID, tiny_multimodal.WHISPER_REPO_ID):
        snap = tiny_multimodal.snapshot_dir(built, repo_id)
        ours = tiny_multimodal.snapshot_dir(tmp_path / "a", repo_id)
        assert snap is not None and snap.name == ours.name
        assert _digests(snap) == _digests(ours), repo_id
    # Built once: a second call leaves every file as it was.
    mtimes = {path: path.stat().st_mtime_ns for path in (tmp_path / "a").rglob("*") if path.is_file()}
    for build in builders:
        build(tmp_path / "a")
    assert mtimes == {path: path.stat().st_mtime_ns for path in (tmp_path / "a").rglob("*") if path.is_file()}


def test_preprocessors_load_offline(built):
    from transformers import AutoConfig, AutoFeatureExtractor, AutoTokenizer

    t5_tokenizer = AutoTokenizer.from_pretrained(tiny_multimodal.T5_REPO_ID)
    assert type(t5_tokenizer).__name__ == "T5Tokenizer"
    assert (t5_tokenizer.pad_token_id, t5_tokenizer.eos_token_id) == (0, 1)
    assert t5_tokenizer(tiny_multimodal.T5_PROMPT).input_ids[-1] == 1
    assert len(t5_tokenizer) == AutoConfig.from_pretrained(tiny_multimodal.T5_REPO_ID).vocab_size

    features = AutoFeatureExtractor.from_pretrained(tiny_multimodal.WHISPER_REPO_ID)(
        tiny_multimodal.waveform(), sampling_rate=tiny_multimodal.SAMPLING_RATE, return_tensors="pt"
    )
    assert features["input_features"].shape == (1, tiny_multimodal.N_MELS, 100)  # 0.5 s padded to a 1 s window
    whisper_tokenizer = AutoTokenizer.from_pretrained(tiny_multimodal.WHISPER_REPO_ID)
    assert type(whisper_tokenizer).__name__ == "WhisperTokenizer"
    sot, notimestamps = whisper_tokenizer.convert_tokens_to_ids(["<|startoftranscript|>", "<|notimestamps|>"])
    assert whisper_tokenizer.prefix_tokens == [sot, notimestamps]
    whisper_tokenizer.set_prefix_tokens(language="en", task="transcribe")
    assert whisper_tokenizer.convert_ids_to_tokens(whisper_tokenizer.prefix_tokens) == [
        "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>",
    ]


def test_llava_processor_loads_offline(built):
    _needs_image_backend()
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_multimodal.LLAVA_REPO_ID)
    assert type(processor).__name__ == "LlavaProcessor"
    encoding = processor(text=tiny_multimodal.LLAVA_PROMPT, images=[tiny_multimodal.image()], return_tensors="pt")
    assert encoding["pixel_values"].shape == (1, 3, tiny_multimodal.IMAGE_SIZE, tiny_multimodal.IMAGE_SIZE)
    assert (encoding["input_ids"] == processor.image_token_id).sum() == tiny_multimodal.IMAGE_TOKENS
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    assert processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
        "USER: <image>\nWhat is it?\nASSISTANT:"
    )


# --- the cases --------------------------------------------------------------------
#
# Each takes the model, the outermost block's kwargs, and its inputs (made
# outside the blocks: a block's globals reach the deserialized copy only if they
# are installed modules, and this test's own modules are not).


@contextlib.contextmanager
def _frozen(model):
    """The client's weights without gradients, as a worker holds them
    (``workers.execute.no_grad_weights``)."""
    params = [param for param in model._module.parameters() if param.requires_grad]
    for param in params:
        param.requires_grad_(False)
    try:
        yield model
    finally:
        for param in params:
            param.requires_grad_(True)


def _assert_close(a: dict, b: dict, label: str) -> None:
    assert a.keys() == b.keys(), label
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=1e-5), f"{label}[{name!r}]"


def _three_ways(case, client, *inputs, exact_with_grad: bool = True) -> dict:
    """The case locally, under remote="local", and on the server's model.

    The first two are exactly equal. The server's model holds its weights
    without gradients, so it is compared exactly with the client's run with
    frozen weights too; and with the client's plain run (weights requiring
    gradients, as a user's are) exactly where ``exact_with_grad``, else to 1e-5:
    T5's attention (SDPA with a float position bias) takes a kernel that differs
    in the last bits when the weights require gradients.
    """
    local = case(client, LOCAL, *inputs)
    assert_same(local, case(client, SIMULATED, *inputs), "local vs remote='local'")
    server = case(_server(client), LOCAL, *inputs)
    if exact_with_grad:
        assert_same(local, server, "client vs the model built from its key")
        return local
    _assert_close(local, server, "client vs the model built from its key")
    with _frozen(client):
        frozen = case(client, LOCAL, *inputs)
    assert_same(frozen, server, "client (frozen weights) vs the model built from its key")
    return local


_SERVERS: dict = {}


def _server(client):
    """The model a server builds from ``client``'s key, built once per key."""
    key = client.to_model_key()
    if key not in _SERVERS:
        _SERVERS[key] = tiny_multimodal.server_model(client)
    return _SERVERS[key]


@pytest.mark.parametrize("client", ["vlm", "t5", "whisper"])
def test_an_isolated_worker_builds_the_same_skeleton(client, request):
    """What the isolation zygote does (``workers.isolation.zygote``): the key built
    on meta with the resident model's preprocessors and config has the resident
    model's modules. (Without the preprocessors the meta build fails offline:
    "Impossible to guess which tokenizer/processor to use", for the tiny GPT-2 too.)"""
    import pickle

    from nnsight.modeling.mixins.remotable import Remotable
    from workers.isolation.zygote import _PREPROCESSORS

    resident = _server(request.getfixturevalue(client))
    kwargs = {name: getattr(resident, name) for name in _PREPROCESSORS if getattr(resident, name, None) is not None}
    kwargs = pickle.loads(pickle.dumps({**kwargs, "config": resident._module.config}))  # as the header travels
    skeleton = Remotable.from_model_key(resident.to_model_key(), dispatch=False, **kwargs)
    assert [path for path, _ in skeleton._module.named_modules()] == [
        path for path, _ in resident._module.named_modules()
    ]


# --- LLaVA ------------------------------------------------------------------------


def test_vlm_key_and_class(vlm):
    from nnsight import NNsightDeprecationWarning
    from nnsight.modeling.vlm import VisionLanguageModel

    key = KEY + json.dumps({"repo_id": tiny_multimodal.LLAVA_REPO_ID, "revision": None, "task": "image-text-to-text"})
    assert vlm.to_model_key() == key
    assert type(vlm._module).__name__ == "LlavaForConditionalGeneration"
    assert type(vlm.processor).__name__ == "LlavaProcessor"
    # The deprecated class is a name for the same deployment.
    with pytest.warns(NNsightDeprecationWarning):
        alias = VisionLanguageModel(tiny_multimodal.LLAVA_REPO_ID, processor=vlm.processor)
    assert alias.to_model_key() == key


def test_vlm_traces_with_an_image(vlm):
    prompt = tiny_multimodal.LLAVA_PROMPT
    n_tokens = len(vlm.processor(text=prompt, images=[tiny_multimodal.image()])["input_ids"][0])
    r = _three_ways(tiny_multimodal.vlm_case, vlm, tiny_multimodal.image(), prompt)

    assert r["vision"].shape == (1, tiny_multimodal.IMAGE_TOKENS + 1, 32)  # the patches and CLS
    assert r["projected"].shape == (1, tiny_multimodal.IMAGE_TOKENS, 32)
    assert r["layer0"].shape == (1, n_tokens, 32) and r["layer0"][:, -1].abs().sum() > 0
    assert torch.equal(r["edited"][:, -1], torch.zeros(1, 32))
    assert torch.equal(r["logits"][:, :-1], r["clean_logits"][:, :-1])  # a causal model: earlier positions kept
    assert not torch.equal(r["logits"][:, -1], r["clean_logits"][:, -1])
    assert torch.equal(r["generated_vision"], r["vision"])
    assert r["ids"].shape == (1, n_tokens + 3)
    assert r["ids"][0, n_tokens] == r["clean_logits"][0, -1].argmax()
    assert r["forced"][0, n_tokens:].tolist() == [tiny_multimodal.FORCED] * 3


def test_vlm_image_changes_the_text_stream(vlm):
    with vlm.trace(tiny_multimodal.LLAVA_PROMPT, images=[tiny_multimodal.image(0)]):
        first = vlm.model.language_model.layers[0].output.save()
    with vlm.trace(tiny_multimodal.LLAVA_PROMPT, images=[tiny_multimodal.image(1)]):
        second = vlm.model.language_model.layers[0].output.save()
    assert not torch.equal(first, second)


# --- T5 ---------------------------------------------------------------------------


def test_t5_key_and_class(t5):
    assert t5.to_model_key() == KEY + json.dumps(
        {"repo_id": tiny_multimodal.T5_REPO_ID, "revision": None, "task": "feature-extraction"}
    )
    assert type(t5._module).__name__ == "T5Model"


def test_t5_traces_encoder_and_decoder(t5):
    input_ids = t5.tokenizer(tiny_multimodal.T5_PROMPT, return_tensors="pt").input_ids
    decoder_input_ids = torch.tensor([[0, 5, 9]])
    r = _three_ways(tiny_multimodal.t5_case, t5, input_ids, decoder_input_ids, exact_with_grad=False)
    assert r["encoder0"].shape == (1, input_ids.shape[1], 32)
    assert r["encoder_out"].shape == (1, input_ids.shape[1], 32)
    assert r["decoder0"].shape == (1, 3, 32) and r["decoder0"].abs().sum() > 0
    assert not torch.equal(r["edited"], r["clean"])


def test_t5_generates_through_a_wrapped_module(built, t5):
    """``T5ForConditionalGeneration`` generates through a client that wraps the loaded
    module; its key names ``text-generation``, which a worker's resident load
    serves (the pipeline falls back to the config's architecture) and reproduces,
    but which no meta build can take (``AutoModelForCausalLM`` has no T5): not a
    client by repo id, not an isolated worker's skeleton."""
    from nnsight.modeling.mixins.remotable import Remotable

    generative = tiny_multimodal.client_t5_generative()
    assert type(generative._module).__name__ == "T5ForConditionalGeneration"
    assert generative.to_model_key() == KEY + json.dumps(
        {"repo_id": tiny_multimodal.T5_REPO_ID, "revision": None, "task": "text-generation"}
    )
    input_ids = generative.tokenizer(tiny_multimodal.T5_PROMPT, return_tensors="pt").input_ids
    decoder_input_ids = torch.tensor([[0, 5, 9]])

    r = _three_ways(tiny_multimodal.t5_generative_case, generative, input_ids, decoder_input_ids, exact_with_grad=False)
    assert r["ids"].shape == (1, 4) and r["ids"][0, 0] == 0  # the decoder start, then 3 tokens
    assert r["forced"][0, 1:].tolist() == [tiny_multimodal.FORCED] * 3
    # The same encoder and decoder as the servable T5Model.
    servable = tiny_multimodal.t5_case(t5, LOCAL, input_ids, decoder_input_ids)
    assert_same(servable, {name: r[name] for name in servable})

    with pytest.raises(ValueError, match="AutoModelForCausalLM"):
        Remotable.from_model_key(generative.to_model_key(), dispatch=False, tokenizer=generative.tokenizer)
    with pytest.raises(AttributeError, match="generate"):  # the servable T5Model cannot generate
        with t5.generate(input_ids, max_new_tokens=3):
            pass


# --- Whisper ----------------------------------------------------------------------


def test_whisper_key_and_class(whisper):
    assert whisper.to_model_key() == KEY + json.dumps(
        {"repo_id": tiny_multimodal.WHISPER_REPO_ID, "revision": None, "task": "automatic-speech-recognition"}
    )
    assert type(whisper._module).__name__ == "WhisperForConditionalGeneration"


def test_whisper_traces_a_waveform(whisper):
    prefix = torch.tensor([whisper.tokenizer.prefix_tokens])  # <|startoftranscript|><|notimestamps|>
    r = _three_ways(tiny_multimodal.whisper_case, whisper, tiny_multimodal.waveform(), prefix)
    assert r["encoder0"].shape == (1, 50, 32)  # 100 mel frames, halved by the second conv
    assert r["decoder0"].shape == (1, 2, 32)
    assert torch.equal(r["logits"][:, :-1], r["clean_logits"][:, :-1])
    assert not torch.equal(r["logits"][:, -1], r["clean_logits"][:, -1])
    assert torch.equal(r["generated_encoder"], r["encoder0"])
    assert r["ids"].shape == (1, 3)  # Whisper's generate returns the new tokens only
    assert r["forced"].tolist() == [[tiny_multimodal.FORCED] * 3]


def test_whisper_features_are_the_waveform(whisper):
    """A raw waveform and its features (``input_features=``) trace the same."""
    prefix = torch.tensor([whisper.tokenizer.prefix_tokens])
    features = whisper.feature_extractor(tiny_multimodal.waveform(), sampling_rate=tiny_multimodal.SAMPLING_RATE, return_tensors="pt")
    with whisper.trace(tiny_multimodal.waveform(), decoder_input_ids=prefix):
        from_audio = whisper.proj_out.output.save()
    with whisper.trace(input_features=features["input_features"], decoder_input_ids=prefix):
        from_features = whisper.proj_out.output.save()
    assert torch.equal(from_audio, from_features)
