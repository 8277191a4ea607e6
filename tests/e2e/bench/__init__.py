"""End to end: the bench's smoke run (every workload measured and exact); `make test-bench`."""
