"""``python -m ndif_celery.cli``: the same command as ``ndif-celery``."""

from ndif_celery.cli import main

main(prog_name="ndif-celery")
