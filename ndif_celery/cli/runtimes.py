"""``ndif-celery runtime add|list|remove``: the nnsight runtimes of this host
(:mod:`ndif_celery.host.runtimes`), for workers that serve other client versions."""

from __future__ import annotations

import click

from .common import echo_rows, settings


@click.group("runtime")
def runtime() -> None:
    """Other nnsight versions this host's workers can serve (one environment each)."""


@runtime.command("add")
@click.argument("version")
@click.option("--python", "python", default=None, metavar="PATH",
              help="Build it on this interpreter: a 0.5 client's bytecode runs only on its own Python minor.")
def runtime_add(version: str, python: str) -> None:
    """Install nnsight VERSION into its own environment under NDIF_HOME, check it imports, record it."""
    from ndif_celery.host import runtimes

    try:
        made = runtimes.add(settings().home, version, log=lambda line: click.echo(line, err=True), python=python)
    except runtimes.RuntimeFailure as exc:
        raise click.ClickException(str(exc)) from None
    packages = made.packages or {}
    click.echo(f"nnsight {made.version}: ready at {made.path} (python {made.python}, torch {packages.get('torch')}, "
               f"transformers {packages.get('transformers')})")


@runtime.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def runtime_list(as_json: bool) -> None:
    """The farm's own nnsight and every runtime added on this host."""
    from ndif_celery.host import runtimes

    rows = [{"version": runtimes.main_version(), "path": None, "ok": True, "main": True}]
    rows += [found.row() for found in runtimes.listing(settings().home)]
    echo_rows(rows, as_json, _line)


def _line(row: dict) -> str:
    if row["main"]:
        return f"{row['version']:<12} the farm's own (every worker)"
    if not row["ok"]:
        return f"{row['version']:<12} BROKEN (its add did not finish: remove it and add it again)  {row['path']}"
    packages = row["packages"] or {}
    return (f"{row['version']:<12} python {row['python']}, transformers {packages.get('transformers')}, "
            f"torch {packages.get('torch')}  {row['path']}")


@runtime.command("remove")
@click.argument("version")
def runtime_remove(version: str) -> None:
    """Delete the runtime of nnsight VERSION from this host."""
    from ndif_celery.host import runtimes

    try:
        click.echo(f"nnsight {version}: removed {runtimes.remove(settings().home, version)}")
    except runtimes.RuntimeFailure as exc:
        raise click.ClickException(str(exc)) from None


COMMANDS = [runtime]
