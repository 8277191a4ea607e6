"""The test suite: unit/ and inprocess/ are the fast tier, e2e/ starts real stacks (see tests/README.md)."""
