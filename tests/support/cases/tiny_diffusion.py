"""A tiny, fully offline Stable-Diffusion-style pipeline for the test suite.

``build_tiny_diffusion(hf_home)`` builds (once) a ``StableDiffusionPipeline`` of
random, seeded weights -- a tiny ``UNet2DConditionModel``, ``AutoencoderKL`` and
``CLIPTextModel``, a ``CLIPTokenizer`` over a small byte-level BPE vocabulary
learned here from a built-in corpus, and a ``DDIMScheduler``; no safety checker
or feature extractor -- saved with ``save_pretrained`` as a hub-cache entry::

    <hf_home>/hub/models--ndif-celery--tiny-sd/refs/main          -> <40-hex revision>
    <hf_home>/hub/models--ndif-celery--tiny-sd/snapshots/<rev>/   model_index.json,
        unet/ vae/ text_encoder/ tokenizer/ scheduler/

so ``DiffusionPipeline.from_pretrained(DIFFUSION_REPO_ID)`` and nnsight's
``DiffusionModel`` (``client_diffusion``) load it by repo id with
``HF_HOME=<hf_home>`` and ``HF_HUB_OFFLINE=1`` (set before huggingface_hub is
imported, as ``tests/conftest.py`` does for the suite).

Images are ``SAMPLE_SIZE * 2`` pixels square (the VAE has two blocks, so one
downsampling); latents are ``[rows, 4, SAMPLE_SIZE, SAMPLE_SIZE]`` and the text
embeddings ``[rows, MAX_LENGTH, CROSS_DIM]``. The tokenizer folder holds
``tokenizer.json`` and ``tokenizer_config.json`` (what transformers 5's
``CLIPTokenizer.save_pretrained`` writes; no vocab.json / merges.txt).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tests.support.cases.tiny_model import _repo_dir, _revision

DIFFUSION_REPO_ID = "ndif-celery/tiny-sd"

SAMPLE_SIZE = 8  # the UNet's latent side; images are twice that
LATENT_CHANNELS = 4
CROSS_DIM = 16  # the text encoder's hidden size = the UNet's cross_attention_dim
MAX_LENGTH = 16  # the tokenizer pads / truncates every prompt to this many tokens
N_MERGES = 64  # BPE merges learned from CORPUS on top of the 512 byte tokens

# Part of the snapshot's name: bump it when _write_snapshot changes what it writes,
# so a cache built by an older version is not taken for the new one.
BUILD_FORMAT = 1

DIFFUSION_PROMPT = "a photo of a cat"
DIFFUSION_PROMPTS = [DIFFUSION_PROMPT, "a red tower in the city"]

BOS = "<|startoftext|>"
EOS = "<|endoftext|>"

CORPUS = [
    *DIFFUSION_PROMPTS,
    "a photo of a dog sitting on a mat",
    "a painting of a red tower in the city at night",
    "an astronaut riding a horse on the moon",
    "a cat and a dog in the garden",
    "a photo of the eiffel tower in paris",
]

# What a finished snapshot holds (written last: model_index.json).
_REQUIRED = (
    "model_index.json",
    "unet/config.json",
    "unet/diffusion_pytorch_model.safetensors",
    "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors",
    "text_encoder/config.json",
    "text_encoder/model.safetensors",
    "tokenizer/tokenizer_config.json",
    "scheduler/scheduler_config.json",
)


def diffusion_snapshot_dir(hf_home: Path, repo_id: str = DIFFUSION_REPO_ID) -> Path | None:
    """The built snapshot folder for ``repo_id``, or None if not (fully) built."""
    repo = _repo_dir(hf_home, repo_id)
    ref = repo / "refs" / "main"
    if not ref.is_file():
        return None
    snap = repo / "snapshots" / ref.read_text().strip()
    if all((snap / name).is_file() for name in _REQUIRED):
        return snap
    return None


# --- the tokenizer: CLIP's byte-level BPE, learned here ------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's byte -> printable-character table (the byte-level alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _clip_vocab(n_merges: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's vocabulary layout: 256 byte characters, the same with ``</w>`` (end
    of word), the learned merges' tokens, then ``BOS`` and ``EOS``. The merges are
    learned by plain BPE over ``CORPUS``'s lowercased words (most frequent pair
    first, ties broken by the pair itself), so the result is a pure function of
    the corpus."""
    byte_chars = list(_bytes_to_unicode().values())
    vocab_list = byte_chars + [c + "</w>" for c in byte_chars]
    table = _bytes_to_unicode()
    words: dict[tuple[str, ...], int] = {}
    for line in CORPUS:
        for word in line.lower().split():
            chars = [table[b] for b in word.encode("utf-8")]
            chars[-1] += "</w>"
            words[tuple(chars)] = words.get(tuple(chars), 0) + 1
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: dict[tuple[str, str], int] = {}
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] = pairs.get(pair, 0) + count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        vocab_list.append(best[0] + best[1])
        merged: dict[tuple[str, ...], int] = {}
        for word, count in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + count
        words = merged
    vocab_list += [BOS, EOS]
    return {token: i for i, token in enumerate(vocab_list)}, merges


