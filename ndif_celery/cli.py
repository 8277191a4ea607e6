"""The ``ndif-celery`` command.

``up``/``down``/``status`` run a whole farm on this host (see
:mod:`ndif_celery.stack`, where the logic lives). ``web``, ``worker``,
``flower`` and ``redis`` replace themselves with one service in the
foreground, for a Procfile, systemd or a container, on any number of hosts.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Optional

import click
import redis as redis_py

from . import config, stack


class _Interrupted(Exception):
    """Raised from a signal handler so ``up`` unwinds into stopping the stack."""


_TRAPPED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _raise_interrupted(signum, frame):
    raise _Interrupted(signal.Signals(signum).name)


def _settings() -> config.Settings:
    try:
        return config.load()
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


def _stop(settings: config.Settings, timeout: float = 10) -> dict:
    # A second Ctrl-C must not abandon the stack half stopped; stop() is
    # bounded by its own timeouts.
    for signum in _TRAPPED:
        signal.signal(signum, signal.SIG_IGN)
    return stack.stop(settings, timeout)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """A self-hostable server farm for remote nnsight experiments.

    Configured by NDIF_* environment variables; state, logs and data live
    in NDIF_HOME (default ~/.ndif-celery).
    """


@main.command()
@click.option("--detach", "-d", is_flag=True, help="Return once the stack is ready and leave it running.")
@click.option("--timeout", default=120.0, show_default=True, type=float,
              help="Seconds to wait for the stack to become ready.")
def up(detach: bool, timeout: float) -> None:
    """Run Redis, the web, a worker and Flower on this host.

    In the foreground until Ctrl-C (or SIGTERM), which stops everything; if a
    service dies, the rest are stopped and the exit status is 1.
    """
    settings = _settings()
    for signum in _TRAPPED:
        signal.signal(signum, _raise_interrupted)

    try:
        started = stack.start(settings)
    except stack.StackError as exc:
        raise click.ClickException(str(exc)) from None
    except _Interrupted:
        sys.exit(1)  # start() stopped what it had started
    click.echo(f"starting {', '.join(started)} (NDIF_HOME={settings.home}, logs in {settings.home / 'logs'})")

    try:
        stack.wait_ready(settings, timeout)
    except stack.StackError as exc:
        _stop(settings)
        raise click.ClickException(f"{exc}\nstopped the stack.") from None
    except _Interrupted:
        click.echo("interrupted; stopping", err=True)
        _stop(settings)
        sys.exit(1)

    click.echo(f"ndif-celery is up at {settings.api_url}")
    if "flower" in started:
        click.echo(f"Flower: {stack.flower_url(settings)}")
    if detach:
        click.echo("stop it with `ndif-celery down`")
        return

    click.echo("press Ctrl-C to stop")
    try:
        while True:
            if not stack.state_path(settings).exists():
                click.echo("stopped by `ndif-celery down`")
                return
            dead = stack.first_dead(settings)
            if dead is not None:
                _, message = dead
                click.echo(f"error: {message}", err=True)
                click.echo("stopping the other services", err=True)
                _stop(settings)
                sys.exit(1)
            time.sleep(0.5)
    except _Interrupted:
        click.echo("stopping")
        _stop(settings)
        click.echo("stopped")


@main.command()
@click.option("--timeout", default=10.0, show_default=True, type=float,
              help="Seconds each service gets to exit after SIGTERM before SIGKILL.")
def down(timeout: float) -> None:
    """Stop the stack that `up` started (fine if it is not running)."""
    settings = _settings()
    try:
        outcome = stack.stop(settings, timeout)
    except stack.StackError as exc:
        raise click.ClickException(str(exc)) from None
    if not outcome:
        click.echo("ndif-celery is not running")
    for service, what in outcome.items():
        click.echo(f"{service}: {what}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the farm as JSON (the /status document).")
def status(as_json: bool) -> None:
    """Show this host's services, and the farm: workers and the models they hold."""
    settings = _settings()
    farm = _farm_status(settings)
    if as_json:
        if farm is None:
            raise click.ClickException(f"cannot reach the broker at {settings.redis_url}")
        click.echo(json.dumps(farm, indent=2))
        return
    try:
        rows = stack.status(settings)
    except stack.StackError as exc:
        raise click.ClickException(str(exc)) from None
    recorded = {service: (pid, alive) for service, pid, alive in rows}
    for service in recorded or stack.default_services(settings):
        pid, alive = recorded.get(service, (None, False))
        click.echo(f"{service:<8}{pid if pid else '-':>8}  {'running' if alive else 'stopped'}")
    answers = stack.api_answers(settings)
    click.echo(f"{'api':<8}{stack.ping_url(settings)}  {'answers' if answers else 'not answering'}")
    if farm is None:
        click.echo(f"farm: broker at {settings.redis_url} not reachable")
        return
    click.echo("\nworkers:")
    for name, info in sorted(farm["cluster"]["workers"].items()):
        gpus = ",".join(info["gpus"]) or "cpu"
        click.echo(
            f"  {name:<28} gpus={gpus:<6} used {_mib(info['memory_used_bytes'])} of "
            f"{_mib(info['memory_bytes'])}  job={info['current_job'] or '-'}"
        )
    click.echo("deployments:")
    hot = [e for e in farm["deployments"].values() if e["deployment_level"] == "HOT"]
    for entry in sorted(hot, key=lambda e: (e["repo_id"], e["worker"])):
        pin = " pinned" if entry["pinned"] else ""
        click.echo(f"  {entry['repo_id']:<36} {entry['application_state']:<10} on {entry['worker']}{pin}")


