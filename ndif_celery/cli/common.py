"""What every ``ndif-celery`` command module shares, and nothing heavy.

``settings()`` is the one way every command reads its configuration (a bad
``NDIF_*`` value is a clean CLI error, not a traceback); ``echo_rows`` prints
a listing. Apart from :mod:`ndif_celery.cli.host` (which imports the stack)
and :mod:`ndif_celery.cli.checks` (doctor, the result stores) so a farm
command such as ``ndif-celery kill`` starts without them.
"""

from __future__ import annotations

import json
from typing import Callable, Optional

import click

from ndif_celery import config


def settings() -> config.Settings:
    """This host's settings, or a ClickException naming the bad variable."""
    try:
        return config.load()
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


def from_ledger(current: config.Settings, since: Optional[str], query: Callable, unseen: str):
    """``query(engine, since_at)`` on the job ledger, current up to now (what
    ``ndif-celery jobs`` and ``usage`` read): ``--since`` parsed, the ended jobs
    the drainer has not written yet drained first (when the broker is away,
    a note says those are ``unseen``), a database away named as a CLI error.

    The database layer is imported here, not at the top: the ledger commands
    need it, and `kill` (which an operator wants at once) should not load it."""
    import redis as redis_py
    from sqlalchemy.exc import SQLAlchemyError

    from ndif_celery.accounts import db, ledger, ledger_queries
    from ndif_celery.state import jobs

    try:
        since_at = ledger_queries.parse_since(since) if since else None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        engine = db.engine_for(current.database_url)
        try:
            ledger.drain(jobs.connect(current.redis_url), engine, wait_s=5)
        except (redis_py.RedisError, OSError):
            click.echo(f"note: the broker at {current.redis_url} is not reachable; jobs that ended since the "
                       f"drainer last wrote the ledger are {unseen}", err=True)
        return query(engine, since_at)
    except SQLAlchemyError as exc:
        raise click.ClickException(f"the ledger database cannot be reached (NDIF_DATABASE_URL): "
                                   f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from None


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
