"""The ``ndif-celery`` command: one click group, its commands in six modules.

``host`` - this host's stack and services: ``up``, ``down``, ``status``, ``logs``.
  Also ``web``, ``worker``, ``beat``, ``flower`` and ``redis`` in the foreground.
``checks`` - ``version`` and ``doctor``, apart for their imports: sqlalchemy, the
  result stores, huggingface_hub.
``farm`` - the farm, from any host that reaches its broker: ``deploy``, ``scale``,
  ``evict``, ``queue``, ``kill``, ``jobs``, ``deployments``, ``export``, ``launches``.
``ops`` - operations over time: ``schedule``, ``usage``, ``probes``, ``audit``.
``keys`` - ``keys create|list|revoke``.
``runtimes`` - ``runtime add|list|remove``: this host's other nnsight versions.
``common`` - the settings and listing helpers they share, nothing heavy.
``__main__`` - ``python -m ndif_celery.cli``, the same command. The tests and the
  stack run it that way.

The group imports a command's module only when that command runs. A listing,
or ``--help``, imports them all. ``ndif-celery kill`` is what an operator types
while a job holds a model. Loading this host's stack, doctor, result stores and
ledger database for it would cost more than the kill itself.
"""

from __future__ import annotations

import importlib

import click

# Command name -> the module that defines it; any other name is host's.
_ELSEWHERE = {"deploy": "farm", "scale": "farm", "evict": "farm", "queue": "farm", "kill": "farm",
              "jobs": "farm", "deployments": "farm", "export": "farm", "launches": "farm",
              "schedule": "ops", "usage": "ops", "probes": "ops", "audit": "ops",
              "keys": "keys", "runtime": "runtimes", "version": "checks", "doctor": "checks"}


def _commands(module: str) -> list:
    loaded = importlib.import_module(f"{__package__}.{module}")
    return [loaded.keys] if module == "keys" else list(loaded.COMMANDS)


class _LazyGroup(click.Group):
    """A click group that imports one command's module when it is invoked."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        for module in ("host", "checks", "farm", "ops", "keys", "runtimes"):
            self._load(module)
        return super().list_commands(ctx)

    def get_command(self, ctx: click.Context, name: str):
        if name not in self.commands:
            self._load(_ELSEWHERE.get(name, "host"))
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

