"""In-process tests of ndif_celery/, one folder per package, one module per product module."""
