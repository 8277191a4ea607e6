#!/usr/bin/env bash
# The bench on a GPU machine, with a ~1.1B-parameter Llama (TinyLlama's shape,
# random weights, bfloat16) built offline as a Hugging Face cache entry.
#
#   bench/gpu.sh                 # build the model once (bench/_out/hf), run every workload
#   bench/gpu.sh --smoke         # the short version
#   bench/gpu.sh --dry-run       # CPU only: check the model config (1.1B parameters) and the plan
#
# Extra arguments go to bench/run.py (e.g. --only small_trace,generate).
# Needs a CUDA build of torch in .venv (the default install is CPU-only):
#   .venv/bin/pip install --force-reinstall 'torch==2.13.0' --index-url https://download.pytorch.org/whl/cu128
# The isolated path is left out: GPU workers refuse untrusted jobs (docs/security.md).
# cobatch: 1, 4, 16 clients against one worker, co-batching off vs on, on the 1.1B model
# (its targets are checked on those cells on a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export HF_HOME=${HF_HOME:-$PWD/bench/_out/hf}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

for arg in "$@"; do
  if [[ "$arg" == "--dry-run" ]]; then
    exec "$PY" bench/run.py --model llama-1b "$@"
  fi
done

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "bench/gpu.sh: torch sees no CUDA device (torch $("$PY" -c 'import torch; print(torch.__version__)'))." >&2
  echo "Install a CUDA build of torch into .venv, or run bench/run.py for the CPU bench." >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

exec "$PY" bench/run.py --model llama-1b --device cuda \
  --stack-env NDIF_WORKER_GPUS=0 \
  --second-worker-gpus 0 --second-worker-memory-gib 40 \
  --only small_trace,every_layer,generate,session,big_result,cold_start,throughput,cobatch \
  --out "${BENCH_OUT:-bench/_out/bench-gpu.json}" \
  "$@"
