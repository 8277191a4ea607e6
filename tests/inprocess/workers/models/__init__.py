"""In-process tests of workers/models/: weight integrity and torch threads."""
