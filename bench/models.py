"""The models the bench runs on, built offline as Hugging Face cache entries.

- ``tiny``: the test suite's tiny random GPT-2 (``tests/support/cases/tiny_model.py``), plus a
  second copy under another repo id (another seed) for the cold start, so the
  main model stays deployed while the cold one is evicted and loaded again.
- ``llama-1b``: a ~1.1B-parameter Llama (TinyLlama's shape) with random
  weights in bfloat16, for a GPU machine (``bench/gpu.sh``). Its tokenizer is
  the tiny model's (512 tokens; every id is valid in the 32000-token
  vocabulary). Its cold start evicts and reloads the model itself (building a
  second 2 GiB copy is not worth it).
- ``gpt2-medium``: GPT-2 medium's shape (24 layers, n_embd 1024, 16 heads; the
  tiny model's 512-token vocabulary and tokenizer), random float32 weights,
  ~300M parameters, 1.2 GB on disk, ~12 s to build on 2 cores. The CPU run's
  throughput model: one forward of a short prompt on one thread takes
  ~250 ms, so requests are bound by the workers' compute, not by the client
  (~30 ms of CPU per call) or the web, as they are with the tiny model.
  Built (once per HF_HOME, like the others) only when a run uses it.

All lay files out exactly as the hub cache does (``refs/main`` and
``snapshots/<rev>/``), so the client and the server load them by repo id with
``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from tests.support.cases import tiny_model  # noqa: E402  (imports no torch/transformers at import time)

LLAMA_REPO = "ndif-bench/random-llama-1b"
TINY_COLD_REPO = "ndif-bench/tiny-gpt2-cold"
MEDIUM_REPO = "ndif-bench/gpt2-medium-random"
MEDIUM_SHAPE = dict(n_layer=24, n_embd=1024, n_head=16)


@dataclass(frozen=True)
class BenchModel:
    name: str
    repo_id: str
    cold_repo_id: str
    gpt2: bool  # blocks at model.transformer.h (else model.model.layers)
    dtype: str  # what the local column and the bare from_pretrained load with


MODELS = {
    "tiny": BenchModel("tiny", tiny_model.REPO_ID, TINY_COLD_REPO, gpt2=True, dtype="float32"),
    "llama-1b": BenchModel("llama-1b", LLAMA_REPO, LLAMA_REPO, gpt2=False, dtype="bfloat16"),
    # Its cold start reloads the model itself (like the Llama).
    "gpt2-medium": BenchModel("gpt2-medium", MEDIUM_REPO, MEDIUM_REPO, gpt2=True, dtype="float32"),
}


LLAMA_DRY_REPO = "ndif-bench/random-llama-dry-run"


def llama_1b_config(tiny: bool = False):
    """TinyLlama-1.1B's shape: 22 layers, hidden 2048, GQA 32/4 heads, bf16.
    ``tiny``: the same architecture scaled down (for ``--dry-run`` on a CPU)."""
    from transformers import LlamaConfig

    sizes = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4)
    if tiny:
        sizes = dict(vocab_size=tiny_model.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    return LlamaConfig(
        **sizes,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        dtype="bfloat16",
    )


def count_parameters(config) -> int:
    """Parameters of a model of ``config``, built on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def build_llama_1b(hf_home: Path, repo_id: str = LLAMA_REPO, seed: int = 0, tiny: bool = False) -> Path:
    """Write the random Llama as a hub-cache entry once; return its snapshot
    (``tiny``: the scaled-down twin the dry run builds and runs on a CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    existing = tiny_model.snapshot_dir(hf_home, repo_id)
    if existing is not None:
        return existing
    config = llama_1b_config(tiny=tiny)
    repo = tiny_model._repo_dir(hf_home, repo_id)
    rev = tiny_model._revision(repo_id, {"config": config.to_json_string(), "seed": seed})
    hub = Path(hf_home) / "hub"
    hub.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{repo.name}-", dir=hub))
    try:
        snap = tmp / "snapshots" / rev
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(snap, safe_serialization=True, max_shard_size="100GB")
        del model
        tokenizer = tiny_model._train_tokenizer(tiny_model.VOCAB)
        tokenizer.model_max_length = config.max_position_embeddings
        eos = tokenizer.convert_tokens_to_ids(tiny_model.EOS)
        GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, do_sample=False).save_pretrained(snap)
        tokenizer.save_pretrained(snap)
        (tmp / "refs").mkdir()
        (tmp / "refs" / "main").write_text(rev)
        if repo.exists():
            shutil.rmtree(repo)
        os.rename(tmp, repo)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    snap = tiny_model.snapshot_dir(hf_home, repo_id)
    assert snap is not None, f"building {repo_id} under {hf_home} failed"
    return snap


def build(model: BenchModel, hf_home: Path) -> None:
    """Make sure ``model`` (and its cold-start twin) are in the offline cache."""
    if model.name == "tiny":
        tiny_model.build_tiny_gpt2(hf_home, model.repo_id)
        tiny_model.build_tiny_gpt2(hf_home, model.cold_repo_id, seed=7)
    elif model.name == "llama-1b":
        build_llama_1b(hf_home, model.repo_id)
    elif model.name == "gpt2-medium":
        tiny_model.build_tiny_gpt2(hf_home, model.repo_id, **MEDIUM_SHAPE)
    else:
        raise ValueError(f"unknown model {model.name!r}; known: {', '.join(MODELS)}")


def dry_run(model: BenchModel, hf_home: Path) -> tuple[dict, BenchModel]:
    """The CPU-side checks of a model without building it: its config and its
    size; for the Llama, a scaled-down twin built by the same code (returned,
    for the caller to run the workloads on)."""
    if model.name == "llama-1b":
        config = llama_1b_config()
        params = count_parameters(config)
        build_llama_1b(hf_home, LLAMA_DRY_REPO, tiny=True)
        twin = BenchModel("llama-dry-run", LLAMA_DRY_REPO, LLAMA_DRY_REPO, gpt2=False, dtype="bfloat16")
        return {"model": model.name, "repo_id": model.repo_id, "parameters": params,
                "bf16_bytes": params * 2, "layers": config.num_hidden_layers}, twin
    build(model, hf_home)
    return {"model": model.name, "repo_id": model.repo_id}, model
