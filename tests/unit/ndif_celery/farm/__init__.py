"""Unit tests of ndif_celery/farm/."""
