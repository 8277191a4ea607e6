"""In-process tests of ndif_celery/farm/: deployments, schedules, capacity, the watchdog."""
