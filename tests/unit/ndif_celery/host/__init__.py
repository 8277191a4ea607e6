"""Unit tests of ndif_celery/host/."""
