"""``ndif-celery`` commands an operator runs against the farm, from any host
that reaches its broker: ``deploy``, ``evict``, ``queue``, ``kill`` and
``jobs`` (the ledger). The logic lives in :mod:`ndif_celery.farm.actions`,
:mod:`ndif_celery.state.queues` and :mod:`ndif_celery.accounts.ledger_queries`; these only parse,
print and turn their errors into clean CLI errors. Registered on the group in
:mod:`ndif_celery.cli`. Nothing of this host's stack is imported here
(:mod:`ndif_celery.cli.common`, not ``cli.host``), and the ledger's database
layer only by ``jobs``: ``ndif-celery kill`` should start at once.
"""

from __future__ import annotations

import time
from typing import Optional

import click
import redis as redis_py

from ndif_celery import wire
from ndif_celery.celery_app import make_app
from ndif_celery.farm import actions
from ndif_celery.farm import capacity
from ndif_celery.policy import held_formats, model_policy
from ndif_celery.state import jobs, launches, queues, registry

from .common import echo_rows, from_ledger, settings


WAIT_FOR_WORKERS_HELP = ("Record it even when the live workers cannot meet it now (a worker is starting) and "
                         "wait up to --timeout; without it, such a wish is refused at once, saying why.")


def connect():
    """(settings, redis client, celery app) for the farm commands; a broker
    that does not answer is a clean CLI error naming ``NDIF_REDIS_URL``."""
    current = settings()
    client = jobs.connect(current.redis_url)
    try:
        client.ping()
    except (redis_py.RedisError, OSError):
        raise click.ClickException(f"cannot reach the broker at {current.redis_url} (NDIF_REDIS_URL)") from None
    return current, client, make_app(current)


@click.command()
@click.argument("model", required=False)
@click.option("-f", "--file", "path", default=None, type=click.Path(dir_okay=False),
              help="Deploy every entry of this deployments file (YAML or JSON) instead of MODEL.")
@click.option("--sync", is_flag=True, help="With -f: also evict what an earlier file deployed and this one no longer lists.")
@click.option("--dry-run", is_flag=True, help="With -f: print what would be loaded, changed and evicted; change nothing.")
@click.option("--force", is_flag=True, help="With --sync: evict even a pinned model, or everything (an empty file).")
@click.option("--pin", is_flag=True, help="Never evict it to make room for another model.")
@click.option("--replicas", default=1, show_default=True, type=int, help="How many workers hold it.")
@click.option("--dtype", default=None,
              help="Hold the weights as this float type (e.g. bfloat16) or quantization (nf4, int8, fp4, fp8): "
                   "a quantization is a deployment of its own, asked for at <url>/dtype/<name> (docs/farm.md).")
@click.option("--task", default="text-generation", show_default=True, help="Task in the model key (repo ids only).")
@click.option("--nnsight", "nnsight_version", default="", metavar="VERSION",
              help="For the clients of this nnsight runtime (repo ids only; docs/versions.md).")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait until every replica runs.")
