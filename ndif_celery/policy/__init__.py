"""ndif_celery.policy."""
