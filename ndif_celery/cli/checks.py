"""``ndif-celery version`` and ``ndif-celery doctor``: what this host has.

Doctor also fails the settings ``up`` refuses (``NDIF_ALERT_WEBHOOK_URL``,
``NDIF_DEPLOYMENTS``), checked by the code ``up`` runs: a host doctor passes starts.

Apart from :mod:`ndif_celery.cli.host` because :mod:`ndif_celery.host.doctor`
imports sqlalchemy, the result stores (minio) and huggingface_hub to check
them: in ``cli.host`` every ``up``/``down``/``status`` (and every stack the
tests start) paid ~0.3 s for imports only these two commands use. Registered
on the group, lazily, in :mod:`ndif_celery.cli`; the doctor module itself is
imported only when ``doctor`` runs, so ``ndif-celery --help`` stays cheap.
"""

from __future__ import annotations

import json
import os
import sys

import click

from ndif_celery.host import versions


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the versions as JSON.")
def version(as_json: bool) -> None:
    """Versions of python, ndif-celery, nnsight, torch (+CUDA), transformers,
    celery, flask, redis-py and the redis-server binary."""
    report = versions.versions()
    click.echo(json.dumps(report, indent=2) if as_json else versions.render_versions(report))


@click.command()
def doctor() -> None:
    """Check this host: one line per check (OK, WARN, FAIL, SKIP) and the fix
    for each problem. Exits 1 if any check fails."""
    # Imported here, not at the top: `ndif-celery --help` lists this command and
    # would otherwise pay ~0.3 s for doctor's sqlalchemy, minio and hub imports.
    from ndif_celery.host import doctor as checks

    results = checks.run() + _settings_checks(checks)
    click.echo(checks.render(results))
    if checks.failed(results):
        failing = ", ".join(c.name for c in results if c.status == checks.FAIL)
        click.echo(f"\n{sum(c.status == checks.FAIL for c in results)} check(s) failed: {failing}", err=True)
        sys.exit(1)


def _settings_checks(checks) -> list:
    """The settings ``up`` refuses, checked by the same code (``config.check_alert_webhook_url``,
    ``cli.host.deployments_warnings``), so doctor never passes a host that cannot start.
    Nothing here when the settings do not even load: doctor's ``configuration`` check says why."""
    from ndif_celery import config
    from ndif_celery.farm.deployments import DeploymentsError

    from .host import deployments_warnings

    env = dict(os.environ)
    try:
        current = config.load({**env, "NDIF_SECRET_KEY": env.get("NDIF_SECRET_KEY") or "doctor-does-not-sign"})
    except (ValueError, OSError):
        return []
    found = []
    url = current.alert_webhook_url
    try:
        config.check_alert_webhook_url(url)
    except ValueError as exc:
        found.append(checks.Check("alert webhook", checks.FAIL, str(exc),
                                  "set NDIF_ALERT_WEBHOOK_URL to http(s)://host[:port]/path, or unset it"))
    else:
        from ndif_celery.monitoring.alerts import shown_url

        if url:
            found.append(checks.Check("alert webhook", checks.OK, shown_url(url)))  # never its path: a token
        else:
            found.append(checks.Check("alert webhook", checks.SKIP, "NDIF_ALERT_WEBHOOK_URL unset: alerts only logged"))
    try:
        warnings = deployments_warnings(current)
    except DeploymentsError as exc:
        found.append(checks.Check("deployments", checks.FAIL, str(exc),
                                  "fix NDIF_DEPLOYMENTS (docs/farm.md); `ndif-celery up` refuses it as it is"))
    else:
        if not current.deployments:
            found.append(checks.Check("deployments", checks.SKIP, "NDIF_DEPLOYMENTS unset"))
        elif warnings:
            found.append(checks.Check("deployments", checks.WARN, "; ".join(warnings), "see docs/farm.md"))
        else:
            found.append(checks.Check("deployments", checks.OK, "NDIF_DEPLOYMENTS reads"))
    return found


COMMANDS = [version, doctor]
