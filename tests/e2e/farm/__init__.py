"""End to end: farms of several workers: placement, replicas, failures, outages, operators' tools, several hosts."""
