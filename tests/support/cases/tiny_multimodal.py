"""Tiny, fully offline multimodal and encoder-decoder checkpoints for the tests.

The companions of `tests.support.cases.tiny_model`'s GPT-2, laid out the same way
(``<hf_home>/hub/models--ORG--NAME/refs/main`` + ``snapshots/<rev>/...``), each a
random model (deterministic given the seed) with preprocessors built here, so
``AutoProcessor`` / ``AutoTokenizer`` / ``AutoFeatureExtractor`` and the model
load by repo id with ``HF_HOME=<hf_home>`` and ``HF_HUB_OFFLINE=1``:

* ``build_tiny_llava``   LLaVA (``LlavaForConditionalGeneration``): a 2-layer CLIP
  vision tower on 16x16 images in 8x8 patches (4 image tokens), a 2-layer Llama
  text model, and a ``LlavaProcessor`` (CLIP image processor + tiny_model's BPE
  tokenizer with an ``<image>`` token, and a chat template);
* ``build_tiny_t5``      T5 (``T5ForConditionalGeneration``), 2+2 layers, d_model 32,
  with a T5 (Unigram) tokenizer over tiny_model's corpus;
* ``build_tiny_whisper`` Whisper (``WhisperForConditionalGeneration``), 2+2 layers,
  d_model 32, 80 mel bins on 1-second windows (``max_source_positions`` 50, so a
  0.5 s clip is padded to 100 frames, not 3,000), and a ``WhisperProcessor``
  (feature extractor + tiny_model's BPE vocabulary with Whisper's special tokens).

Each builder is idempotent and safe against concurrent builders (file lock,
private temporary folder, one atomic rename), like ``build_tiny_gpt2``, and
returns the repo id. ``client_vlm`` / ``client_t5`` / ``client_whisper`` build
the nnsight 0.8.1 client models offline (``TransformersModel`` with tasks
``image-text-to-text``, ``feature-extraction`` and ``automatic-speech-recognition``:
see each, and `T5_TASK` for why T5's is not a generating one);
``client_t5_generative`` wraps a loaded T5 that can ``generate``; ``server_model``
is the model a worker builds from a client's key.

The image processor needs Pillow or torchvision at run time (transformers 5 has
no other image backend); the builders themselves need neither.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from tests.support.cases.tiny_model import CORPUS, EOS, _repo_dir, _revision, _train_tokenizer

LLAVA_REPO_ID = "ndif-celery/tiny-llava"
T5_REPO_ID = "ndif-celery/tiny-t5"
WHISPER_REPO_ID = "ndif-celery/tiny-whisper"

# LLaVA: image side, patch side -> (16 // 8) ** 2 = 4 image tokens per image (the
# vision tower's CLS position is dropped: vision_feature_select_strategy "default").
IMAGE_SIZE = 16
PATCH_SIZE = 8
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
IMAGE_TOKEN = "<image>"
LLAVA_VOCAB = 512  # the BPE's 511 tokens + <image> (id 511)
LLAVA_PROMPT = "USER: <image>\nWhat is in the city of Paris? ASSISTANT:"

# Whisper: one-second windows at 16 kHz.
SAMPLING_RATE = 16000
CHUNK_SECONDS = 1
HOP_LENGTH = 160
N_MELS = 80
# The special tokens a Whisper tokenizer and generate look up, in Whisper's order
# (``<|en|>`` must follow ``<|startoftranscript|>``: the tokenizer finds language
# tokens at start + 1 + index in its table, where English is index 0).
WHISPER_SPECIALS = [
    "<|startoftranscript|>", "<|en|>", "<|translate|>", "<|transcribe|>",
    "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>",
]

T5_PROMPT = "translate English to French: The Eiffel Tower is in the city of"

# A user/assistant chat template with an image slot (content either a string or
# a list of {"type": "image"} / {"type": "text", "text": ...} parts). The newline
# after a message is written as an expression: transformers renders templates with
# trim_blocks, which drops a newline that follows a block tag.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'].upper() }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


# --------------------------------------------------------------------------------
# Snapshots: where a build lives, and publishing one atomically
# --------------------------------------------------------------------------------


_REQUIRED = {
    LLAVA_REPO_ID: ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json", "processor_config.json"),
    T5_REPO_ID: ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"),
    WHISPER_REPO_ID: ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                      "tokenizer_config.json", "processor_config.json"),
}
_COMMON = ("config.json", "model.safetensors", "tokenizer.json")


def snapshot_dir(hf_home: Path, repo_id: str) -> Path | None:
    """The built snapshot folder for ``repo_id``, or None if not (fully) built."""
    repo = _repo_dir(Path(hf_home), repo_id)
    ref = repo / "refs" / "main"
    if not ref.is_file():
        return None
    snap = repo / "snapshots" / ref.read_text().strip()
    if all((snap / name).is_file() for name in _REQUIRED.get(repo_id, _COMMON)):
        return snap
    return None


# Part of every snapshot's name (its "revision"): bump it when a builder changes
# what it writes, so a cache built by the old code (tests/_out/hf persists) is
# not mistaken for the new one.
BUILD_FORMAT = 1


def _build(hf_home: Path, repo_id: str, params: dict, write: Callable[..., None]) -> str:
    """Build ``repo_id`` once with ``write(snapshot_dir, **params)``; return the repo id.

    The same protocol as ``build_tiny_gpt2``: a file lock serialises builders, the
    snapshot is written to a private temporary folder and moved into place with
    one atomic ``rename``, an existing entry is left untouched, and the snapshot's
    name (the "revision") is a hash of ``params`` and `BUILD_FORMAT`.
    """
    hf_home = Path(hf_home)
    if snapshot_dir(hf_home, repo_id) is not None:
        return repo_id
    hub = hf_home / "hub"
    hub.mkdir(parents=True, exist_ok=True)
    repo = _repo_dir(hf_home, repo_id)
    with open(hub / f".lock-{repo.name}", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if snapshot_dir(hf_home, repo_id) is not None:
                return repo_id
            rev = _revision(repo_id, {**params, "format": BUILD_FORMAT})
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{repo.name}-", dir=hub))
            tmp.chmod(0o755)  # mkdtemp makes it owner-only; servers may run as others
            try:
                write(tmp / "snapshots" / rev, **params)
                (tmp / "refs").mkdir()
                (tmp / "refs" / "main").write_text(rev)
                for path in tmp.rglob("*"):  # readable by a server under another uid
                    path.chmod(0o755 if path.is_dir() else 0o644)
                if repo.exists():  # a half-built leftover from a killed run
                    shutil.rmtree(repo)
                os.rename(tmp, repo)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    assert snapshot_dir(hf_home, repo_id) is not None, f"building {repo_id} under {hf_home} failed"
    return repo_id


def _seeded(seed: int, make: Callable[[], Any]) -> Any:
    """``make()`` under ``torch.manual_seed(seed)``, the caller's RNG untouched."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make()
    model.eval()
    return model


