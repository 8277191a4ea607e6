"""Where things are: the repository root, tests/ and its gitignored output folder."""

from __future__ import annotations

from pathlib import Path

#: The repository root (the folder holding setup.cfg).
ROOT = Path(__file__).resolve().parents[2]
#: tests/
TESTS_DIR = ROOT / "tests"
#: tests/_out (gitignored): the tiny models' HF cache, screenshots, bench output.
OUT_DIR = TESTS_DIR / "_out"
#: tests/e2e: every test under it is end-to-end (marked ``e2e``).
E2E_DIR = TESTS_DIR / "e2e"
