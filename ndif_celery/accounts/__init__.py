"""ndif_celery.accounts."""