# --------------------------------------------------------------------------------
# LLaVA
# --------------------------------------------------------------------------------


def _write_llava(snap: Path, *, hidden: int, n_layer: int, n_head: int, seed: int) -> None:
    from transformers import (
        CLIPVisionConfig, GenerationConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = _train_tokenizer(LLAVA_VOCAB - 1)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    if len(tokenizer) != LLAVA_VOCAB or image_id != LLAVA_VOCAB - 1:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens and {IMAGE_TOKEN} at {image_id}")
    ids = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=hidden, intermediate_size=2 * hidden, projection_dim=hidden,
            num_hidden_layers=n_layer, num_attention_heads=n_head,
            image_size=IMAGE_SIZE, patch_size=PATCH_SIZE,
        ),
        text_config=LlamaConfig(
            vocab_size=LLAVA_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_head // 2,
            max_position_embeddings=128, **ids,
        ),
        image_token_index=image_id,
        image_seq_length=IMAGE_TOKENS,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        **ids,
    )
    model = _seeded(seed, lambda: LlavaForConditionalGeneration(config))
    model.save_pretrained(snap, safe_serialization=True)
    GenerationConfig(do_sample=False, **ids).save_pretrained(snap)
    # The PIL-backed class needs no PIL to construct or save; AutoImageProcessor
    # picks the backend (torchvision or Pillow) when it loads.
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    )
    LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", chat_template=LLAVA_CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN, num_additional_image_tokens=1,
    ).save_pretrained(snap)


