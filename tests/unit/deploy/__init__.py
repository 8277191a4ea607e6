"""Unit tests of deploy/: the recipes checked against the code they run, offline."""
