"""Real stacks for the end-to-end tests, started on demand and shared per session.

Each *kind* is a whole single-host stack (embedded Redis, gunicorn web, Celery
worker, Flower) started through the real CLI, differing only in where results
go and who is trusted: inline when small with the filesystem store (the
default), always through S3 (moto's S3-protocol server, run as a separate
process on loopback), every request untrusted and jailed, or auth on
with its keys' limits off (the farm the access tests share).
"""

from __future__ import annotations

from pathlib import Path

from tests.support.stacks.servers import MotoServer
from tests.support.stacks.stack import Stack

STACK_KINDS = ("fs", "s3", "isolated", "zygote", "auth")

# The jailed stacks' deadline: short, since attacks that spin or hang wait it
# out, yet with room for the residue scans (a walk over every object a child
# holds took 3.5 s idle and ran past 6 s on a loaded CI machine).
JAIL_TIMEOUT_S = 10
AUTH_LIMITS_OFF = {"NDIF_MAX_CONCURRENT_JOBS": "0", "NDIF_MAX_WEBSOCKETS_PER_KEY": "0", "NDIF_RATE_LIMIT_PER_MIN": "0",
                   "NDIF_MAX_QUEUE_DEPTH": "0", "NDIF_EXECUTION_TIMEOUT_S": "300", "NDIF_UPLOADS_PER_KEY": "0",
                   "NDIF_WEB_UPLOADS_PER_KEY": "0", "NDIF_MAX_RUNNING_PER_KEY": "0", "NDIF_RESULT_QUOTA_BYTES": "0",
                   "NDIF_MAX_PARKED_BYTES_PER_KEY": "0"}
SECRETS = {
    "NDIF_SECRET_KEY": "ndif-signing-secret-4f1d2a9c7e",
    "NDIF_OBJECT_STORE_SECRET_KEY": "object-store-secret-8b3e6d0a1f",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-access-key-2c7f9e4b1d",
}


class StackPool:
    def __init__(self, root: Path, base_env: dict) -> None:
        self.root = root
        self.base_env = dict(base_env)
        self.stacks: dict[str, Stack] = {}
        self.moto: MotoServer | None = None

    def get(self, kind: str) -> Stack:
        if kind not in self.stacks:
            # The full default stack only for the default kind: its tests look at Flower (the
            # dashboard's link, /metrics) and load two web processes (capacity).
            # Warm (tests/support/stacks/launcher.py) but for the jailed kinds, whose worker's memory
            # and process tree are what the attacks probe.
            stack = Stack(self.root / kind, env={**self.base_env, **self._env_for(kind)}, full=kind == "fs",
                          warm=kind not in ("isolated", "zygote"))
            stack.start()
            self.stacks[kind] = stack
        return self.stacks[kind]

    def _env_for(self, kind: str) -> dict:
        if kind == "fs":
            # Its crowds (test_capacity's 500 waiting clients) come from one loopback address,
            # as a farm's clients do behind a proxy: no bound per address on open websockets.
            return {"NDIF_WEBSOCKETS_PER_ADDRESS": "0"}
        if kind == "isolated":
            # Auth off, but every request untrusted, NDIF_ISOLATION=fork: the
            # children come from zygotes forked off the worker's fork server,
            # with secrets in the workers' environment for it to keep away.
            return {"NDIF_DEFAULT_TRUSTED": "0", "NDIF_EXECUTION_TIMEOUT_S": str(JAIL_TIMEOUT_S), "NDIF_ISOLATION": "fork", **SECRETS}
        if kind == "zygote":
            # The same, with the children forked by each model's clean zygote.
            return {"NDIF_DEFAULT_TRUSTED": "0", "NDIF_EXECUTION_TIMEOUT_S": str(JAIL_TIMEOUT_S), "NDIF_ISOLATION": "zygote", **SECRETS}
        if kind == "s3":
            if self.moto is None:
                self.moto = MotoServer()
                self.moto.start()
            return {
                "NDIF_MAX_INLINE_BYTES": "0",
                "NDIF_OBJECT_STORE_URL": self.moto.url,
                "NDIF_OBJECT_STORE_ACCESS_KEY": self.moto.access_key,
                "NDIF_OBJECT_STORE_SECRET_KEY": self.moto.secret_key,
                "NDIF_OBJECT_STORE_REGION": self.moto.region,
                "NDIF_OBJECT_STORE_BUCKET": "ndif-test-results",
            }
        if kind == "auth":
            # Auth on, for the modules whose subject is keys: which key is refused,
            # trusted, admin, whose job is whose, which jobs may share a forward.
            # The per-key limits are off (sixteen jobs of one key at once; the
            # auth-on defaults are test_auth_defaults', each limit test_limits');
            # the cache off, so a revoked key is refused at once; fork zygotes,
            # as no test here is about where a zygote comes from.
            return {"NDIF_AUTH": "1", "NDIF_AUTH_CACHE_S": "0", "NDIF_ISOLATION": "fork", **AUTH_LIMITS_OFF}
        raise KeyError(f"unknown stack kind {kind!r}; known: {STACK_KINDS}")

    def stored_result_exists(self, stack: Stack, job_id: str) -> bool:
        """Whether the stack's own result store holds the job's result."""
        from ndif_celery import config
        from ndif_celery.store import open_store

        store = open_store(config.load(stack.env))
        try:
            return len(store.get(f"results/{job_id}.pt")) > 0
        except FileNotFoundError:
            return False

    def close(self) -> None:
        for stack in self.stacks.values():
            stack.discard()
        self.stacks.clear()
        if self.moto is not None:
            self.moto.stop()
            self.moto = None
