"""In-process tests of ndif_celery/monitoring/: probes and alerts."""
