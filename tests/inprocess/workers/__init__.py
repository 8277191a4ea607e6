"""In-process tests of workers/: the worker's job function on the tiny model."""
