"""Fixtures shared by the attack suites (``tests/e2e/isolation/test_security*.py``).

Each attack module imports ``jail``, ``worker_pid`` and
``still_serving_after`` from here, so every attack runs once per isolation
mode (children of the fork server, ``NDIF_ISOLATION=fork``, and of the
model's zygote, ``=zygote``) and is followed by the same check: the same
worker answers, exactly right. ``attempt`` ships with the blocks by value.
"""

from __future__ import annotations

import os
import socket
import uuid

import nnsight
import pytest
import torch

from tests.support.cases.tiny_model import PROMPT

nnsight.register(__name__)  # attempt() below runs inside remote blocks


@pytest.fixture(scope="module", params=["isolated", "zygote"])
def jail(stack_pool, request):
    """Each attack runs against both isolation modes: NDIF_ISOLATION=fork
    (the ``isolated`` stack) and =zygote."""
    stack = stack_pool.get(request.param)
    saved = nnsight.CONFIG.API.HOST, nnsight.CONFIG.API.COMPRESS
    nnsight.CONFIG.API.HOST, nnsight.CONFIG.API.COMPRESS = stack.url, True
    yield stack
    nnsight.CONFIG.API.HOST, nnsight.CONFIG.API.COMPRESS = saved


@pytest.fixture
def worker_pid(jail):
    (info,) = jail.farm()["cluster"]["workers"].values()
    return info["pid"]


@pytest.fixture(autouse=True)
def still_serving_after(jail, worker_pid, model):
    """After every attack: the same worker answers, and exactly right."""
    yield
    with model.trace(PROMPT, remote=True) as tracer:
        remote = model.transformer.h[3].output.save()
    with model.trace(PROMPT):
        local = model.transformer.h[3].output.save()
    assert torch.equal(remote, local)
    assert tracer.backend.meta["isolated"] is True
    (info,) = jail.farm()["cluster"]["workers"].values()
    assert info["pid"] == worker_pid, "the worker was replaced"


def isolation(stack) -> str:
    return stack.env.get("NDIF_ISOLATION", "zygote")


def attempt(fn):
    """Run ``fn``; its outcome as a string (value, or the error's type and text)."""
    try:
        return f"ok: {fn()!r}"
    except BaseException as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"


# --- UNIX sockets of the host, as the jail-layer attacks' targets ---


def host_unix_sockets() -> list:
    """Every pathname UNIX socket bound on this host, as the test process sees them."""
    paths = set()
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            fields = line.split(None, 7)
            if len(fields) == 8 and fields[7].startswith("/"):
                paths.add(fields[7].strip())
    return sorted(paths)


def listen_beside(stack):
    """Sockets the test listens on: in /tmp, in the stack's NDIF_HOME, and an abstract one."""
    tag = uuid.uuid4().hex[:8]
    paths = [f"/tmp/ndif-h2-{tag}.sock", str(stack.home / f"ndif-h2-{tag}.sock")]
    servers = []
    for path in paths:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen()
        servers.append(server)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind(f"\0ndif-h2-{tag}")
    abstract.listen()
    servers.append(abstract)
    yield paths + [f"\0ndif-h2-{tag}"]
    for server in servers:
        server.close()
    for path in paths:
        os.unlink(path)


def connect_unix(targets):
    """Try to connect to each UNIX socket path; the outcome of each."""
    def one(path):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(2)
            s.connect(path)
            return "connected"
        finally:
            s.close()

    return {path: attempt(lambda p=path: one(p)) for path in targets}


def unix_socket_targets(own) -> list:
    targets = host_unix_sockets() + list(own)
    assert "/var/run/postgresql/.s.PGSQL.5432" in targets or "/run/postgresql/.s.PGSQL.5432" in targets, \
        "this host's PostgreSQL socket is the attack's main target"
    return targets
