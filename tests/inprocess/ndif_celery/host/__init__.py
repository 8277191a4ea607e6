"""In-process tests of ndif_celery/host/: doctor and the stack's ports."""
