"""Unit tests of tools/: the import graph and the suite's CPU count."""
