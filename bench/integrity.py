"""The weight checks' cost per GiB: the plain fingerprint (after trusted jobs)
next to the keyed hash (after untrusted jobs on GPU models, or with
NDIF_VERIFY_UNTRUSTED=1), on this machine's CPU, or on a GPU if torch sees one.

    .venv/bin/python bench/integrity.py [--mib 512] [--repeat 3] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from workers.models import integrity  # noqa: E402


def seconds_per_gib(check, module, gib: float, repeat: int, device: str) -> float:
    check(module)  # the keyed hash draws its per-key coefficients once
    best = float("inf")
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        check(module)
        best = min(best, time.perf_counter() - started)
    return best / gib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="weights to check, in MiB (float32, 8 tensors)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    module = torch.nn.Module()
    for i in range(8):
        module.register_buffer(f"w{i}", torch.randn(args.mib * (1 << 20) // 4 // 8, device=args.device))
    gib = args.mib / 1024
    keyed = integrity.KeyedHash(secrets.token_bytes(32))
    plain = seconds_per_gib(integrity.fingerprint, module, gib, args.repeat, args.device)
    hashed = seconds_per_gib(keyed.fingerprint, module, gib, args.repeat, args.device)
    print(f"device {args.device}, {args.mib} MiB, torch threads {torch.get_num_threads()}, best of {args.repeat}")
    print(f"plain fingerprint : {plain:8.3f} s/GiB")
    print(f"keyed hash        : {hashed:8.3f} s/GiB  ({hashed / plain:.1f}x)")


if __name__ == "__main__":
    main()
