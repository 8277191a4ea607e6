"""Unit tests of ndif_celery/policy/."""
