"""``ndif-celery`` commands about this host: the stack it runs and its services.

``up``/``down``/``status`` run a whole farm on this host (the logic lives in
:mod:`ndif_celery.host.stack`); ``web``, ``worker``, ``beat``, ``flower`` and
``redis`` replace themselves with one service in the foreground, for a
Procfile, systemd or a container, on any number of hosts; ``logs`` shows a
service's log (``version`` and ``doctor``, with their heavy imports, are in
:mod:`ndif_celery.cli.checks`). ``settings()`` is the one way
every command reads its configuration (a bad ``NDIF_*`` value is a clean CLI
error, not a traceback). Registered on the group in :mod:`ndif_celery.cli`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Optional

import click
import redis as redis_py

from ndif_celery import config
from ndif_celery.host import logs as service_logs
from ndif_celery.host import services, stack, supervisor
from ndif_celery.state import jobs, registry

from .common import settings


class _Interrupted(Exception):
    """Raised from a signal handler so ``up`` unwinds into stopping the stack."""


_TRAPPED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _raise_interrupted(signum, frame):
    raise _Interrupted(signal.Signals(signum).name)


def _stop(settings: config.Settings, timeout: float = 10) -> dict:
    # A second Ctrl-C must not abandon the stack half stopped; stop() is
    # bounded by its own timeouts.
    for signum in _TRAPPED:
        signal.signal(signum, signal.SIG_IGN)
    return supervisor.stop_all(settings, timeout)


@click.command()
@click.option("--detach", "-d", is_flag=True, help="Return once the stack is ready and leave it running, supervised.")
@click.option("--timeout", default=120.0, show_default=True, type=float,
              help="Seconds to wait for the stack to become ready.")
def up(detach: bool, timeout: float) -> None:
    """Run Redis, the web, a worker, beat and Flower on this host, supervised.

    In the foreground until Ctrl-C (or SIGTERM), which stops everything. A
    service that dies once the stack is up is restarted with backoff
    (``ndif_celery.host.supervisor``); with --detach a copy of `up` stays behind to
    do that, until `ndif-celery down`.
    """
    current = settings()
    _check_alert_webhook(current)
    _check_deployments(current)
    record = supervisor.read(current)
    if record.get("alive"):
        raise click.ClickException(
            f"ndif-celery is already running; run `ndif-celery down` first "
            f"(NDIF_HOME={current.home}: supervisor pid {record['pid']})")
    ready_fd = _detach() if detach else None  # from here on, in the supervisor
    for signum in _TRAPPED:
        signal.signal(signum, _raise_interrupted)

    try:
        started = stack.start(current)
    except stack.StackError as exc:
        raise click.ClickException(str(exc)) from None
    except _Interrupted:
        sys.exit(1)  # start() stopped what it had started
    click.echo(f"starting {', '.join(started)} (NDIF_HOME={current.home}, logs in {current.home / 'logs'})")
    keeper = supervisor.Supervisor(current, started, lambda line: click.echo(line, err=True))

    try:
        stack.wait_ready(current, timeout)
    except stack.StackError as exc:
        _stop(current)
        raise click.ClickException(f"{exc}\nstopped the stack.") from None
    except _Interrupted:
        click.echo("interrupted; stopping", err=True)
        _stop(current)
        sys.exit(1)

    click.echo(f"ndif-celery is up at {current.api_url}")
    if "flower" in started:
        click.echo(f"Flower: {stack.flower_url(current)}")
    for signum in _TRAPPED:
        signal.signal(signum, keeper.request_stop)  # from here, only between restarts
    if ready_fd is not None:
        click.echo("stop it with `ndif-celery down`")
        _detached_ready(current, ready_fd)
    else:
        click.echo("press Ctrl-C to stop")
    if keeper.run() == "down":
        click.echo("stopped by `ndif-celery down`")
        return
    click.echo("stopping")
    _stop(current)
    click.echo("stopped")


def _check_alert_webhook(current: config.Settings) -> None:
    """A malformed NDIF_ALERT_WEBHOOK_URL fails ``up``: the beat could send no alert to it
    (``doctor`` reports the same check)."""
    try:
        config.check_alert_webhook_url(current.alert_webhook_url)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


def deployments_warnings(current: config.Settings) -> list[str]:
    """Check NDIF_DEPLOYMENTS as the controller will read it (``ndif_celery.farm.deployments``):
    raises DeploymentsError naming the entry and field; returns the warnings. What ``up``
    refuses and ``doctor`` reports."""
    from ndif_celery.farm import deployments
    from ndif_celery.policy import model_policy

    entries = deployments.from_setting(current.deployments, model_policy.ModelPolicy.from_settings(current))
    return deployments.warnings(entries, current.auth)


def _check_deployments(current: config.Settings) -> None:
    """A bad NDIF_DEPLOYMENTS fails ``up`` before anything starts, naming the entry and field
    (the controller applies it once a worker is up)."""
    from ndif_celery.farm import deployments

    try:
        found = deployments_warnings(current)
    except deployments.DeploymentsError as exc:
        raise click.ClickException(str(exc)) from None
    for warning in found:
        click.echo(f"warning: NDIF_DEPLOYMENTS: {warning}", err=True)


def _detach() -> int:
    """Fork the supervisor, which goes on with `up` in a session of its own;
    this process waits for it to say "ready" and exits 0, or exits with its
    status when it fails (its error went to our terminal, which it shares
    until then). Returns, in the supervisor, the pipe to say "ready" on."""
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        os.setsid()  # no Ctrl-C or hang-up of this terminal reaches it
        return write_end
    os.close(write_end)
    said = b""
    try:
        while chunk := os.read(read_end, 64):
            said += chunk
    except KeyboardInterrupt:
        os.kill(pid, signal.SIGTERM)  # it stops what it started
    if said == b"ready":
        sys.exit(0)
    _, status_ = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status_) or 1)


def _detached_ready(current: config.Settings, ready_fd: int) -> None:
    """Let go of the terminal (output to $NDIF_HOME/logs/supervisor.log) and
    tell the waiting `up --detach` that the stack is ready."""
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(stack.log_path(current, "supervisor"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.write(ready_fd, b"ready")
    os.close(ready_fd)


@click.command()
@click.option("--timeout", default=10.0, show_default=True, type=float,
              help="Seconds each service gets to exit after SIGTERM before SIGKILL.")
def down(timeout: float) -> None:
    """Stop the stack that `up` started (fine if it is not running)."""
    current = settings()
    try:
        outcome = supervisor.stop_all(current, timeout)
    except stack.StackError as exc:
        raise click.ClickException(str(exc)) from None
    if not outcome:
        click.echo("ndif-celery is not running")
    for service, what in outcome.items():
        click.echo(f"{service}: {what}")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the farm as JSON (the /status document).")
def status(as_json: bool) -> None:
    """Show this host's services, and the farm: workers and the models they hold."""
    current = settings()
    farm = _farm_status(current)
    if as_json:
        if farm is None:
            raise click.ClickException(f"cannot reach the broker at {current.redis_url}")
        click.echo(json.dumps(farm, indent=2))
        return
    try:
        rows = stack.status(current)
    except stack.StackError as exc:
        raise click.ClickException(str(exc)) from None
    recorded = {service: (pid, alive) for service, pid, alive in rows}
    keeper = supervisor.read(current)
    if keeper:
        click.echo(f"{'supervisor':<10}{keeper['pid']:>8}  {'running' if keeper['alive'] else 'stopped'}")
    supervised = keeper.get("services", {})
    for service in recorded or services.default_services(current):
        pid, alive = recorded.get(service, (None, False))
        click.echo(f"{service:<10}{pid if pid else '-':>8}  {'running' if alive else 'stopped'}"
                   + _restarts(supervised.get(service)))
    answers = stack.api_answers(current)
    click.echo(f"{'api':<8}{stack.ping_url(current)}  {'answers' if answers else 'not answering'}")
    if farm is None:
        click.echo(f"farm: broker at {current.redis_url} not reachable")
        return
    click.echo("\nworkers:")
    for name, info in sorted(farm["cluster"]["workers"].items()):
        gpus = ",".join(info["gpus"]) or "cpu"
        click.echo(
            f"  {name:<28} nnsight {info.get('nnsight') or '-':<8} gpus={gpus:<6} used {_mib(info['memory_used_bytes'])} "
            f"of {_mib(info['memory_bytes'])}  job={info['current_job'] or '-'}"
        )
    click.echo("deployments:")
    hot = [e for e in farm["deployments"].values() if e["deployment_level"] == "HOT"]
    for entry in sorted(hot, key=lambda e: (e["repo_id"], e.get("nnsight") or "", e.get("dtype") or "", e["worker"])):
        pin = " pinned" if entry["pinned"] else ""
        held = f" measured {_mib(entry['measured_bytes'])}" if entry.get("measured_bytes") else ""
        click.echo(f"  {entry['repo_id']:<36} nnsight {entry.get('nnsight') or '-':<8} "
                   f"{entry.get('dtype') or 'as saved':<9} {entry['application_state']:<10} on {entry['worker']}{pin}"
                   f"{held}")