def build_tiny_llava(hf_home: Path, repo_id: str = LLAVA_REPO_ID, hidden: int = 32, n_layer: int = 2,
                     n_head: int = 4, seed: int = 0) -> str:
    """Build (once) the tiny LLaVA under ``hf_home``; return its repo id."""
    params = dict(hidden=hidden, n_layer=n_layer, n_head=n_head, seed=seed)
    return _build(hf_home, repo_id, params, _write_llava)


# --------------------------------------------------------------------------------
# T5
# --------------------------------------------------------------------------------


def _t5_tokenizer(vocab_size: int, extra_ids: int) -> Any:
    """A T5 tokenizer (Unigram, ``<pad>``=0, ``</s>``=1, ``<unk>``=2, then the pieces,
    then ``extra_ids`` sentinels) over CORPUS.

    The pieces are counted here rather than trained: the tokenizers library's
    ``UnigramTrainer`` is not deterministic (its pieces' order and last-bit scores
    change from run to run, even single-threaded). Every character of the corpus,
    then the substrings of its ``▁``-prefixed words seen more than once, most
    characters covered first; each scored by its log frequency.
    """
    import math
    from collections import Counter

    from transformers import T5Tokenizer

    words = Counter("▁" + word for line in [T5_PROMPT, *CORPUS] for word in line.split())
    counts: Counter = Counter()
    for word, n in words.items():
        for i in range(len(word)):
            for j in range(i + 1, min(len(word), i + 12) + 1):
                counts[word[i:j]] += n
    chars = sorted(piece for piece in counts if len(piece) == 1)
    longer = sorted((p for p in counts if len(p) > 1 and counts[p] > 1), key=lambda p: (-counts[p] * len(p), p))
    pieces = chars + longer[: vocab_size - extra_ids - 3 - len(chars)]
    total = sum(counts[piece] for piece in pieces)
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(piece, math.log(counts[piece] / total)) for piece in pieces]
    vocab += [(f"<extra_id_{i}>", 0.0) for i in reversed(range(extra_ids))]
    return T5Tokenizer(vocab=vocab, extra_ids=extra_ids, model_max_length=128)


def _write_t5(snap: Path, *, d_model: int, n_layer: int, n_head: int, vocab_size: int, seed: int) -> None:
    from transformers import GenerationConfig, T5Config, T5ForConditionalGeneration

    tokenizer = _t5_tokenizer(vocab_size, extra_ids=4)
    if len(tokenizer) != vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, over vocab_size={vocab_size}")
    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
           "decoder_start_token_id": tokenizer.pad_token_id}
    config = T5Config(
        vocab_size=vocab_size, d_model=d_model, d_kv=d_model // n_head, d_ff=2 * d_model,
        num_layers=n_layer, num_decoder_layers=n_layer, num_heads=n_head,
        relative_attention_num_buckets=8, relative_attention_max_distance=32,
        dropout_rate=0.0, feed_forward_proj="relu", **ids,
    )
    model = _seeded(seed, lambda: T5ForConditionalGeneration(config))
    model.save_pretrained(snap, safe_serialization=True)
    GenerationConfig(do_sample=False, **ids).save_pretrained(snap)
    tokenizer.save_pretrained(snap)


def build_tiny_t5(hf_home: Path, repo_id: str = T5_REPO_ID, d_model: int = 32, n_layer: int = 2,
                  n_head: int = 4, vocab_size: int = 256, seed: int = 0) -> str:
    """Build (once) the tiny T5 under ``hf_home``; return its repo id."""
    params = dict(d_model=d_model, n_layer=n_layer, n_head=n_head, vocab_size=vocab_size, seed=seed)
    return _build(hf_home, repo_id, params, _write_t5)


# --------------------------------------------------------------------------------
# Whisper
# --------------------------------------------------------------------------------


def _whisper_tokenizer(vocab_size: int) -> Any:
    """tiny_model's byte-level BPE as a ``WhisperTokenizer``, plus Whisper's specials."""
    from tokenizers import AddedToken
    from transformers import WhisperTokenizer

    bpe = json.loads(_train_tokenizer(vocab_size).backend_tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in bpe["merges"]]
    tokenizer = WhisperTokenizer(vocab=bpe["vocab"], merges=merges, model_max_length=64)
    tokenizer.add_special_tokens({
        "additional_special_tokens": [AddedToken(t, special=True, normalized=False) for t in WHISPER_SPECIALS]
    })
    return tokenizer


