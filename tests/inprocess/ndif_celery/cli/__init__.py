"""In-process tests of ndif_celery/cli/: the commands and the settings checks."""