@click.option("--wait-for-workers", is_flag=True, help=WAIT_FOR_WORKERS_HELP)
@click.option("--timeout", default=600.0, show_default=True, type=float)
def deploy(model: Optional[str], path: Optional[str], sync: bool, dry_run: bool, force: bool, pin: bool,
           replicas: int, dtype: Optional[str], task: str, nnsight_version: str, wait: bool,
           wait_for_workers: bool, timeout: float) -> None:
    """Deploy MODEL (a repo id or a full model key) and keep it deployed; or,
    with -f FILE, every entry of a deployments file (docs/farm.md)."""
    if (model is None) == (path is None):
        raise click.UsageError("give either MODEL or -f FILE")
    if (sync or dry_run or force) and path is None:
        raise click.UsageError("--sync, --dry-run and --force go with -f FILE")
    if path is not None:
        return _deploy_file(path, sync, dry_run, force, wait, timeout, wait_for_workers)
    current, client, _ = connect()
    try:
        dtype = held_formats.check(dtype) if dtype else None
        key = actions.model_key_for(model, task=task, nnsight=nnsight_version, dtype=dtype)
        # The operator may deploy any hub id, but not outside NDIF_MODELS, nor remote code outside NDIF_TRUST_REMOTE_CODE.
        model_policy.ModelPolicy.from_settings(current).check_model(model_policy.parse(key))
        if not wait_for_workers:
            capacity.check(client, [capacity.demand(client, current, key, replicas, dtype, label=model)],
                           lambda n: f"deploy --replicas {n}")
        asked = time.time()
        actions.deploy(client, key, pin, replicas, dtype)
        if wait:
            running = actions.wait_running(client, key, replicas, timeout, since=asked)
            click.echo(f"{model}: running on {', '.join(sorted(d['worker'] for d in running))}")
        else:
            click.echo(f"{model}: deployment requested")
    except (actions.FarmError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    except model_policy.PolicyError as exc:
        raise click.ClickException(exc.detail) from None


def _deploy_file(path: str, sync: bool, dry_run: bool, force: bool, wait: bool, timeout: float,
                 wait_for_workers: bool = False) -> None:
    from ndif_celery.farm import deployments

    current = settings()
    try:
        entries = deployments.load_file(path, model_policy.ModelPolicy.from_settings(current))
    except deployments.DeploymentsError as exc:
        raise click.ClickException(str(exc)) from None
    for warning in deployments.warnings(entries, current.auth):
        click.echo(f"warning: {warning}", err=True)
    _, client, app = connect()
    plan = deployments.plan(client, entries, sync=sync)
    unmeetable = [] if wait_for_workers else deployments.capacity_problems(client, current, entries, plan)
    if dry_run:
        _print_plan(plan, entries, sync, force, unmeetable)
        return
    if unmeetable:
        raise click.ClickException(f"{path}: the live workers cannot meet it: {'; '.join(unmeetable)}. "
                                   "Nothing was changed (give --wait-for-workers to apply it and wait).")
    asked = time.time()
    try:
        applied = deployments.apply(client, entries, sync=sync, celery_app=app, force=force)
    except deployments.DeploymentsError as exc:
        raise click.ClickException(str(exc)) from None
    for label, repos in (("added", applied.added), ("changed", applied.changed), ("unchanged", applied.unchanged)):
        for repo in repos:
            difference = applied.differences.get(repo)
            click.echo(f"{repo}: {label}" + (f" ({difference})" if difference else ""))
    for repo, _, workers in applied.evicted:
        where = f" from {', '.join(sorted(workers))}" if workers else " (pinned by a schedule: when its window ends)"
        click.echo(f"{repo}: evicted, no longer listed{where}")
    if not wait:
        return
    try:
        for entry in entries:
            running = actions.wait_running(client, entry.model_key, entry.replicas, timeout, since=asked)
            click.echo(f"{entry.repo}: running on {', '.join(sorted(d['worker'] for d in running))}")
        for repo, model_key, workers in applied.evicted:
            if workers:
                actions.wait_evicted(client, model_key, timeout)
    except actions.FarmError as exc:
        raise click.ClickException(str(exc)) from None


def _print_plan(plan, entries: list, sync: bool, force: bool, unmeetable: list) -> None:
    """``deploy -f --dry-run``: each change the file would make, what would refuse
    it (capacity, ``--force``), then nothing done."""
    for repo in plan.added:
        click.echo(f"{repo}: would add")
    for repo in plan.changed:
        click.echo(f"{repo}: would change ({plan.differences[repo]})")
    for repo in plan.unchanged:
        click.echo(f"{repo}: unchanged")
    for repo, missing in plan.loads:
        click.echo(f"{repo}: would load {missing} replica(s)")
    for repo, _, workers in plan.evicted:
        where = f" from {', '.join(workers)}" if workers else ""
        click.echo(f"{repo}: would evict, no longer listed{where}")
    refusal = plan.refusal(entries) if sync and not force else None
    if refusal:
        click.echo(f"refused without --force: {refusal}")
    for why in unmeetable:
        click.echo(f"refused, the live workers cannot meet it: {why}")
    click.echo("dry run: nothing was changed")


@click.command()
@click.argument("model")
@click.argument("replicas", type=int)
@click.option("--task", default="text-generation", show_default=True, help="Task in the model key (repo ids only).")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait until REPLICAS workers hold it.")
@click.option("--wait-for-workers", is_flag=True, help=WAIT_FOR_WORKERS_HELP)
@click.option("--timeout", default=600.0, show_default=True, type=float)
@click.option("--dtype", default=None, help="The quantized deployment of MODEL held as this (nf4, int8, ...).")
def scale(model: str, replicas: int, task: str, wait: bool, wait_for_workers: bool, timeout: float,
          dtype: Optional[str]) -> None:
    """Keep MODEL on REPLICAS workers: more are loaded, the extra ones evicted now."""
    from ndif_celery.farm import deployments

    current, client, app = connect()
    try:
        key = actions.model_key_for(model, task=task, dtype=dtype)
        model_policy.ModelPolicy.from_settings(current).check_model(model_policy.parse(key))
        if not wait_for_workers:
            dtype = (registry.desired(client).get(key) or {}).get("dtype")
            capacity.check(client, [capacity.demand(client, current, key, replicas, dtype, label=model)],
                           capacity.scale_to)
        asked = time.time()
        evicted = deployments.scale(client, app, key, replicas)
        if evicted:
            click.echo(f"{model}: evicting the replicas on {', '.join(sorted(evicted))}")
        if wait:
            actions.wait_running(client, key, replicas, timeout, since=asked)
            actions.wait_replicas_at_most(client, key, replicas, timeout)
            # Read after the evictions: the workers that hold it now, not the ones just evicted.
            running = [d for d in actions.holders(client, key) if d["state"] == "RUNNING"]
            click.echo(f"{model}: {replicas} replica(s), on {', '.join(sorted(d['worker'] for d in running))}")
        else:
            click.echo(f"{model}: {replicas} replica(s) requested")
    except (actions.FarmError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


@click.command()
@click.argument("model")
@click.option("--task", default="text-generation", show_default=True, help="Task in the model key (repo ids only).")
@click.option("--wait/--no-wait", default=True, show_default=True)
@click.option("--timeout", default=120.0, show_default=True, type=float)
@click.option("--dtype", default=None, help="The quantized deployment of MODEL held as this (nf4, int8, ...).")
def evict(model: str, task: str, wait: bool, timeout: float, dtype: Optional[str]) -> None:
    """Evict MODEL from every worker (pinned or not) and forget its deployment."""
    _, client, app = connect()
    try:
        key = actions.model_key_for(model, task=task, dtype=dtype)
        workers = actions.evict(client, app, key)
        if not workers:
            click.echo(f"{model}: not deployed")
            return
        if wait:
            actions.wait_evicted(client, key, timeout)
        click.echo(f"{model}: evicted from {', '.join(sorted(workers))}")
    except (actions.FarmError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the queues as JSON.")
def queue(as_json: bool) -> None:
    """Depth and head wait of every model's queue."""
    _, client, _ = connect()
    echo_rows(queues.summary(client), as_json, _queue_line, empty="no model queues yet")


def _queue_line(row: dict) -> str:
    return f"{queues.model_name(row):<40} depth {row['depth']:>4}  head wait {row['head_wait_s']:>8.1f} s"


@click.command()
@click.argument("job_id")
def kill(job_id: str) -> None:
    """End JOB_ID: remove it from its queue, or cancel it where it runs."""
    current, client, app = connect()
    try:
        click.echo(f"{job_id}: {actions.kill(client, app, job_id, current.job_ttl_s)}")
    except actions.FarmError as exc:
        raise click.ClickException(str(exc)) from None


@click.command("jobs")
@click.option("--user", default=None, help="Only this user's jobs: an email, key:<id> or anonymous.")
@click.option("--since", default=None, help="Only jobs that ended since: 30m, 1h, 2d, 1w or an ISO date/time.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=1))
@click.option("--probes", is_flag=True, help="Also the health probes' jobs (NDIF_PROBE_API_KEY's), left out by default.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def jobs_command(user: Optional[str], since: Optional[str], limit: int, probes: bool, as_json: bool) -> None:
    """Ended jobs from the ledger (NDIF_DATABASE_URL), newest first; the health
    probes' own jobs only with --probes (a probe every few seconds would bury the users')."""
    from ndif_celery.accounts import ledger_queries

    rows = from_ledger(settings(), since, lambda engine, since_at: ledger_queries.recent(
        engine, user=user, since=since_at, limit=limit, probes=probes), unseen="not shown")
    echo_rows(rows, as_json, _job_line, empty="no jobs")


def _job_line(row: dict) -> str:
    duration = f"{row['duration_s']:.2f}s" if row["duration_s"] is not None else "-"
    outcome = row["outcome"] + (f" ({row['error_kind']})" if row["error_kind"] else "")
    return (f"{(row['finished_at'] or '-')[:19]}  {row['job_id']}  {(row['email'] or row['owner'])[:28]:<28} "
            f"{row['model'][:32]:<32} {model_policy.runtime_of(row['model_key'] or ''):<8} {outcome:<18} "
            f"{duration:>9}  {row['error'] or ''}")


@click.command("deployments")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def deployments_command(as_json: bool) -> None:
    """What the farm was asked to keep beside what it runs: each wish's source,
    target and running replicas, and why an unmet one is not kept."""
    from ndif_celery.farm import wanted

    _, client, _ = connect()
    rows = wanted.rows(client)
    if rows and not as_json:
        click.echo(WANTED_HEADER)
    echo_rows(rows, as_json, _wanted_line, empty="nothing wanted, nothing running")


def _wanted_columns(model: str, nnsight: str, source: str, pinned: str, want: str, run: str, state: str,
                    workers: str) -> str:
    return f"{model[:40]:<40} {nnsight:<8} {source:<18} {pinned:<6} {want:>4} {run:>4}  {state:<9} {workers}"


WANTED_HEADER = _wanted_columns("MODEL", "NNSIGHT", "SOURCE", "PIN", "WANT", "RUN", "STATE", "RUNNING ON")


def _wanted_line(row: dict) -> str:
    source = row["source"] + (f" (over {row['over']})" if row["over"] else "")
    target = "-" if row["target"] is None else str(row["target"])
    running = ", ".join(row["running"]) or "-"
    line = _wanted_columns(row["model"], model_policy.runtime_of(row["model_key"]), source,
                           "pinned" if row["pinned"] else "", target, str(len(row["running"])), row["state"], running)
    return line + (f"\n    {row['reason']}" if row["reason"] else "")


@click.command("export")
@click.option("-o", "--output", default=None, type=click.Path(dir_okay=False),
              help="Write the file here (default: print it).")
def export(output: Optional[str]) -> None:
    """The farm's wanted deployments as a deployments file (``deploy -f`` takes it as it is)."""
    from ndif_celery.farm import wanted

    _, client, _ = connect()
    text, skipped = wanted.export(client)
    if output is None:
        click.echo(text, nl=False)
    else:
        with open(output, "w") as handle:
            handle.write(text)
        click.echo(f"wrote {output}")
    for line in skipped:
        click.echo(f"left out: {line}", err=True)


@click.group("launches", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print the launches as JSON.")
@click.pass_context
def launches_command(ctx: click.Context, as_json: bool) -> None:
    """Workers launched through the cluster's scheduler (NDIF_LAUNCHER): pending and why, running, ended."""
    if ctx.invoked_subcommand is not None:
        return
    _, client, _ = connect()
    rows = sorted(launches.read(client).values(), key=lambda row: row["submitted_at"])
    if not as_json and launches.paused(client):
        click.echo("launching is paused (ndif-celery launches resume)")
    echo_rows(rows, as_json, _launch_line, empty="no launches")


def _launch_line(row: dict) -> str:
    said = f" ({row['reason']})" if row.get("reason") else ""
    worker = f" as {row['worker']}" if row.get("worker") else ""
    return (f"{row['launcher']} {row['id']:<14} {row['state']:<8}{said}{worker} for "
            f"{wire.repo_id(row['model_key'])}{' nnsight ' + row['nnsight'] if row.get('nnsight') else ''}")


@launches_command.command("pause")
def launches_pause() -> None:
    """Launch no more workers; those launched stay until idle."""
    _, client, _ = connect()
    client.set(launches.PAUSED, "1")
    click.echo("launching paused: jobs wait for the workers there are")


@launches_command.command("resume")
def launches_resume() -> None:
    _, client, _ = connect()
    client.delete(launches.PAUSED)
    click.echo("launching resumed")


@launches_command.command("cancel")
@click.argument("launch_id")
def launches_cancel(launch_id: str) -> None:
    """End one launch now (its worker stops mid-job: the watchdog sends the job again)."""
    from ndif_celery.farm import launchers

    current, client, _ = connect()
    if launch_id not in launches.read(client):
        raise click.ClickException(f"no launch {launch_id} on record (ndif-celery launches)")
    try:
        launchers.for_settings(current).cancel(launch_id)
    except (launchers.LaunchRefused, ValueError) as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"launch {launch_id}: cancelled")


COMMANDS = [deploy, scale, evict, queue, kill, jobs_command, deployments_command, export, launches_command]
