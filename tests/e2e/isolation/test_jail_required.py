"""A worker whose host lacks a jail layer the operator waives runs untrusted
jobs without it, and says so.

This stack's worker really lacks two layers: the pids cgroup root
(``NDIF_JAIL_CGROUP_ROOT``) is a plain directory, not a cgroup, so no job
cgroup can be made, and seccomp is switched off by the operator
(``NDIF_JAIL_DISABLE``). ``NDIF_JAIL_REQUIRE`` waives both, so the job runs
and ``meta.jail`` says what it ran without. With seccomp off, the UNIX-socket
attack is stopped by the mount masks alone. Without the waiver the child
refuses the request, naming both layers: tests/inprocess/workers/isolation/test_zygote.py.
"""

from __future__ import annotations

import socket

import nnsight
import pytest
import torch

from ndif_celery.policy.jail_layers import LAYERS
from tests.support.cases.jail_fixtures import attempt, connect_unix, listen_beside, unix_socket_targets
from tests.support.stacks.stack import Stack, offline_env
from tests.support.cases.tiny_model import PROMPT

nnsight.register(__name__)


def weak_env(tmp_path, **extra) -> dict:
    not_a_cgroup = tmp_path / "not-a-cgroup"
    not_a_cgroup.mkdir(exist_ok=True)
    return {"NDIF_DEFAULT_TRUSTED": "0", "NDIF_EXECUTION_TIMEOUT_S": "10", "NDIF_ISOLATION": "zygote",
            "NDIF_JAIL_CGROUP_ROOT": str(not_a_cgroup), "NDIF_JAIL_DISABLE": "seccomp", **extra}


@pytest.fixture(scope="module")
def weak_stack(tmp_path_factory, hf_home):
    """No pids cgroup (its root is a plain directory) and no seccomp (disabled), both waived."""
    root = tmp_path_factory.mktemp("weak")
    stack = Stack(root / "home", env={**offline_env(hf_home),
                                       **weak_env(root, NDIF_JAIL_REQUIRE="all,-pids_cgroup,-seccomp")})
    stack.start()
    saved = nnsight.CONFIG.API.HOST, nnsight.CONFIG.API.COMPRESS
    nnsight.CONFIG.API.HOST, nnsight.CONFIG.API.COMPRESS = stack.url, True
    yield stack
    nnsight.CONFIG.API.HOST, nnsight.CONFIG.API.COMPRESS = saved
    stack.discard()


def test_a_waived_layer_lets_the_job_run_and_meta_says_so(weak_stack, model):
    with model.trace(PROMPT, remote=True) as tracer:
        remote = model.transformer.h[3].output.save()
    with model.trace(PROMPT):
        local = model.transformer.h[3].output.save()
    assert torch.equal(remote, local)
    reported = tracer.backend.meta["jail"]
    assert reported["waived"] == "pids_cgroup,seccomp"
    assert {name: reported[name] for name in LAYERS} == {name: name not in ("pids_cgroup", "seccomp") for name in LAYERS}


@pytest.fixture
def listening(weak_stack):
    yield from listen_beside(weak_stack)


def test_without_seccomp_the_mounts_alone_hide_the_unix_sockets(weak_stack, model, listening):
    targets = unix_socket_targets(listening)
    # A first job, so the child of the attack below is forked after the sockets exist.
    with model.trace(PROMPT, remote=True):
        model.transformer.h[0].output.save()
    with model.trace(PROMPT, remote=True):
        outcomes = nnsight.save(connect_unix(targets))
        made = nnsight.save(attempt(lambda: socket.socket(socket.AF_UNIX).close()))
    assert made == "ok: None", "seccomp is off here: the mounts are what stops the attack"
    for path, outcome in outcomes.items():
        assert not outcome.startswith("ok"), f"{path}: {outcome}"
        if path.startswith("\0"):  # abstract: Landlock's scope (ABI 6)
            assert "PermissionError" in outcome or "ConnectionRefused" in outcome, f"{path!r}: {outcome}"
        else:  # an empty mount over its directory (FileNotFoundError), or /dev/null bound over it
            assert "FileNotFoundError" in outcome or "ConnectionRefusedError" in outcome, f"{path}: {outcome}"
