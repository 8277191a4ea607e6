"""``ndif-celery`` commands for a farm's operations over time: ``schedule``
(pins for a window, :mod:`ndif_celery.farm.schedules`), ``usage`` (from the job
ledger, :mod:`ndif_celery.accounts.usage`) and ``probes`` (the health probes' last
results, :mod:`ndif_celery.monitoring.probes`). They only parse, print and turn errors
into clean CLI errors; registered on the group in :mod:`ndif_celery.cli`.
"""

from __future__ import annotations

from typing import Optional

import click

from ndif_celery.farm import actions
from ndif_celery.farm import schedules
from ndif_celery.policy import model_policy

from .common import echo_rows, from_ledger, settings
from .farm import connect


@click.group()
def schedule() -> None:
    """Pin a model for a window of time (a course, a workshop, a deadline)."""


@schedule.command("add")
@click.argument("model")
@click.option("--from", "start", required=True, help="now, +30m, +2h, +1d or an ISO date/time (UTC unless it says).")
@click.option("--to", "end", required=True, help="+2h (from now) or an ISO date/time (UTC unless it says).")
@click.option("--replicas", default=1, show_default=True, type=int, help="Workers that hold it during the window.")
@click.option("--task", default="text-generation", show_default=True, help="Task in the model key (repo ids only).")
@click.option("--wait-for-workers", is_flag=True,
              help="Record it even when the live workers cannot meet it (workers will be started before it opens).")
def schedule_add(model: str, start: str, end: str, replicas: int, task: str, wait_for_workers: bool) -> None:
    """Keep MODEL loaded and pinned from --from to --to; the controller evicts it
    after, unless a deployment keeps it. A window the live workers cannot meet
    (beside the windows it overlaps) is refused, saying why."""
    current, client, _ = connect()
    try:
        key = actions.model_key_for(model, task=task)
        parsed = model_policy.parse(key)
        model_policy.ModelPolicy.from_settings(current).check_model(parsed)
        entry = schedules.add(client, key, parsed.repo_id, schedules.parse_when(start, option="--from"),
                              schedules.parse_when(end, option="--to"), replicas,
                              settings=None if wait_for_workers else current)
    except (schedules.ScheduleError, model_policy.PolicyError, ValueError) as exc:
        raise click.ClickException(str(getattr(exc, "detail", exc))) from None
    click.echo(f"{entry['id']}: {entry['repo']} pinned from {schedules.iso(entry['start'])} "
               f"to {schedules.iso(entry['end'])}")


@schedule.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the windows as JSON.")
def schedule_list(as_json: bool) -> None:
    """Every window, soonest first: pending, active or ended."""
    _, client, _ = connect()
    echo_rows(schedules.entries(client), as_json, _schedule_line, empty="no schedules")


def _schedule_line(row: dict) -> str:
    return (f"{row['id']}  {row['repo'][:40]:<40} {schedules.iso(row['start'])} -> {schedules.iso(row['end'])}  "
            f"x{row['replicas']}  {row['state']}")


@schedule.command("remove")
@click.argument("schedule_id")
def schedule_remove(schedule_id: str) -> None:
    """Forget a window (an open one closes now)."""
    _, client, _ = connect()
    entry = schedules.remove(client, schedule_id)
    if entry is None:
        raise click.ClickException(f"no schedule {schedule_id[:64]!r} (see `ndif-celery schedule list`)")
    click.echo(f"{entry['id']}: removed ({entry['repo']})")


@click.command()
@click.option("--since", default=None, help="Only jobs that ended since: 30m, 1h, 2d, 1w or an ISO date/time.")
@click.option("--key", "key", default=None, help="Only this key: its id (as in `keys list`), key:<id> or anonymous.")
@click.option("--email", default=None, help="Only the keys of this email.")
@click.option("--probes", is_flag=True, help="Also the health probes' jobs (NDIF_PROBE_API_KEY's), left out by default.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def usage(since: Optional[str], key: Optional[str], email: Optional[str], probes: bool, as_json: bool) -> None:
    """Jobs, errors, GPU-seconds and bytes per key and per model, from the job
    ledger; the health probes' own jobs only with --probes."""
    import json

    from ndif_celery.accounts import usage as usage_report

    current = settings()
    owner = None
    if key is not None:
        owner = f"key:{key}" if key.isdigit() else key
        if not (owner == "anonymous" or (owner.startswith("key:") and owner[4:].isdigit())):
            raise click.ClickException(f"--key must be a key id, key:<id> or anonymous, got {key[:40]!r}")
    report = from_ledger(current, since, lambda engine, since_at: usage_report.report(
        engine, since=since_at, owner=owner, email=email, probes=probes), unseen="not counted")
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"since {report['since'] or 'the ledger began'}")
    header = f"{'jobs':>7} {'errors':>7} {'GPU-s':>10} {'run-s':>10} {'bytes in':>12} {'bytes out':>12}"
    click.echo(f"\n{'key':<40} {header}")
    for row in report["keys"]:
        click.echo(f"{(row['email'] or '-') + ' (' + row['owner'] + ')':<40.40} {_usage_cells(row)}")
    click.echo(f"\n{'model':<40} {'nnsight':<8} {header}")
    for row in report["models"]:
        click.echo(f"{row['model']:<40.40} {row.get('nnsight') or '-':<8} {_usage_cells(row)}")
    click.echo(f"\n{'total':<40} {_usage_cells(report['total'])}")


