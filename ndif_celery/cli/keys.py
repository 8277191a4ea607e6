"""``ndif-celery keys``: API keys (users, tags, per-key limits) in
``NDIF_DATABASE_URL``, through :mod:`ndif_celery.accounts.db`. A key is printed once,
when it is made; afterwards only its id (``key:<id>``, the owner the ledger,
``usage --key`` and deployments' ``users`` name) and its prefix are ever
shown. Registered on the group in :mod:`ndif_celery.cli`.
"""

from __future__ import annotations

from typing import Optional

import click

from ndif_celery.accounts import db

from .common import echo_rows, settings


@click.group()
def keys() -> None:
    """API keys (users, tags, per-key limits) in NDIF_DATABASE_URL."""


def _engine():
    return db.engine_for(settings().database_url)


@keys.command("create")
@click.option("--email", required=True, help="The key's owner (created if new).")
@click.option("--trusted", is_flag=True, help="Run this key's jobs in the worker's process (no isolation).")
@click.option("--priority", is_flag=True, help="Tag the key `priority`.")
@click.option("--admin", is_flag=True, help="May open the dashboard (GET /dashboard) with NDIF_AUTH=1.")
@click.option("--rate-limit", type=int, default=None, help="Requests per minute (default NDIF_RATE_LIMIT_PER_MIN).")
@click.option("--max-concurrent", type=int, default=None,
              help="Jobs queued or running at once (default NDIF_MAX_CONCURRENT_JOBS).")
def keys_create(email: str, trusted: bool, priority: bool, admin: bool, rate_limit: Optional[int],
                max_concurrent: Optional[int]) -> None:
    """Make a key; it is printed once, alone on the last line."""
    tags = tuple(t for t, on in (("trusted", trusted), ("priority", priority), ("admin", admin)) if on)
    key = db.create_key(_engine(), email, tags, rate_limit_per_min=rate_limit, max_concurrent_jobs=max_concurrent)
    shown = tags if trusted else ("untrusted", *tags)
    click.echo(f"key for {email} ({', '.join(shown)}); it is not shown again:")
    click.echo(key)


@keys.command("list")
@click.option("--json", "as_json", is_flag=True)
def keys_list(as_json: bool) -> None:
    """Every key by id (key:<id>), prefix, owner, tags and state (never the key itself)."""
    echo_rows(db.list_keys(_engine()), as_json, _key_line)


def _key_line(row: dict) -> str:
    state = "revoked" if row["revoked"] else "active"
    return f"{'key:' + str(row['id']):<10} {row['prefix']}  {row['email']:<32} {','.join(row['tags']) or '-':<18} {state}"


@keys.command("revoke")
@click.argument("key")
def keys_revoke(key: str) -> None:
    """Revoke KEY (the key, or its 8-character prefix from `keys list`)."""
    count = db.revoke_key(_engine(), key)
    if not count:
        raise click.ClickException("no such key")
    click.echo(f"revoked {count} key{'s' if count > 1 else ''}")
