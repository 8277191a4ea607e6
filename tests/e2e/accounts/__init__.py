"""End to end: the job ledger written by real workers, and its database outages."""
