"""Cost of isolation per request: the same small trace in the worker's process
(trusted) and in a fresh jailed child (untrusted, NDIF_DEFAULT_TRUSTED=0),
interleaved, next to the local run and the null server.

    .venv/bin/python bench/isolation.py [--requests 40]

A thin wrapper: the measurement lives in ``bench/sections/isolation.py``
(workload ``isolation`` of ``bench/run.py``), which ``make bench`` runs with
everything else.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import run  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--out", help="JSON path (default bench/_out/isolation.json)")
    args = parser.parse_args()
    out = args.out or str(run.OUT_DIR / "isolation.json")
    return run.main(["--only", "isolation", "--reps", str(args.requests), "--out", out])


if __name__ == "__main__":
    sys.exit(main())
