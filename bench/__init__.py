"""Measurements of the farm against a local run and a null server (see bench/run.py)."""
