"""In-process tests of ndif_celery/accounts/: keys, usage, the ledger."""
