"""Jail layers that must be there, or the job is refused.

The attacks run as real untrusted requests through the real client, once per
isolation mode (``jail``): a block that tries every pathname and abstract UNIX
socket of the host (the local PostgreSQL and MariaDB included) and sockets
this test binds in /tmp and in the stack's NDIF_HOME, and a block that makes
every system call the seccomp filter refuses with ``ctypes``, and one that
opens a socket of every family. Each gains
nothing, and the same worker keeps serving, exactly right.

A worker that lacks a layer refuses: tests/e2e/isolation/test_jail_required.py.
"""

from __future__ import annotations

import errno
import os

import nnsight
import pytest
import torch
from nnsight.intervention.backends.remote import RemoteError

from ndif_celery.policy.jail_layers import LAYERS
from tests.support.cases.jail_fixtures import (  # noqa: F401
    connect_unix,
    jail,
    listen_beside,
    still_serving_after,
    unix_socket_targets,
    worker_pid,
)
from tests.support.cases.tiny_model import PROMPT

nnsight.register(__name__)  # the helpers below ship with the blocks, by value


@pytest.fixture
def listening(jail):
    yield from listen_beside(jail)


def test_no_unix_socket_of_the_host_can_be_reached(jail, model, listening):
    targets = unix_socket_targets(listening)
    for path in listening[:2]:  # the test itself can reach its own sockets
        assert connect_unix([path])[path] == "ok: 'connected'"
    with model.trace(PROMPT, remote=True):
        outcomes = nnsight.save(connect_unix(targets))
    assert set(outcomes) == set(targets)
    for path, outcome in outcomes.items():
        assert not outcome.startswith("ok"), f"{path}: {outcome}"
        # seccomp refuses socket(AF_UNIX) before any path is looked at.
        assert "PermissionError" in outcome and "Operation not permitted" in outcome, f"{path}: {outcome}"