def _mib(n: int) -> str:
    return f"{(n or 0) / 1024**2:.1f} MiB"


def _farm_status(settings: config.Settings) -> Optional[dict]:
    from . import jobs, registry

    try:
        return registry.status_document(jobs.connect(settings.redis_url), operator=True)
    except (redis_py.RedisError, OSError):
        return None


def _farm():
    """(settings, redis client, celery app) for the farm commands."""
    from . import jobs
    from .celery_app import make_app

    settings = _settings()
    client = jobs.connect(settings.redis_url)
    try:
        client.ping()
    except (redis_py.RedisError, OSError):
        raise click.ClickException(f"cannot reach the broker at {settings.redis_url} (NDIF_REDIS_URL)") from None
    return settings, client, make_app(settings)


@main.command()
@click.argument("model")
@click.option("--pin", is_flag=True, help="Never evict it to make room for another model.")
@click.option("--replicas", default=1, show_default=True, type=int, help="How many workers hold it.")
@click.option("--dtype", default=None, help="Load the weights as this dtype (e.g. bfloat16).")
@click.option("--task", default="text-generation", show_default=True, help="Task in the model key (repo ids only).")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait until every replica runs.")
@click.option("--timeout", default=600.0, show_default=True, type=float)
def deploy(model: str, pin: bool, replicas: int, dtype: Optional[str], task: str, wait: bool, timeout: float) -> None:
    """Deploy MODEL (a repo id or a full model key) and keep it deployed."""
    from . import farm

    from . import model_policy

    settings, client, _ = _farm()
    try:
        key = farm.model_key_for(model, task=task)
        # The operator may deploy any hub id, but not outside NDIF_MODELS, nor remote code outside NDIF_TRUST_REMOTE_CODE.
        model_policy.Policy.from_settings(settings).check_model(model_policy.parse(key))
        farm.deploy(client, key, pin, replicas, dtype)
        if wait:
            running = farm.wait_running(client, key, replicas, timeout)
            click.echo(f"{model}: running on {', '.join(sorted(d['worker'] for d in running))}")
        else:
            click.echo(f"{model}: deployment requested")
    except (farm.FarmError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.argument("model")
@click.option("--task", default="text-generation", show_default=True, help="Task in the model key (repo ids only).")
@click.option("--wait/--no-wait", default=True, show_default=True)
@click.option("--timeout", default=120.0, show_default=True, type=float)
def evict(model: str, task: str, wait: bool, timeout: float) -> None:
    """Evict MODEL from every worker (pinned or not) and forget its deployment."""
    from . import farm

    _, client, app = _farm()
    try:
        key = farm.model_key_for(model, task=task)
        workers = farm.evict(client, app, key)
        if not workers:
            click.echo(f"{model}: not deployed")
            return
        if wait:
            farm.wait_evicted(client, key, timeout)
        click.echo(f"{model}: evicted from {', '.join(sorted(workers))}")
    except (farm.FarmError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the queues as JSON.")
def queue(as_json: bool) -> None:
    """Depth and head wait of every model's queue."""
    from . import queues

    _, client, _ = _farm()
    rows = queues.summary(client)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no model queues yet")
    for row in rows:
        repo = queues.model_name(row)
        click.echo(f"{repo:<40} depth {row['depth']:>4}  head wait {row['head_wait_s']:>8.1f} s")


@main.command()
@click.argument("job_id")
def kill(job_id: str) -> None:
    """End JOB_ID: remove it from its queue, or cancel it where it runs."""
    from . import farm

    settings, client, app = _farm()
    try:
        click.echo(f"{job_id}: {farm.kill(client, app, job_id, settings.job_ttl_s)}")
    except farm.FarmError as exc:
        raise click.ClickException(str(exc)) from None


@main.command("jobs")
@click.option("--user", default=None, help="Only this user's jobs: an email, key:<id> or anonymous.")
@click.option("--since", default=None, help="Only jobs that ended since: 30m, 1h, 2d, 1w or an ISO date/time.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def jobs_command(user: Optional[str], since: Optional[str], limit: int, as_json: bool) -> None:
    """Ended jobs from the ledger (NDIF_DATABASE_URL), newest first."""
    from . import jobs as job_state, ledger

    settings = _settings()
    try:
        since_at = ledger.parse_since(since) if since else None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    from sqlalchemy.exc import SQLAlchemyError

    try:
        engine = _engine()
        try:
            # Current up to now: what the controller has not written yet, first.
            ledger.drain(job_state.connect(settings.redis_url), engine, wait_s=5)
        except (redis_py.RedisError, OSError):
            click.echo(f"note: the broker at {settings.redis_url} is not reachable; jobs that ended since the "
                       "controller last wrote the ledger are not shown", err=True)
        rows = ledger.recent(engine, user=user, since=since_at, limit=limit)
    except SQLAlchemyError as exc:
        raise click.ClickException(
            f"the ledger database cannot be reached (NDIF_DATABASE_URL): {type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200]}"
        ) from None
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no jobs")
    for row in rows:
        duration = f"{row['duration_s']:.2f}s" if row["duration_s"] is not None else "-"
        outcome = row["outcome"] + (f" ({row['error_kind']})" if row["error_kind"] else "")
        click.echo(
            f"{(row['finished_at'] or '-')[:19]}  {row['job_id']}  {(row['email'] or row['owner'])[:28]:<28} "
            f"{row['model'][:32]:<32} {outcome:<18} {duration:>9}  {row['error'] or ''}"
        )


@main.group()
def keys() -> None:
    """API keys (users, tags, per-key limits) in NDIF_DATABASE_URL."""


def _engine():
    from . import db

    return db.engine_for(_settings().database_url)


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
    from . import db

    tags = tuple(t for t, on in (("trusted", trusted), ("priority", priority), ("admin", admin)) if on)
    key = db.create_key(_engine(), email, tags, rate_limit_per_min=rate_limit, max_concurrent_jobs=max_concurrent)
    shown = tags if trusted else ("untrusted", *tags)
    click.echo(f"key for {email} ({', '.join(shown)}); it is not shown again:")
    click.echo(key)


@keys.command("list")
@click.option("--json", "as_json", is_flag=True)
def keys_list(as_json: bool) -> None:
    """Every key by prefix, owner, tags and state (never the key itself)."""
    from . import db

    rows = db.list_keys(_engine())
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        state = "revoked" if row["revoked"] else "active"
        click.echo(f"{row['prefix']}  {row['email']:<32} {','.join(row['tags']) or '-':<18} {state}")


@keys.command("revoke")
@click.argument("key")
def keys_revoke(key: str) -> None:
    """Revoke KEY (the key, or its 8-character prefix from `keys list`)."""
    from . import db

    count = db.revoke_key(_engine(), key)
    if not count:
        raise click.ClickException("no such key")
    click.echo(f"revoked {count} key{'s' if count > 1 else ''}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the versions as JSON.")
def version(as_json: bool) -> None:
    """Versions of python, ndif-celery, nnsight, torch (+CUDA), transformers,
    celery, flask, redis-py and the redis-server binary."""
    from . import doctor

    report = doctor.versions()
    click.echo(json.dumps(report, indent=2) if as_json else doctor.render_versions(report))


@main.command()
def doctor() -> None:
    """Check this host: one line per check (OK, WARN, FAIL, SKIP) and the fix
    for each problem. Exits 1 if any check fails."""
    from . import doctor as checks

    results = checks.run()
    click.echo(checks.render(results))
    if checks.failed(results):
        failing = ", ".join(c.name for c in results if c.status == checks.FAIL)
        click.echo(f"\n{sum(c.status == checks.FAIL for c in results)} check(s) failed: {failing}", err=True)
        sys.exit(1)


@main.command()
@click.argument("service")
@click.option("-n", "--lines", default=100, show_default=True, type=click.IntRange(min=0),
              help="How many of the last lines to show.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing what the service logs, until Ctrl-C.")
def logs(service: str, lines: int, follow: bool) -> None:
    """Show the end of SERVICE's log ($NDIF_HOME/logs/SERVICE.log) from `up`."""
    from . import logs as service_logs

    settings = _settings()
    try:
        path = service_logs.resolve(settings, service)
        shown, offset = service_logs.tail(path, lines)
    except (service_logs.LogError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    for line in shown:
        click.echo(line)
    if not follow:
        return
    try:
        for text in service_logs.follow(path, offset):
            click.echo(text, nl=False)
    except KeyboardInterrupt:
        pass


def _exec(service: str, worker_name: Optional[str] = None) -> None:
    settings = _settings()
    if service == "redis" and not settings.embedded_redis:
        click.echo(f"warning: NDIF_REDIS_URL is set ({settings.redis_url}); the farm uses that Redis, "
                   f"not this one on port {settings.embedded_redis_port}", err=True)
    try:
        stack.exec_service(settings, service, worker_name)
    except (stack.StackError, OSError) as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.option("--name", default=None,
              help="Celery node name, unique per farm (default: gpu<ids>@<host>, or cpu@<host>).")
@click.option("--gpus", default=None, help="GPUs this worker owns, e.g. 0,1 (sets CUDA_VISIBLE_DEVICES).")
@click.option("--memory", type=float, default=None,
              help="Memory budget for models in GiB (default: the GPUs' memory, or half the RAM).")
def worker(name: Optional[str], gpus: Optional[str], memory: Optional[float]) -> None:
    """Run one worker in the foreground (one per GPU or GPU group of a farm)."""
    if gpus is not None:
        os.environ["NDIF_WORKER_GPUS"] = gpus
    if memory is not None:
        os.environ["NDIF_WORKER_MEMORY_GIB"] = str(memory)
    _exec("worker", name)


@main.command()
def web() -> None:
    """Run the web API (gunicorn) in the foreground."""
    _exec("web")


@main.command()
def beat() -> None:
    """Run Celery beat in the foreground: the periodic cleanup of expired jobs (one per farm)."""
    _exec("beat")


@main.command()
def flower() -> None:
    """Run Flower, the Celery monitor, in the foreground."""
    _exec("flower")


@main.command()
def redis() -> None:
    """Run the embedded Redis in the foreground (port NDIF_EMBEDDED_REDIS_PORT)."""
    _exec("redis")


if __name__ == "__main__":
    main(prog_name="ndif-celery")
