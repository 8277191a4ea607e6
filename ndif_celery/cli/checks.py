"""``ndif-celery version`` and ``ndif-celery doctor``: what this host has.

Apart from :mod:`ndif_celery.cli.host` because :mod:`ndif_celery.host.doctor`
imports sqlalchemy, the result stores (minio) and huggingface_hub to check
them: in ``cli.host`` every ``up``/``down``/``status`` (and every stack the
tests start) paid ~0.3 s for imports only these two commands use. Registered
on the group, lazily, in :mod:`ndif_celery.cli`; the doctor module itself is
imported only when ``doctor`` runs, so ``ndif-celery --help`` stays cheap.
"""

from __future__ import annotations

import json
import sys

import click

from ndif_celery.host import versions as host_versions


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the versions as JSON.")
def version(as_json: bool) -> None:
    """Versions of python, ndif-celery, nnsight, torch (+CUDA), transformers,
    celery, flask, redis-py and the redis-server binary."""
    report = host_versions.versions()
    click.echo(json.dumps(report, indent=2) if as_json else host_versions.render_versions(report))


@click.command()
def doctor() -> None:
    """Check this host: one line per check (OK, WARN, FAIL, SKIP) and the fix
    for each problem. Exits 1 if any check fails."""
    # Imported here, not at the top: `ndif-celery --help` lists this command and
    # would otherwise pay ~0.3 s for doctor's sqlalchemy, minio and hub imports.
    from ndif_celery.host import doctor as checks

    results = checks.run()
    click.echo(checks.render(results))
    if checks.failed(results):
        failing = ", ".join(c.name for c in results if c.status == checks.FAIL)
        click.echo(f"\n{sum(c.status == checks.FAIL for c in results)} check(s) failed: {failing}", err=True)
        sys.exit(1)


COMMANDS = [version, doctor]
