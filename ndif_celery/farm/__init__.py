"""ndif_celery.farm."""
