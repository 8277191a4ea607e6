"""ndif_celery.host."""
