"""In-process tests of ndif_celery/state/: the shared keys in Redis."""
