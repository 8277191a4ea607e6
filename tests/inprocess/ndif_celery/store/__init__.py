"""In-process tests of ndif_celery/store/: the filesystem and S3 result stores."""
