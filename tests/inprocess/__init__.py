"""Fast tier: the real code in this process against an embedded Redis, Flask's test client, WorkerState.run."""
