"""What every ``ndif-celery`` command module shares, and nothing heavy.

``settings()`` is the one way every command reads its configuration (a bad
``NDIF_*`` value is a clean CLI error, not a traceback); ``echo_rows`` prints
a listing. Apart from :mod:`ndif_celery.cli_host` (which imports the stack)
and :mod:`ndif_celery.cli_checks` (doctor, the result stores) so a farm
command such as ``ndif-celery kill`` starts without them.
"""

from __future__ import annotations

import json
from typing import Callable

import click

from . import config


def settings() -> config.Settings:
    """This host's settings, or a ClickException naming the bad variable."""
    try:
        return config.load()
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


def echo_rows(rows: list, as_json: bool, render: Callable[[dict], str], empty: str = "") -> None:
    """Print a listing command's ``rows``: as JSON with ``--json``, else one
    ``render(row)`` line each, or ``empty`` when there are none."""
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows and empty:
        click.echo(empty)
    for row in rows:
        click.echo(render(row))
