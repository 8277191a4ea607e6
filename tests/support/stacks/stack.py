"""Run the real single-host stack through the real CLI, for end-to-end tests.

    with Stack(tmp_path / "home") as stack:
        httpx.get(stack.url + "/ping")

Every stack gets its own ``NDIF_HOME`` and free loopback ports, so tests (and
a developer's own stack on the default ports) never meet. The stack runs
detached (``ndif-celery up --detach``), exactly as a user would run it, and is
stopped with ``ndif-celery down``.

Import it as ``from tests.support.stacks.stack import Stack``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from tests.support import pace
from tests.support.paths import ROOT
from tests.support.stacks.servers import free_ports, refuse_in_fast_tier

# Inherited settings that would point the stack at someone else's services or
# files; a test that wants one passes it in ``env``.
_NOT_INHERITED = (
    "NDIF_HOME", "NDIF_REDIS_URL", "NDIF_API_URL", "NDIF_API_HOST", "NDIF_API_PORT",
    "NDIF_EMBEDDED_REDIS_PORT", "NDIF_FLOWER_PORT", "NDIF_RESULTS_DIR", "NDIF_DATABASE_URL",
    "NDIF_WORKER_METRICS_PORT", "NDIF_FLOWER_URL",
)


class StackFailed(RuntimeError):
    pass


class Stack:
    """One single-host stack in ``home``, driven through ``python -m ndif_celery.cli``."""

    def __init__(self, home: Path, env: Optional[dict] = None, full: bool = False, warm: bool = False):
        """``full``: the product's default services, Flower and two web processes.
        A stack whose tests look at neither goes lean: no Flower
        (``NDIF_FLOWER_PORT=0``) and one web process, two processes fewer to
        start and keep. ``env`` still wins over either. ``warm``: its workers
        are forked from this pytest process's launcher, which has imported
        torch already (tests/support/stacks/launcher.py); never where the worker's
        process is what the tests prove."""
        self.home = Path(home).resolve()
        self.home.mkdir(parents=True, exist_ok=True)
        env = dict(env or {})
        base = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
        api, redis_port, flower_port, metrics = free_ports(4)
        base.update(
            NDIF_HOME=str(self.home),
            NDIF_API_PORT=str(api),
            NDIF_EMBEDDED_REDIS_PORT=str(redis_port),
            NDIF_FLOWER_PORT=str(flower_port if full else 0),
            # The worker's /metrics (a worker added later takes the next free port).
            NDIF_WORKER_METRICS_PORT=str(metrics),
        )
        # The suites' stacks serve every (test) repo to every key, so an untrusted
        # request may deploy the tiny model on first use, as before the model policy;
        # tests/e2e/access/test_model_policy.py runs the product default (NDIF_MODELS empty) explicitly.
        base.setdefault("NDIF_MODELS", "*")
        if not full:
            base["NDIF_WEB_WORKERS"] = "1"
        base.update({k: str(v) for k, v in env.items()})
        self.env = base
        self.api_port = int(self.env["NDIF_API_PORT"])
        self.redis_port = int(self.env["NDIF_EMBEDDED_REDIS_PORT"])
        self.flower_port = int(self.env["NDIF_FLOWER_PORT"])
        self.warm = warm
        self.started = False
        self.extra_processes: dict[str, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def redis_url(self) -> str:
        return self.env.get("NDIF_REDIS_URL") or f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def flower_url(self) -> str:
        return f"http://127.0.0.1:{self.flower_port}"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    def cli(self, *args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess:
        """Run ``ndif-celery <args>`` against this stack; output captured as text."""
        result = subprocess.run(
            [sys.executable, "-m", "ndif_celery.cli", *args],
            cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout,
        )
        if check and result.returncode != 0:
            raise StackFailed(self._report(f"`ndif-celery {' '.join(args)}` exited {result.returncode}", result))
        return result

    def create_key(self, email: str, trusted: bool = False) -> str:
        """A new API key for ``email`` (``ndif-celery keys create``)."""
        made = self.cli("keys", "create", "--email", email, *(["--trusted"] if trusted else []), check=True)
        return made.stdout.strip().splitlines()[-1]

    def start(self, timeout: float = 180) -> "Stack":
        """``up --detach``: returns once the stack is ready, else raises with every log."""
        timeout = pace.bound(timeout)
        refuse_in_fast_tier("a stack")
        if self.warm:
            from tests.support.stacks import launcher

            self.env.update(launcher.stack_env(self.env))
        try:
            result = self.cli("up", "--detach", "--timeout", str(timeout), timeout=timeout + 60)
        except subprocess.TimeoutExpired as exc:
            self.stop()
            raise StackFailed(f"`ndif-celery up` did not return within {timeout + 60:.0f}s\n{self.logs()}") from exc
        if result.returncode != 0:
            raise StackFailed(self._report(f"`ndif-celery up --detach` exited {result.returncode}", result))
        self.started = True
        return self

    def stop(self, timeout: float = 10) -> subprocess.CompletedProcess:
        """``down`` (fine when nothing runs), and any extra processes."""
        self.started = False
        for proc in self.extra_processes.values():
            _stop_process(proc, timeout)
        self.extra_processes.clear()
        return self.cli("down", "--timeout", str(timeout), timeout=timeout * 5 + 60)

    def discard(self) -> dict:
        """Teardown: every process of the stack killed at once (``down
        --timeout 0``, in this process: SIGTERM then SIGKILL without waiting),
        the extra processes too.

        Why not :meth:`stop` (a graceful ``down``): a fixture's teardown tests
        nothing, and a graceful stop waits out each service's shutdown in turn
        (~3 s of CPU-bound Celery and gunicorn shutdown per stack, against about a
        second here), for every stack the suite starts. What a graceful ``down`` does is
        asserted where it is the point (tests/e2e/host/test_cli.py, tests/e2e/farm/test_reliability.py).
        """
        from ndif_celery import config
        from ndif_celery.host import supervisor

        self.started = False
        for proc in self.extra_processes.values():
            _stop_process(proc, 0)
        self.extra_processes.clear()
        return supervisor.stop_all(config.load(self.env), 0)

    def add_worker(self, name: str, gpus: str, memory_gib: float, timeout: float = 120,
                   nnsight: str = "") -> subprocess.Popen:
        """Start one more worker through ``ndif-celery worker``, as a second GPU
        (or host) would join the farm, and wait until it has registered.
        ``nnsight``: the runtime it serves (added under the stack's home first)."""
        import redis

        from ndif_celery.state import registry

        log = (self.logs_dir / f"worker-{name.replace('@', '-')}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "ndif_celery.cli", "worker", "--name", name, "--gpus", gpus,
             "--memory", str(memory_gib), *(("--nnsight", nnsight) if nnsight else ())],
            cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.extra_processes[name] = proc
        client = redis.Redis.from_url(self.redis_url)
        timeout = pace.bound(timeout)
        deadline = time.monotonic() + timeout
        while not client.hexists(registry.WORKERS, name):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise StackFailed(f"worker {name} did not register\n{self.logs()}")
            time.sleep(0.2)
        return proc

    def pids(self) -> dict[str, int]:
        """service -> pid, as recorded in the state file (empty when stopped)."""
        import json

        try:
            state = json.loads((self.home / "run" / "stack.json").read_text())
        except FileNotFoundError:
            return {}
        return {service: int(entry["pid"]) for service, entry in state.items()}

    def until(self, check, what: str, timeout_s: float = 90.0, interval_s: float = 0.25):
        """``check()`` once it is truthy; past ``timeout_s`` an AssertionError
        naming ``what``, with the last lines of every service's log."""
        from tests.support.waiting import wait_until

        return wait_until(check, timeout_s, what, report=lambda: self.logs(30), interval_s=interval_s,
                          error=AssertionError)

    def logs(self, lines: int = 60) -> str:
        """The last lines of every service's log, one block per service."""
        blocks = []
        for path in sorted(self.logs_dir.glob("*.log")) if self.logs_dir.is_dir() else []:
            text = path.read_text(errors="replace").splitlines()[-lines:]
            blocks.append(f"==> {path} <==\n" + "\n".join(text))
        return "\n\n".join(blocks) or f"(no logs under {self.logs_dir})"

    def _report(self, what: str, result: subprocess.CompletedProcess) -> str:
        return f"{what}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}\n--- logs\n{self.logs()}"

    def run_service(self, service: str) -> subprocess.Popen:
        """Start one more ``ndif-celery <service>`` (say, a web restarted by hand)."""
        log = (self.logs_dir / f"{service}-again.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "ndif_celery.cli", service], cwd=ROOT, env=self.env,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.extra_processes[f"{service}-{proc.pid}"] = proc
        return proc

    def wait_answers(self, timeout_s: float = 60) -> None:
        """Until ``GET /ping`` answers 200 (a web or Redis coming back)."""
        import httpx

        timeout_s = pace.bound(timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/ping", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise StackFailed(f"{self.url} did not answer /ping within {timeout_s:.0f} s\n{self.logs()}")
            time.sleep(0.2)

    def farm(self) -> dict:
        """``GET /status``."""
        import httpx

        return httpx.get(f"{self.url}/status", timeout=10).json()

    def operator_farm(self) -> dict:
        """The status document as operators see it (``ndif-celery status``, the
        dashboard): with each worker's ``current_job``, which ``/status`` omits."""
        import redis

        from ndif_celery.state import registry

        return registry.status_document(redis.Redis.from_url(self.redis_url), operator=True)

    def __enter__(self) -> "Stack":
        if not self.started:
            self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.discard()


def _stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM the process group, SIGKILL it if it lingers (at once with ``timeout`` 0)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def offline_env(hf_home: Path) -> dict:
    """The environment that points a stack at the tests' offline model cache."""
    return {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@contextlib.contextmanager
def client_on_stack(home: Path, hf_home: Path, env: Optional[dict] = None, workers: tuple = (), warm: bool = True,
                    full: bool = False):
    """A stack of its own for a test module: the offline model cache, ``env``,
    extra workers ``(name, gpus, memory_gib)``, and the real client pointed at
    it (its host, API key and compression restored afterwards)."""
    import nnsight

    stack = Stack(home, env={**offline_env(hf_home), **(env or {})}, full=full, warm=warm)
    stack.start()
    api = nnsight.CONFIG.API
    saved = api.HOST, api.APIKEY, api.COMPRESS
    try:
        for name, gpus, memory_gib in workers:
            stack.add_worker(name, gpus=gpus, memory_gib=memory_gib)
        api.HOST = stack.url
        yield stack
    finally:
        api.HOST, api.APIKEY, api.COMPRESS = saved
        stack.discard()
