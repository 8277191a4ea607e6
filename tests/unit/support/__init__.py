"""Unit tests of the suite's own helpers (tests/support/)."""