def _write_whisper(snap: Path, *, d_model: int, n_layer: int, n_head: int, seed: int) -> None:
    from transformers import (
        GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration,
        WhisperProcessor,
    )

    tokenizer = _whisper_tokenizer(512 - len(WHISPER_SPECIALS))
    vocab_size = len(tokenizer)
    special = {t: tokenizer.convert_tokens_to_ids(t) for t in [EOS, *WHISPER_SPECIALS]}
    eot, sot = special[EOS], special["<|startoftranscript|>"]
    if special["<|en|>"] != sot + 1:
        raise ValueError(f"Whisper's special tokens are out of order: {special}")
    frames = CHUNK_SECONDS * SAMPLING_RATE // HOP_LENGTH  # mel frames per window
    config = WhisperConfig(
        vocab_size=vocab_size, num_mel_bins=N_MELS, d_model=d_model,
        encoder_layers=n_layer, encoder_attention_heads=n_head, encoder_ffn_dim=2 * d_model,
        decoder_layers=n_layer, decoder_attention_heads=n_head, decoder_ffn_dim=2 * d_model,
        max_source_positions=frames // 2, max_target_positions=64,
        pad_token_id=eot, bos_token_id=eot, eos_token_id=eot, decoder_start_token_id=sot,
        begin_suppress_tokens=None, suppress_tokens=None,
    )
    model = _seeded(seed, lambda: WhisperForConditionalGeneration(config))
    model.save_pretrained(snap, safe_serialization=True)
    GenerationConfig(
        do_sample=False, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, decoder_start_token_id=sot,
        max_length=64, is_multilingual=False, no_timestamps_token_id=special["<|notimestamps|>"],
        forced_decoder_ids=None, begin_suppress_tokens=None, suppress_tokens=None,
    ).save_pretrained(snap)
    feature_extractor = WhisperFeatureExtractor(
        feature_size=N_MELS, sampling_rate=SAMPLING_RATE, hop_length=HOP_LENGTH, chunk_length=CHUNK_SECONDS,
    )
    WhisperProcessor(feature_extractor=feature_extractor, tokenizer=tokenizer).save_pretrained(snap)


def build_tiny_whisper(hf_home: Path, repo_id: str = WHISPER_REPO_ID, d_model: int = 32, n_layer: int = 2,
                       n_head: int = 4, seed: int = 0) -> str:
    """Build (once) the tiny Whisper under ``hf_home``; return its repo id."""
    params = dict(d_model=d_model, n_layer=n_layer, n_head=n_head, seed=seed)
    return _build(hf_home, repo_id, params, _write_whisper)


def waveform(seconds: float = 0.5, seed: int = 0) -> Any:
    """A short synthetic recording: a 440 Hz tone plus a little noise, float32 at 16 kHz."""
    import numpy as np

    t = np.arange(int(seconds * SAMPLING_RATE)) / SAMPLING_RATE
    noise = np.random.default_rng(seed).standard_normal(t.shape)
    return (0.5 * np.sin(2 * np.pi * 440.0 * t) + 0.05 * noise).astype(np.float32)


