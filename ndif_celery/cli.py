"""The ``ndif-celery`` command.

``up``/``down``/``status`` run a whole farm on this host (see
:mod:`ndif_celery.stack`, where the logic lives). ``web``, ``worker``,
``flower`` and ``redis`` replace themselves with one service in the
foreground, for a Procfile, systemd or a container, on any number of hosts.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Optional

import click

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
def status() -> None:
    """Show each service of the stack and whether the web answers."""
    settings = _settings()
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
def flower() -> None:
    """Run Flower, the Celery monitor, in the foreground."""
    _exec("flower")


@main.command()
def redis() -> None:
    """Run the embedded Redis in the foreground (port NDIF_EMBEDDED_REDIS_PORT)."""
    _exec("redis")


if __name__ == "__main__":
    main(prog_name="ndif-celery")
