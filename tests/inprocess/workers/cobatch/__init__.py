"""In-process tests of workers/cobatch/: the co-batching engine."""
