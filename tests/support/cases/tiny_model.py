"""Tiny, fully offline GPT-2 checkpoints for the test suite.

The Hugging Face hub is unreachable in tests, so every model the suite uses is
built here: a randomly initialised ``GPT2LMHeadModel`` (deterministic given the
seed) plus a byte-level BPE tokenizer trained locally on a small built-in
English corpus, laid out exactly like a hub cache entry::

    <hf_home>/hub/models--ORG--NAME/refs/main          -> <40-hex revision>
    <hf_home>/hub/models--ORG--NAME/snapshots/<rev>/   config.json, model.safetensors,
                                                        generation_config.json,
                                                        tokenizer.json, tokenizer_config.json, ...

so both the client (``client_model``) and a server (``Remotable.from_model_key``)
can load it by repo id with ``HF_HOME=<hf_home>`` and ``HF_HUB_OFFLINE=1``.

``HF_HOME`` / ``HF_HUB_OFFLINE`` must be set before transformers or
huggingface_hub is imported (they read them at import time); ``tests/conftest.py``
does that. ``build_tiny_gpt2`` itself imports transformers lazily and writes
plain files, so it works whatever the environment says.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

REPO_ID = "ndif-celery/tiny-gpt2"

# Shape of the default model (what ``build_tiny_gpt2`` builds with its defaults).
N_LAYER = 12
HIDDEN = 64
N_HEAD = 4
N_POSITIONS = 128
# Size the BPE trainer aims for (the corpus below is rich enough to reach it) and
# the model's vocab_size, so logits are exactly VOCAB wide.
VOCAB = 512

PROMPT = "The Eiffel Tower is in the city of"
PROMPTS = [
    "The Eiffel Tower is in the city of",
    "Madison Square Garden is located in the city of",
    "The quick brown fox jumps over the lazy dog",
    "Hello world",
]

EOS = "<|endoftext|>"

# Small built-in English corpus for the tokenizer (includes every test prompt's
# words). Changing it changes the vocabulary and thus every model built from it.
CORPUS = [
    *PROMPTS,
    "The Eiffel Tower is in Paris, the capital city of France.",
    "Madison Square Garden is located in New York City.",
    "The Colosseum is in Rome and the Brandenburg Gate is in Berlin.",
    "Big Ben is a famous clock tower in London, England.",
    "The quick brown fox jumps over the lazy dog again and again.",
    "Hello world, hello there, hello again my good friend.",
    "A tower, a garden, a square, a city: these are places people visit.",
    "Language models predict the next token given the previous tokens.",
    "Neural networks have layers, and each layer has an input and an output.",
    "The attention block mixes information between positions in the sequence.",
    "The multilayer perceptron applies a nonlinearity to every position.",
    "We read the hidden states, patch the activations and save the results.",
    "Interpretability research studies what happens inside a model.",
    "She walked to the market to buy apples, bread, milk and cheese.",
    "He said that the weather in the mountains was cold and windy today.",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "January February March April May June July August September October November December",
    "Monday Tuesday Wednesday Thursday Friday Saturday Sunday",
    "red orange yellow green blue indigo violet black white gray brown",
    "The cat sat on the mat and the dog slept by the door.",
    "Water boils at one hundred degrees and freezes at zero degrees.",
    "The sun rises in the east and sets in the west every day.",
    "Books, music and art make the world a more interesting place.",
    "The river flows through the valley down to the sea.",
    "Scientists measure, compare and report what they observe.",
    "Please remember to close the window before you leave the house.",
    "It was the best of times, it was the worst of times.",
    "To be or not to be, that is the question.",
    "All happy families are alike; each unhappy family is unhappy in its own way.",
    "In the beginning there was nothing, and then there was light.",
]


def _repo_dir(hf_home: Path, repo_id: str) -> Path:
    return Path(hf_home) / "hub" / ("models--" + repo_id.replace("/", "--"))


def _revision(repo_id: str, params: dict) -> str:
    """A deterministic 40-hex 'commit' for this build (the snapshot name)."""
    blob = json.dumps({"repo_id": repo_id, **params}, sort_keys=True).encode()
    return hashlib.sha1(blob).hexdigest()


_REQUIRED = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def snapshot_dir(hf_home: Path, repo_id: str = REPO_ID) -> Path | None:
    """The built snapshot folder for ``repo_id``, or None if not (fully) built."""
    repo = _repo_dir(hf_home, repo_id)
    ref = repo / "refs" / "main"
    if not ref.is_file():
        return None
    snap = repo / "snapshots" / ref.read_text().strip()
    if all((snap / name).is_file() for name in _REQUIRED):
        return snap
    return None


def _train_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GPT2TokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus so merges have stable, non-tied counts where it matters;
    # the trainer is deterministic for a fixed input either way.
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return GPT2TokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        unk_token=EOS,
        pad_token=EOS,
        model_max_length=N_POSITIONS,
    )


# The architectures a tiny model can have besides GPT-2: OPT (its decoder flattens
# every row's tokens into one [rows x positions, d] tensor before its MLP) and a
# Mixtral-style mixture of experts (a router's logits over flattened tokens, each
# expert fed the tokens routed to it from every row).
ARCHITECTURES = ("gpt2", "opt", "mixtral")


def _config(architecture: str, n_layer: int, n_embd: int, n_head: int, n_positions: int, vocab_size: int,
            eos_id: int):
    from transformers import GPT2Config, MixtralConfig, OPTConfig

    ids = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
    if architecture == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                          n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids)
    if architecture == "opt":
        return OPTConfig(vocab_size=vocab_size, hidden_size=n_embd, num_hidden_layers=n_layer, ffn_dim=4 * n_embd,
                         num_attention_heads=n_head, max_position_embeddings=n_positions,
                         word_embed_proj_dim=n_embd, dropout=0.0, attention_dropout=0.0, **ids)
    if architecture == "mixtral":
        return MixtralConfig(vocab_size=vocab_size, hidden_size=n_embd, intermediate_size=2 * n_embd,
                             num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_head,
                             num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=n_positions,
                             **ids)
    raise ValueError(f"unknown architecture {architecture!r}; known: {ARCHITECTURES}")


def _write_snapshot(
    snap: Path, n_layer: int, n_embd: int, n_head: int, n_positions: int, seed: int,
    vocab_size: int, architecture: str = "gpt2",
) -> None:
    import torch
    from transformers import GenerationConfig, GPT2LMHeadModel, MixtralForCausalLM, OPTForCausalLM

    tokenizer = _train_tokenizer(vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    if len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, over vocab_size={vocab_size}")
    config = _config(architecture, n_layer, n_embd, n_head, n_positions, vocab_size, eos_id)
    # Seed only a private generator state: save and restore the global RNG so
    # building a model never perturbs the caller's randomness.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = {"gpt2": GPT2LMHeadModel, "opt": OPTForCausalLM, "mixtral": MixtralForCausalLM}[architecture](config)
    model.eval()
    model.save_pretrained(snap, safe_serialization=True)
    GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False
    ).save_pretrained(snap)
    tokenizer.save_pretrained(snap)


def build_tiny_gpt2(
    hf_home: Path,
    repo_id: str = REPO_ID,
    n_layer: int = N_LAYER,
    n_embd: int = HIDDEN,
    n_head: int = N_HEAD,
    seed: int = 0,
    n_positions: int = N_POSITIONS,
    vocab_size: int = VOCAB,
    architecture: str = "gpt2",
) -> Path:
    """Build (once) a tiny random GPT-2 (or another of :data:`ARCHITECTURES`) as a
    hub-cache entry; return its snapshot dir.

    Idempotent and safe against concurrent builders (other pytest workers or
    processes): the build is serialised with a file lock, written to a private
    temporary folder, and moved into place with one atomic ``rename``. An entry
    that already exists is returned untouched. Weights are a pure function of
    the arguments (``seed`` seeds the init), so two builds are byte-identical
    in ``model.safetensors``.
    """
    hf_home = Path(hf_home)
    existing = snapshot_dir(hf_home, repo_id)
    if existing is not None:
        return existing

    hub = hf_home / "hub"
    hub.mkdir(parents=True, exist_ok=True)
    repo = _repo_dir(hf_home, repo_id)
    lock_path = hub / f".lock-{repo.name}"
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            existing = snapshot_dir(hf_home, repo_id)
            if existing is not None:
                return existing
            params = dict(
                n_layer=n_layer, n_embd=n_embd, n_head=n_head, seed=seed,
                n_positions=n_positions, vocab_size=vocab_size,
            )
            if architecture != "gpt2":  # (GPT-2's snapshots keep the name they always had)
                params["architecture"] = architecture
            rev = _revision(repo_id, params)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{repo.name}-", dir=hub))
            tmp.chmod(0o755)  # mkdtemp makes it owner-only; servers may run as others
            try:
                _write_snapshot(tmp / "snapshots" / rev, **params)
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

    snap = snapshot_dir(hf_home, repo_id)
    assert snap is not None, f"building {repo_id} under {hf_home} failed"
    return snap


def client_model(repo_id: str = REPO_ID, **kwargs: Any):
    """The nnsight client model for ``repo_id``, usable with the hub unreachable.

    What a real user would construct, plus the three things an offline client
    needs: an explicit
    ``task``, a preloaded tokenizer, and a seeded canonical-id cache so
    ``to_model_key()`` does not call the hub. Requires ``HF_HOME`` pointing at
    a folder where ``build_tiny_gpt2`` ran and ``HF_HUB_OFFLINE=1``, both set
    before transformers / huggingface_hub were first imported.
    """
    import nnsight.modeling.huggingface as hf
    from nnsight.modeling.transformers import TransformersModel
    from transformers import AutoTokenizer

    hf._ID_CACHE[repo_id] = repo_id
    kwargs.setdefault("task", "text-generation")
    if "tokenizer" not in kwargs:
        kwargs["tokenizer"] = AutoTokenizer.from_pretrained(repo_id)
    return TransformersModel(repo_id, **kwargs)


def worker_loaded(repo_id: str = REPO_ID) -> tuple[str, Any]:
    """``(model key, model)``: the model as a worker loads it (``from_model_key``,
    dispatched, no gradients), for tests that drive the worker's code directly.
    Imports nnsight lazily, like ``client_model``, for the reason above."""
    from nnsight.modeling.mixins.remotable import Remotable

    key = client_model(repo_id).to_model_key()
    model = Remotable.from_model_key(key, dispatch=True)
    model._module.requires_grad_(False)
    return key, model