def forbidden_calls():
    """Each refused system call, made with ctypes: -1 and the errno it got.

    Arguments are chosen so that without the filter most calls fail with
    another errno (EFAULT, EINVAL) or succeed harmlessly: EPERM here is the filter."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    parent = os.getppid()
    clone_newns_fs = 0x00020000 | 0x00000200  # CLONE_NEWNS|CLONE_FS: EINVAL without the filter
    clone_newuser_fs = 0x10000000 | 0x00000200
    calls = {
        "io_uring_setup": (425, 1, 0), "io_uring_enter": (426, 0, 0, 0, 0, 0), "io_uring_register": (427, 0, 0, 0, 0),
        "ptrace": (101, 0x4206, parent, 0, 0), "process_vm_readv": (310, parent, 0, 0, 0, 0, 0),
        "process_vm_writev": (311, parent, 0, 0, 0, 0, 0), "bpf": (321, 0, 0, 0), "perf_event_open": (298, 0, 0, -1, -1, 0),
        "userfaultfd": (323, 0), "keyctl": (250, 0, -3, 0), "add_key": (248, 0, 0, 0, 0, 0), "request_key": (249, 0, 0, 0, 0),
        "mount": (165, 0, 0, 0, 0, 0), "umount2": (166, 0, 0), "unshare": (272, 0x40000000), "setns": (308, -1, 0),
        "pivot_root": (155, 0, 0), "chroot": (161, 0), "open_tree": (428, -1, 0, 0), "move_mount": (429, -1, 0, -1, 0, 0),
        "fsopen": (430, 0, 0), "fsconfig": (431, -1, 0, 0, 0, 0), "fsmount": (432, -1, 0, 0), "fspick": (433, -1, 0, 0),
        "mount_setattr": (442, -1, 0, 0, 0, 0), "kexec_load": (246, 0, 0, 0, 0), "kexec_file_load": (320, -1, -1, 0, 0, 0),
        "init_module": (175, 0, 0, 0), "finit_module": (313, -1, 0, 0), "delete_module": (176, 0, 0),
        "reboot": (169, 0, 0, 0, 0), "swapon": (167, 0, 0), "swapoff": (168, 0), "acct": (163, 0),
        "quotactl": (179, 0, 0, 0, 0), "name_to_handle_at": (303, -1, 0, 0, 0, 0), "open_by_handle_at": (304, -1, 0, 0),
        "lookup_dcookie": (212, 0, 0, 0), "clone_newns": (56, clone_newns_fs, 0, 0, 0, 0),
        "clone_newuser": (56, clone_newuser_fs, 0, 0, 0, 0), "personality_no_aslr": (135, 0x0040000),
        "clone3": (435, 0, 0),
    }
    out = {}
    for name, (nr, *args) in calls.items():
        ctypes.set_errno(0)
        result = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
        out[name] = (result, errno.errorcode.get(ctypes.get_errno(), ""))
    out["personality_query"] = (libc.syscall(ctypes.c_long(135), ctypes.c_long(0xffffffff)), "")
    return out


def test_refused_system_calls_get_eperm(jail, model):
    with model.trace(PROMPT, remote=True):
        outcomes = nnsight.save(forbidden_calls())
        # The model, torch's thread pool and gradients still work under the filter.
        hidden = model.transformer.h[2].output.save()
    for name, (result, code) in outcomes.items():
        if name == "personality_query":
            assert result >= 0, "reading the personality stays allowed"
            continue
        expected = "ENOSYS" if name == "clone3" else "EPERM"  # clone3: libc falls back to clone()
        assert (result, code) == (-1, expected), f"{name}: {result} {code}"
    assert hidden.shape[0] == 1 and torch.isfinite(hidden).all()


# Each family with a type its kernel module accepts unprivileged where it is
# loaded (without the filter: a socket, or EAFNOSUPPORT/EPERM where not), and
# families past the last one Linux defines.
SOCKET_FAMILIES = {
    "UNIX": (1, 1, 0), "INET": (2, 2, 0), "INET6": (10, 2, 0), "KEY": (15, 3, 2), "NETLINK": (16, 3, 0),
    "PACKET": (17, 3, 0), "RDS": (21, 5, 0), "CAN": (29, 3, 1), "TIPC": (30, 4, 0), "BLUETOOTH": (31, 3, 0),
    "ALG": (38, 5, 0), "VSOCK": (40, 1, 0), "XDP": (44, 3, 0), "MCTP": (45, 2, 0), "46": (46, 1, 0),
    "200": (200, 1, 0),
}


def socket_families():
    """``socket(family, type, protocol)`` of each of ``SOCKET_FAMILIES`` by the
    system call itself: the file descriptor (closed again), or -1 and its errno."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    out = {}
    for name, (family, kind, protocol) in SOCKET_FAMILIES.items():
        ctypes.set_errno(0)
        fd = libc.syscall(ctypes.c_long(41), ctypes.c_long(family), ctypes.c_long(kind), ctypes.c_long(protocol))
        out[name] = (-1, errno.errorcode.get(ctypes.get_errno(), "")) if fd < 0 else (0, "")
        if fd >= 0:
            os.close(fd)
    return out


def test_no_socket_family_can_be_opened(jail, model):
    """The child needs no socket: socket() of every family is refused (EPERM),
    whatever the namespaces and Landlock would leave of it. Outside the jail
    this process opens the same INET, INET6, NETLINK and UNIX sockets."""
    outside = socket_families()
    assert all(outside[name] == (0, "") for name in ("UNIX", "INET", "INET6", "NETLINK")), outside
    with model.trace(PROMPT, remote=True):
        inside = nnsight.save(socket_families())
        hidden = model.transformer.h[2].output.save()
    assert inside == {name: (-1, "EPERM") for name in SOCKET_FAMILIES}, inside
    assert torch.isfinite(hidden).all()


def test_meta_reports_every_layer_in_place(jail, model):
    with model.trace(PROMPT, remote=True) as tracer:
        model.transformer.h[0].output.save()
    reported = tracer.backend.meta["jail"]
    assert {name: reported[name] for name in LAYERS} == {name: True for name in LAYERS}
    assert reported["waived"] == ""