def _restarts(record: Optional[dict]) -> str:
    """``  restarts N, last exit: <reason> at <time>`` from the supervisor's record."""
    if not record:
        return ""
    text = f"  restarts {record['restarts']}"
    last = record.get("last_exit")
    if last:
        text += f", last exit: {last['reason']} at {last['at']}"
    if record.get("restarting"):
        text += " (restarting)"
    return text


def _mib(n: int) -> str:
    return f"{(n or 0) / 1024**2:.1f} MiB"


def _farm_status(settings: config.Settings) -> Optional[dict]:
    try:
        return registry.status_document(jobs.connect(settings.redis_url), operator=True)
    except (redis_py.RedisError, OSError):
        return None


@click.command()
@click.argument("service")
@click.option("-n", "--lines", default=100, show_default=True, type=click.IntRange(min=0),
              help="How many of the last lines to show.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing what the service logs, until Ctrl-C.")
def logs(service: str, lines: int, follow: bool) -> None:
    """Show the end of SERVICE's log ($NDIF_HOME/logs/SERVICE.log) from `up`."""
    current = settings()
    try:
        path = service_logs.resolve(current, service)
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


# -- one service in the foreground ----------------------------------------------------


def _exec(service: str, worker_name: Optional[str] = None) -> None:
    current = settings()
    if service == "redis" and not current.embedded_redis:
        click.echo(f"warning: NDIF_REDIS_URL is set ({current.redis_url}); the farm uses that Redis, "
                   f"not this one on port {current.embedded_redis_port}", err=True)
    try:
        services.exec_service(current, service, worker_name)
    except (stack.StackError, OSError) as exc:
        raise click.ClickException(str(exc)) from None


