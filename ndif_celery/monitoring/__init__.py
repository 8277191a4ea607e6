"""ndif_celery.monitoring."""
