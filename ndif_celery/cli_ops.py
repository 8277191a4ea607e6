"""``ndif-celery`` commands for a farm's operations over time: ``schedule``
(pins for a window, :mod:`ndif_celery.schedules`), ``usage`` (from the job
ledger, :mod:`ndif_celery.usage`) and ``probes`` (the health probes' last
results, :mod:`ndif_celery.probes`). They only parse, print and turn errors
into clean CLI errors; registered on the group in :mod:`ndif_celery.cli`.
"""

from __future__ import annotations

from typing import Optional

import click

from . import farm, model_policy, schedules
from .cli_common import echo_rows, settings
from .cli_farm import connect


@click.group()
def schedule() -> None:
    """Pin a model for a window of time (a course, a workshop, a deadline)."""


@schedule.command("add")
@click.argument("model")
@click.option("--from", "start", required=True, help="now, +30m, +2h, +1d or an ISO date/time (UTC unless it says).")
@click.option("--to", "end", required=True, help="+2h (from now) or an ISO date/time (UTC unless it says).")
@click.option("--replicas", default=1, show_default=True, type=int, help="Workers that hold it during the window.")
@click.option("--task", default="text-generation", show_default=True, help="Task in the model key (repo ids only).")
def schedule_add(model: str, start: str, end: str, replicas: int, task: str) -> None:
    """Keep MODEL loaded and pinned from --from to --to; the controller evicts it
    after, unless a deployment keeps it."""
    current, client, _ = connect()
    try:
        key = farm.model_key_for(model, task=task)
        parsed = model_policy.parse(key)
        model_policy.Policy.from_settings(current).check_model(parsed)
        entry = schedules.add(client, key, parsed.repo_id, schedules.parse_when(start, option="--from"),
                              schedules.parse_when(end, option="--to"), replicas)
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


COMMANDS = [schedule]
