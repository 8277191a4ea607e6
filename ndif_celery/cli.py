"""The ``ndif-celery`` command: one click group, its commands in three modules.

- :mod:`ndif_celery.cli_host`: this host's stack and services (``up``,
  ``down``, ``status``, ``logs``, ``version``, ``doctor``, and ``web``,
  ``worker``, ``beat``, ``flower``, ``redis`` in the foreground);
- :mod:`ndif_celery.cli_farm`: the farm, from any host that reaches its broker
  (``deploy``, ``evict``, ``queue``, ``kill``, ``jobs``);
- :mod:`ndif_celery.cli_keys`: ``keys create|list|revoke``.

``python -m ndif_celery.cli`` is the same command (the tests and the stack
run it that way).
"""

from __future__ import annotations

import click

from . import cli_farm, cli_host, cli_keys


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """A self-hostable server farm for remote nnsight experiments.

    Configured by NDIF_* environment variables; state, logs and data live
    in NDIF_HOME (default ~/.ndif-celery).
    """


for _command in (*cli_host.COMMANDS, *cli_farm.COMMANDS, cli_keys.keys):
    main.add_command(_command)


if __name__ == "__main__":
    main(prog_name="ndif-celery")