# --- the pipeline ---------------------------------------------------------------------


def _write_snapshot(snap: Path, seed: int, n_merges: int, max_length: int) -> None:
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab, merges = _clip_vocab(n_merges)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)
    text_config = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=CROSS_DIM,
        intermediate_size=2 * CROSS_DIM,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=max_length,
        projection_dim=CROSS_DIM,
        bos_token_id=vocab[BOS],
        eos_token_id=vocab[EOS],
        pad_token_id=vocab[EOS],
        hidden_act="gelu",
    )
    # Seed only a private generator state: never perturb the caller's randomness.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            sample_size=SAMPLE_SIZE,
            in_channels=LATENT_CHANNELS,
            out_channels=LATENT_CHANNELS,
            block_out_channels=(8, 16),
            layers_per_block=1,
            norm_num_groups=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=CROSS_DIM,
            attention_head_dim=4,
        )
        torch.manual_seed(seed + 1)
        vae = AutoencoderKL(
            sample_size=2 * SAMPLE_SIZE,
            in_channels=3,
            out_channels=3,
            block_out_channels=(8, 16),
            layers_per_block=1,
            norm_num_groups=4,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            latent_channels=LATENT_CHANNELS,
        )
        torch.manual_seed(seed + 2)
        text_encoder = CLIPTextModel(text_config)
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    pipeline = StableDiffusionPipeline(
        vae=vae.eval(),
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        unet=unet.eval(),
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        image_encoder=None,
        requires_safety_checker=False,
    )
    pipeline.save_pretrained(snap, safe_serialization=True)


def build_tiny_diffusion(
    hf_home: Path | str,
    repo_id: str = DIFFUSION_REPO_ID,
    seed: int = 0,
    n_merges: int = N_MERGES,
    max_length: int = MAX_LENGTH,
) -> str:
    """Build (once) the tiny Stable Diffusion pipeline as a hub-cache entry under
    ``hf_home``; return its repo id (what ``from_pretrained`` takes).

    Idempotent and safe against concurrent builders (a file lock; written to a
    private temporary folder and moved into place with one ``rename``); an entry
    that already exists is left untouched. Weights are a pure function of the
    arguments (``seed`` seeds each module's init), so two builds are
    byte-identical in their safetensors files.
    """
    hf_home = Path(hf_home)
    if diffusion_snapshot_dir(hf_home, repo_id) is not None:
        return repo_id

    hub = hf_home / "hub"
    hub.mkdir(parents=True, exist_ok=True)
    repo = _repo_dir(hf_home, repo_id)
    with open(hub / f".lock-{repo.name}", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if diffusion_snapshot_dir(hf_home, repo_id) is not None:
                return repo_id
            params = dict(kind="stable-diffusion", format=BUILD_FORMAT, seed=seed, n_merges=n_merges,
                          max_length=max_length)
            rev = _revision(repo_id, params)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{repo.name}-", dir=hub))
            tmp.chmod(0o755)  # mkdtemp makes it owner-only; servers may run as others
            try:
                _write_snapshot(tmp / "snapshots" / rev, seed=seed, n_merges=n_merges, max_length=max_length)
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

    assert diffusion_snapshot_dir(hf_home, repo_id) is not None, f"building {repo_id} under {hf_home} failed"
    return repo_id


def client_diffusion(repo_id: str = DIFFUSION_REPO_ID, **kwargs: Any):
    """The nnsight client ``DiffusionModel`` for ``repo_id``, usable with the hub
    unreachable: a seeded canonical-id cache so ``to_model_key()`` does not ask
    the hub. Requires ``HF_HOME`` (where ``build_tiny_diffusion`` ran) and
    ``HF_HUB_OFFLINE=1``, both set before huggingface_hub was first imported."""
    import nnsight.modeling.huggingface as hf
    from nnsight.modeling.diffusion import DiffusionModel

    hf._ID_CACHE[repo_id] = repo_id
    return DiffusionModel(repo_id, **kwargs)


def model_index(hf_home: Path | str, repo_id: str = DIFFUSION_REPO_ID) -> dict:
    """The built pipeline's ``model_index.json``."""
    snap = diffusion_snapshot_dir(Path(hf_home), repo_id)
    assert snap is not None, f"{repo_id} is not built under {hf_home}"
    return json.loads((snap / "model_index.json").read_text())
