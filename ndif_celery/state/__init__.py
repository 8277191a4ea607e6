"""ndif_celery.state."""
