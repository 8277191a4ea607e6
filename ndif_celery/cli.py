"""The ``ndif-celery`` command: one click group, its commands in five modules.

- :mod:`ndif_celery.cli_host`: this host's stack and services (``up``,
  ``down``, ``status``, ``logs``, ``version``, ``doctor``, and ``web``,
  ``worker``, ``beat``, ``flower``, ``redis`` in the foreground);
- :mod:`ndif_celery.cli_checks`: ``version`` and ``doctor`` (apart for their
  imports: sqlalchemy, the result stores, huggingface_hub);
- :mod:`ndif_celery.cli_farm`: the farm, from any host that reaches its broker
  (``deploy``, ``scale``, ``evict``, ``queue``, ``kill``, ``jobs``);
- :mod:`ndif_celery.cli_ops`: operations over time (``schedule``, ``usage``, ``probes``);
- :mod:`ndif_celery.cli_keys`: ``keys create|list|revoke``.

``python -m ndif_celery.cli`` is the same command (the tests and the stack
run it that way).

The group imports a command's module only when that command runs (a listing,
``--help``, imports them all): ``ndif-celery kill`` is what an operator types
while a job holds a model, and loading this host's stack, doctor, result
stores and ledger database for it cost more than the kill itself.
"""

from __future__ import annotations

import importlib

import click

# Command name -> the module that defines it; any other name is cli_host's.
_ELSEWHERE = {"deploy": "cli_farm", "scale": "cli_farm", "evict": "cli_farm", "queue": "cli_farm", "kill": "cli_farm",
              "jobs": "cli_farm", "schedule": "cli_ops", "usage": "cli_ops", "probes": "cli_ops",
              "keys": "cli_keys", "version": "cli_checks", "doctor": "cli_checks"}


def _commands(module: str) -> list:
    loaded = importlib.import_module(f"{__package__}.{module}")
    return [loaded.keys] if module == "cli_keys" else list(loaded.COMMANDS)


class _LazyGroup(click.Group):
    """A click group that imports one command's module when it is invoked."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        for module in ("cli_host", "cli_checks", "cli_farm", "cli_ops", "cli_keys"):
            self._load(module)
        return super().list_commands(ctx)

    def get_command(self, ctx: click.Context, name: str):
        if name not in self.commands:
            self._load(_ELSEWHERE.get(name, "cli_host"))
        return super().get_command(ctx, name)

    def _load(self, module: str) -> None:
        for command in _commands(module):
            self.commands.setdefault(command.name, command)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """A self-hostable server farm for remote nnsight experiments.

    Configured by NDIF_* environment variables; state, logs and data live
    in NDIF_HOME (default ~/.ndif-celery).
    """


if __name__ == "__main__":
    main(prog_name="ndif-celery")