def image(seed: int = 0) -> Any:
    """A small random RGB PIL image (needs Pillow), resized by the processor to 16x16."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(24, 24, 3), dtype=np.uint8)
    return Image.fromarray(pixels, mode="RGB")


# --------------------------------------------------------------------------------
# Client models
# --------------------------------------------------------------------------------


def _seed_id(repo_id: str) -> None:
    import nnsight.modeling.huggingface as hf

    hf._ID_CACHE[repo_id] = repo_id  # to_model_key() would otherwise ask the hub


def client_vlm(repo_id: str = LLAVA_REPO_ID, **kwargs: Any):
    """The nnsight client ``TransformersModel`` on the tiny LLaVA, task
    ``image-text-to-text`` (what ``VisionLanguageModel`` pins, without its
    deprecation warning), with a preloaded ``processor``."""
    from nnsight.modeling.transformers import TransformersModel
    from transformers import AutoProcessor

    _seed_id(repo_id)
    kwargs.setdefault("task", "image-text-to-text")
    if "processor" not in kwargs:
        kwargs["processor"] = AutoProcessor.from_pretrained(repo_id)
    return TransformersModel(repo_id, **kwargs)


# transformers 5 removed the ``text2text-generation`` pipeline (and ``summarization`` /
# ``translation``), and no remaining task loads ``AutoModelForSeq2SeqLM``:
# ``text-generation`` builds ``AutoModelForCausalLM``, which has no T5. So the one
# task that loads this checkpoint by repo id -- the form a server rebuilds from a
# model key -- is ``feature-extraction`` (``AutoModel``: ``T5Model``, the encoder and
# decoder stacks without ``lm_head``, so no ``generate``).
T5_TASK = "feature-extraction"


def client_t5(repo_id: str = T5_REPO_ID, **kwargs: Any):
    """The nnsight client ``TransformersModel`` on the tiny T5, task
    ``feature-extraction`` (``T5Model``, see `T5_TASK`), with a preloaded tokenizer.

    A forward needs decoder inputs: trace it in model terms,
    ``model.trace(input_ids=..., decoder_input_ids=...)`` (a text prompt goes
    through the pipeline's preprocess, which drops ``decoder_input_ids=``)."""
    from nnsight.modeling.transformers import TransformersModel

    _seed_id(repo_id)
    kwargs.setdefault("task", T5_TASK)
    if "tokenizer" not in kwargs:
        from transformers import AutoTokenizer

        kwargs["tokenizer"] = AutoTokenizer.from_pretrained(repo_id)
    return TransformersModel(repo_id, **kwargs)


def client_t5_generative(repo_id: str = T5_REPO_ID, **kwargs: Any):
    """An nnsight model on the tiny ``T5ForConditionalGeneration`` that can
    ``generate``: the loaded module wrapped (weights here), task inferred as
    ``text-generation``. It traces and generates locally and under
    ``remote="local"``. Its key names ``text-generation``: a worker's resident load
    (``dispatch=True``) serves it (the pipeline falls back to the config's
    architecture, logging that T5 "is not supported for text-generation"), but no
    meta build takes it (``AutoModelForCausalLM`` has no T5), so neither a client
    by repo id nor an isolated worker's skeleton (the zygote) can be made from it."""
    from nnsight.modeling.transformers import TransformersModel
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    _seed_id(repo_id)
    module = AutoModelForSeq2SeqLM.from_pretrained(repo_id)
    module.eval()
    if "tokenizer" not in kwargs:
        kwargs["tokenizer"] = AutoTokenizer.from_pretrained(repo_id)
    return TransformersModel(module, **kwargs)


def client_whisper(repo_id: str = WHISPER_REPO_ID, **kwargs: Any):
    """The nnsight client ``TransformersModel`` on the tiny Whisper, task
    ``automatic-speech-recognition``, with a preloaded tokenizer and feature extractor.

    A forward needs decoder inputs: ``model.trace(waveform,
    decoder_input_ids=torch.tensor([model.tokenizer.prefix_tokens]))``."""
    from nnsight.modeling.transformers import TransformersModel
    from transformers import AutoFeatureExtractor, AutoTokenizer

    _seed_id(repo_id)
    kwargs.setdefault("task", "automatic-speech-recognition")
    if "tokenizer" not in kwargs:
        kwargs["tokenizer"] = AutoTokenizer.from_pretrained(repo_id)
    if "feature_extractor" not in kwargs:
        kwargs["feature_extractor"] = AutoFeatureExtractor.from_pretrained(repo_id)
    return TransformersModel(repo_id, **kwargs)


def server_model(client: Any):
    """The model a server builds from ``client``'s key (``Remotable.from_model_key``,
    dispatched, no gradients), as ``tiny_model.worker_loaded`` does. Only a
    dispatched load works offline without preprocessors passed in: the meta build
    (``dispatch=False``) refuses with "Impossible to guess which tokenizer/processor
    to use"."""
    from nnsight.modeling.mixins.remotable import Remotable

    model = Remotable.from_model_key(client.to_model_key(), dispatch=True)
    model._module.requires_grad_(False)
    return model


# --- one case per model: what the tests run locally and remotely -------------------------

#: A token an edit of the logits forces at every generated step.
FORCED = 7


def vlm_case(model, remote: dict, image, prompt: str) -> dict:
    """Reads of the vision tower, projector and a text layer, an in-place edit, two generations."""
    with model.trace(prompt, images=[image], **remote):
        clean_logits = model.lm_head.output.save()
    with model.trace(prompt, images=[image], **remote):
        vision = model.model.vision_tower.encoder.layers[0].output.save()
        projected = model.model.multi_modal_projector.output.save()
        layer0 = model.model.language_model.layers[0].output.clone().save()
        model.model.language_model.layers[0].output[:, -1] = 0
        edited = model.model.language_model.layers[0].output.save()
        logits = model.lm_head.output.save()
    with model.generate(prompt, images=[image], max_new_tokens=3, **remote) as tracer:
        generated_vision = model.model.vision_tower.encoder.layers[0].output.save()
        ids = tracer.result.save()
    with model.generate(prompt, images=[image], max_new_tokens=3, **remote) as tracer:
        for _ in tracer.iter[0:3]:
            model.lm_head.output[:, -1, FORCED] = 1e4
        forced = tracer.result.save()
    return dict(clean_logits=clean_logits, vision=vision, projected=projected, layer0=layer0, edited=edited,
                logits=logits, generated_vision=generated_vision, ids=ids, forced=forced)


def t5_case(model, remote: dict, input_ids, decoder_input_ids) -> dict:
    """Reads of the encoder and decoder, and an in-place edit of a decoder block."""
    with model.trace(input_ids=input_ids, decoder_input_ids=decoder_input_ids, **remote):
        clean = model.decoder.final_layer_norm.output.save()
    with model.trace(input_ids=input_ids, decoder_input_ids=decoder_input_ids, **remote):
        encoder0 = model.encoder.block[0].output[0].save()
        encoder_out = model.encoder.final_layer_norm.output.save()
        decoder0 = model.decoder.block[0].output[0].clone().save()
        model.decoder.block[0].output[0][:] = 0
        edited = model.decoder.final_layer_norm.output.save()
    return dict(clean=clean, encoder0=encoder0, encoder_out=encoder_out, decoder0=decoder0, edited=edited)


def t5_generative_case(model, remote: dict, input_ids, decoder_input_ids) -> dict:
    results = t5_case(model, remote, input_ids, decoder_input_ids)
    with model.trace(input_ids=input_ids, decoder_input_ids=decoder_input_ids, **remote):
        results["logits"] = model.lm_head.output.save()
    with model.generate(input_ids, max_new_tokens=3, **remote) as tracer:
        results["generated_encoder"] = model.encoder.block[0].output[0].save()
        results["ids"] = tracer.result.save()
    with model.generate(input_ids, max_new_tokens=3, **remote) as tracer:
        for _ in tracer.iter[0:3]:
            model.lm_head.output[:, -1, FORCED] = 1e4
        results["forced"] = tracer.result.save()
    return results


def whisper_case(model, remote: dict, audio, decoder_input_ids) -> dict:
    """Reads of the encoder and decoder from a waveform, an in-place edit, two generations."""
    with model.trace(audio, decoder_input_ids=decoder_input_ids, **remote):
        clean_logits = model.proj_out.output.save()
    with model.trace(audio, decoder_input_ids=decoder_input_ids, **remote):
        encoder0 = model.model.encoder.layers[0].output.save()
        encoder_out = model.model.encoder.layer_norm.output.save()
        decoder0 = model.model.decoder.layers[0].output.clone().save()
        model.model.decoder.layers[0].output[:, -1] = 0
        logits = model.proj_out.output.save()
    with model.generate(audio, max_new_tokens=3, **remote) as tracer:
        generated_encoder = model.model.encoder.layers[0].output.save()
        ids = tracer.result.save()
    with model.generate(audio, max_new_tokens=3, **remote) as tracer:
        for _ in tracer.iter[0:3]:
            model.proj_out.output[:, -1, FORCED] = 1e4
        forced = tracer.result.save()
    return dict(clean_logits=clean_logits, encoder0=encoder0, encoder_out=encoder_out, decoder0=decoder0,
                logits=logits, generated_encoder=generated_encoder, ids=ids, forced=forced)
