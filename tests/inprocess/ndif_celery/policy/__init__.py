"""In-process tests of ndif_celery/policy/: client versions."""
