"""Unit tests of ndif_celery/accounts/."""