def _usage_cells(row: dict) -> str:
    return (f"{row['jobs']:>7} {row['errors']:>7} {row['gpu_seconds']:>10.3f} {row['run_seconds']:>10.3f} "
            f"{row['bytes_in']:>12} {row['bytes_out']:>12}")


@click.command()
@click.option("--reset", "reset_model", default=None, metavar="MODEL",
              help="Forget MODEL's reference values (its weights changed on purpose); the next green probe records new ones.")
@click.option("--task", default="text-generation", show_default=True, help="Task in the model key (repo ids only).")
@click.option("--nnsight", default="", metavar="VERSION",
              help="With --reset: the deployment of that nnsight runtime (default: the farm's own).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def probes(reset_model: Optional[str], task: str, nnsight: str, as_json: bool) -> None:
    """The health probes' last result per deployment (NDIF_PROBE_INTERVAL_S): a model
    served by workers of another nnsight runtime is a row of its own."""
    from ndif_celery.monitoring import probes as health

    _, client, _ = connect()
    if reset_model is not None:
        try:
            key = actions.model_key_for(reset_model, task=task, nnsight=nnsight)
        except model_policy.PolicyError as exc:
            raise click.ClickException(exc.detail) from None
        click.echo(f"{reset_model}: {health.reset(client, key)} reference(s) forgotten")
        return
    rows = health.results(client)
    if rows and not as_json:
        click.echo(_probe_columns("MODEL", "NNSIGHT", "PROBED (UTC)", "LATENCY", "STATE"))
    echo_rows(rows, as_json, _probe_line, empty="no probe results (is NDIF_PROBE_INTERVAL_S set?)")


def _probe_columns(model: str, nnsight: str, at: str, latency: str, state: str) -> str:
    return f"{model[:40]:<40} {nnsight:<8} {at:<25} {latency:>9}  {state}"


def _probe_line(row: dict) -> str:
    """A deployment's last probe; a runtime's deployment of the model is a row of its own."""
    from ndif_celery.monitoring import probes as health

    latency = f"{row['latency_s']:.3f} s" if row.get("latency_s") is not None else "-"
    if row.get("state") == health.QUEUED:
        state = f"ok, {row.get('note')}" if row.get("ok") else f"FAILING ({row.get('failures')}x), {row.get('note')}"
    else:
        state = "ok" if row.get("ok") else f"FAILING ({row.get('failures')}x): {row.get('error')}"
    return _probe_columns(row["repo"], row.get("nnsight") or "-", schedules.iso(row["at"]), latency, state)


@click.command("audit")
@click.option("--since", default=None, help="Only actions since: 30m, 1h, 2d, 1w or an ISO date/time.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def audit_command(since: Optional[str], limit: int, as_json: bool) -> None:
    """The dashboard's admin actions, newest first: who, what, and how each ended."""
    from sqlalchemy.exc import SQLAlchemyError

    from ndif_celery.accounts import audit, db, ledger_queries

    current = settings()
    try:
        since_at = ledger_queries.parse_since(since) if since else None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        rows = audit.recent(db.engine_for(current.database_url), limit=limit, since=since_at)
    except SQLAlchemyError as exc:
        raise click.ClickException(f"cannot read the database (NDIF_DATABASE_URL): {type(exc).__name__}") from None
    echo_rows(rows, as_json, _audit_line, empty="no admin actions recorded")


def _audit_line(row: dict) -> str:
    who = row["email"] or row["actor"]
    return (f"{row['at'][:19]}  {who[:28]:<28} {row['action']:<16} {row['target'][:40]:<40} "
            f"{row['outcome']:<8} {row['message']}")


COMMANDS = [schedule, usage, probes, audit_command]