@click.command()
@click.option("--name", default=None,
              help="Celery node name, unique per farm (default: gpu<ids>@<host>, or cpu@<host>).")
@click.option("--gpus", default=None, help="GPUs this worker owns, e.g. 0,1 (sets CUDA_VISIBLE_DEVICES).")
@click.option("--memory", type=float, default=None,
              help="Memory budget for models in GiB (default: the GPUs' memory, or half the RAM).")
@click.option("--nnsight", "nnsight_version", default=None, metavar="VERSION",
              help="Serve the clients of this nnsight version, with its runtime (`ndif-celery runtime add`).")
def worker(name: Optional[str], gpus: Optional[str], memory: Optional[float], nnsight_version: Optional[str]) -> None:
    """Run one worker in the foreground (one per GPU or GPU group of a farm)."""
    if gpus is not None:
        os.environ["NDIF_WORKER_GPUS"] = gpus
    if memory is not None:
        os.environ["NDIF_WORKER_MEMORY_GIB"] = str(memory)
    if nnsight_version is not None:
        os.environ["NDIF_WORKER_NNSIGHT"] = nnsight_version
    _exec("worker", name)


def _service_command(service: str, help_text: str) -> click.Command:
    """``ndif-celery SERVICE``: run that one service in the foreground (no options)."""
    return click.Command(service, callback=lambda: _exec(service), help=help_text)


# The services without options, one command each (the worker has its own, above).
SERVICES = [
    _service_command("web", "Run the web API (gunicorn) in the foreground."),
    _service_command("beat", "Run Celery beat in the foreground: the periodic cleanup of expired jobs (one per farm)."),
    _service_command("flower", "Run Flower, the Celery monitor, in the foreground."),
    _service_command("redis", "Run the embedded Redis in the foreground (port NDIF_EMBEDDED_REDIS_PORT)."),
]

COMMANDS = [up, down, status, logs, worker, *SERVICES]
