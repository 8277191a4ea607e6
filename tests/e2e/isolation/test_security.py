"""Untrusted code against the jail: each test is one attack, run as a real
untrusted request through the real client. Each must be stopped (a clear
ERROR, or nothing gained), the worker must keep serving, and the next
request must be exactly right."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import sys
import time
import uuid

import httpx
import nnsight
import pytest
import torch
from nnsight.intervention.backends.remote import RemoteError

from tests.support import pace
from tests.support.cases.jail_fixtures import attempt, isolation, jail, still_serving_after, worker_pid  # noqa: F401
from tests.support.clients.remote import final_status, kill_stuck, poll
from tests.support.stacks.stack_pool import JAIL_TIMEOUT_S, SECRETS
from tests.support.cases.tiny_model import PROMPT

nnsight.register(__name__)  # the helpers below ship with the blocks, by value


def test_reading_etc_shadow_is_refused(jail, model):
    with pytest.raises(RemoteError, match="PermissionError"):
        with model.trace(PROMPT, remote=True):
            shadow = nnsight.save(open("/etc/shadow").read())  # noqa: F841


def readable_environs():
    found = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                found[pid] = open(f"/proc/{pid}/environ", "rb").read()
            except OSError:
                pass
    return found


def settings_in_memory():
    worker = sys.modules.get("workers.tasks")  # its this_worker holds the worker's settings
    return repr(worker.this_worker.settings) if worker else ""


def test_the_workers_secrets_are_not_there(jail, model):
    with model.trace(PROMPT, remote=True):
        env = nnsight.save(dict(os.environ))
        own = nnsight.save(attempt(lambda: open("/proc/self/environ", "rb").read()))
        others = nnsight.save(readable_environs())
        config = nnsight.save(settings_in_memory())
    # Both modes: the child's zygote is an exec'd interpreter, or a fork of the
    # fork server, which dropped the worker's settings module before any zygote.
    assert config == "", f"the {isolation(jail)} child has the worker's settings in memory"
    seen = json.dumps(env) + repr(own) + repr(others) + config
    for name, secret in SECRETS.items():
        assert secret not in seen, f"{name} leaked into the untrusted job"
    assert set(env) <= {"PATH", "LANG", "LC_ALL", "TZ", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                        "OMP_NUM_THREADS", "HOME", "TMPDIR"}


def write_everywhere(targets):
    return {target: attempt(lambda: open(target, "w").write("pwned")) for target in targets}


def test_writes_outside_the_private_temp_dir_are_refused(jail, model):
    marker = f"ndif-escape-{uuid.uuid4().hex[:8]}"
    outside = [f"/tmp/{marker}", f"{jail.home}/{marker}", f"/root/{marker}", f"{sys.prefix}/{marker}",
               f"/dev/shm/{marker}"]
    with model.trace(PROMPT, remote=True):
        outcomes = nnsight.save(write_everywhere(outside + [marker]))
        here = nnsight.save(os.getcwd())
    for target in outside:
        assert not outcomes[target].startswith("ok"), f"wrote {target}"
        assert not os.path.exists(target)
    assert outcomes[marker] == "ok: 5", "the private temp dir must be writable"
    assert not os.path.exists(os.path.join(here, marker)), "the temp dir outlived the job"


def test_no_network_not_even_loopback(jail, model):
    targets = [("127.0.0.1", jail.redis_port), ("127.0.0.1", jail.api_port), ("127.0.0.1", 5432)]
    status_url = f"{jail.url}/status"  # plain data: the stack object's class is the tests', not the server's
    with model.trace(PROMPT, remote=True):
        outcomes = nnsight.save([attempt(lambda t=t: socket.create_connection(t, timeout=2)) for t in targets])
        http = nnsight.save(attempt(lambda: httpx.get(status_url, timeout=2)))
    for outcome in outcomes + [http]:
        assert not outcome.startswith("ok"), outcome
        # seccomp refuses socket() itself (EPERM); behind it Landlock refuses TCP connect
        # (EACCES) and the empty network namespace has no route.
        assert any(word in outcome.lower() for word in ("operation not permitted", "permission denied",
                                                        "unreachable", "connecterror")), outcome


def test_a_fork_bomb_is_contained(jail, model):
    started = time.monotonic()
    # Stopped at the process cap (EAGAIN), or, when the forks keep replacing
    # the ones that die, at the deadline; either way the whole jail goes.
    with pytest.raises(RemoteError, match="BlockingIOError|Resource temporarily unavailable|died|execution timeout"):
        with model.trace(PROMPT, remote=True):
            while True:
                os.fork()
    assert time.monotonic() - started < pace.bound(30)


def test_unbounded_allocation_is_refused(jail, model):
    with pytest.raises(RemoteError, match="MemoryError"):
        with model.trace(PROMPT, remote=True):
            hoard = bytearray(1 << 40)  # noqa: F841
    with pytest.raises(RemoteError, match="RuntimeError|DefaultCPUAllocator|MemoryError"):
        with model.trace(PROMPT, remote=True):
            big = torch.ones(1 << 38)  # noqa: F841


def test_spinning_forever_hits_the_deadline(jail, model):
    started = time.monotonic()
    with pytest.raises(RemoteError, match=f"exceeded the execution timeout of {JAIL_TIMEOUT_S}s"):
        with model.trace(PROMPT, remote=True):
            while True:
                pass
    assert time.monotonic() - started < JAIL_TIMEOUT_S + pace.bound(14)


def kill_everything(real_worker_pid):
    outcomes = {"parent": attempt(lambda: os.kill(os.getppid(), 9)),
                "worker": attempt(lambda: os.kill(real_worker_pid, 9))}
    hits = []
    own_threads = {int(tid) for tid in os.listdir("/proc/self/task")}
    for pid in set(range(2, 4096)) - own_threads:
        try:
            os.kill(pid, 9)
            hits.append(pid)
        except OSError:
            pass
    outcomes["others_killed"] = hits
    return outcomes


def test_the_parent_worker_cannot_be_killed(jail, model, worker_pid):
    with model.trace(PROMPT, remote=True):
        outcomes = nnsight.save(kill_everything(worker_pid))
    assert outcomes["others_killed"] == []
    assert not outcomes["worker"].startswith("ok")
    os.kill(worker_pid, 0)  # still there (the fixture also checks it still serves)


def escape_with_ctypes():
    import _ctypes
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    shutil.copy(_ctypes.__file__, "escape.so")
    status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
    return {
        "unshare_net": libc.unshare(0x40000000),
        "mount_exec_tmpfs": libc.mount(b"tmpfs", b".", b"tmpfs", 0, None),
        "capabilities": (status["CapEff"].strip(), status["CapBnd"].strip()),
        "uid": os.getuid(),
        "load_own_library": attempt(lambda: ctypes.CDLL(os.path.abspath("escape.so"))),
        "shadow": attempt(lambda: open("/etc/shadow").read()),
    }


def test_c_extensions_cannot_undo_the_jail(jail, model):
    with model.trace(PROMPT, remote=True):
        outcome = nnsight.save(escape_with_ctypes())
    assert outcome["unshare_net"] == -1 and outcome["mount_exec_tmpfs"] == -1
    assert outcome["capabilities"] == ("0000000000000000", "0000000000000000")
    assert outcome["uid"] in (0, 65534)
    assert "failed to map segment" in outcome["load_own_library"] or "Permission" in outcome["load_own_library"]
    assert outcome["shadow"].startswith("PermissionError")


class Gadget:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}; cat /etc/shadow > {self.path}",))


def test_an_unpickling_gadget_runs_inside_the_jail_only(jail, model):
    target = f"/tmp/ndif-gadget-{uuid.uuid4().hex[:8]}"
    envelope = {"model_key": model.to_model_key(), "session_id": "", "compress": False, "env": {}}
    response = httpx.post(
        f"{jail.url}/request", data={"data": json.dumps(envelope)},
        files={"blob": ("request", pickle.dumps(Gadget(target)), "application/octet-stream")},
    )
    assert response.status_code == 200
    latest = final_status(jail.url, response.json()["id"])
    assert latest["status"] == "ERROR"
    assert "Your request payload could not be read" in latest["description"]
    assert not os.path.exists(target)


def test_weight_edits_do_not_reach_the_next_user(jail, model):
    with model.trace(PROMPT, remote=True):
        model.transformer.h[0].mlp.c_fc.weight[:] = 0
        model.transformer.h[1].mlp.c_proj.weight.data.zero_()
        model.transformer.ln_f.weight.data = torch.zeros_like(model.transformer.ln_f.weight)
        edited = model.transformer.h[3].output.save()
    with model.trace(PROMPT):
        clean = model.transformer.h[3].output.save()
    assert not torch.equal(edited, clean), "the edit did not even apply to its own run"
    # (the fixture then checks the next request equals a clean local run)


def test_the_rest_of_the_model_cache_is_out_of_reach(jail, model, hf_home, tiny_model_factory):
    """A child reads its own model's files, not another cached repo (served
    or refused, it is the same), not the cache's listing, not the hub token."""
    from tests.support.cases.tiny_model import snapshot_dir

    own = str(snapshot_dir(hf_home) / "config.json")
    other = str(tiny_model_factory("ndif-celery/tiny-gpt2-elsewhere", seed=7) / "config.json")
    token = hf_home / "token"
    token.write_text("hf_operators_own_token")
    try:
        with model.trace(PROMPT, remote=True):
            outcomes = nnsight.save({
                "own": attempt(lambda: open(own).read()[:1]),
                "other repo": attempt(lambda: open(other).read()[:1]),
                "cache listing": attempt(lambda: os.listdir(os.path.dirname(os.path.dirname(os.path.dirname(other))))),
                "hub token": attempt(lambda: open(str(token)).read()),
            })
    finally:
        token.unlink()
    assert outcomes["own"] == "ok: '{'", outcomes
    assert open(other).read()[:1] == "{"  # there to read, for the worker
    for what in ("other repo", "cache listing", "hub token"):
        assert outcomes[what].startswith("PermissionError"), (what, outcomes[what])


def peek_at_other_jobs(result_file, url):
    return {"file": attempt(lambda: open(result_file, "rb").read()[:10]),
            "http": attempt(lambda: httpx.get(url, timeout=2).text)}


def test_other_users_jobs_are_out_of_reach(jail, model):
    with model.trace(PROMPT, remote=True, blocking=False) as tracer:
        secret_logits = model.output.logits.save()  # noqa: F841
    other = tracer.backend
    poll(other)
    result_file = jail.home / "results" / "results" / f"{other.job_id}.pt"
    assert result_file.exists()
    url = f"{jail.url}/response/{other.job_id}"
    with model.trace(PROMPT, remote=True):
        peeked = nnsight.save(peek_at_other_jobs(str(result_file), url))
    assert not peeked["file"].startswith("ok"), peeked
    assert not peeked["http"].startswith("ok"), peeked


def test_spoofing_trusted_changes_nothing(jail, model, monkeypatch):
    from nnsight.schema.request import RequestModel

    original = RequestModel.metadata
    monkeypatch.setattr(RequestModel, "metadata", lambda self: json.dumps({**json.loads(original(self)), "trusted": True}))
    with model.trace(PROMPT, remote=True) as tracer:
        model.output.logits.save()
    assert tracer.backend.meta["isolated"] is True


def spin_in_python():
    while True:
        pass


def test_an_operator_kill_ends_an_isolated_job_at_once(jail, model):
    """Cancelled by the operator (not by the deadline), the ERROR there
    when ``ndif-celery kill`` returns."""
    kill_stuck(jail, model, spin_in_python)


def leave_a_mark():
    import builtins

    before = getattr(builtins, "ndif_mark", None)
    builtins.ndif_mark = "left by an earlier request"
    return before, os.getpid()


def test_each_request_gets_a_process_of_its_own(jail, model):
    """Requests are served by spares forked and jailed ahead of time, but never
    twice by the same process: what one request leaves behind, the next cannot see."""
    seen = []
    for _ in range(3):
        with model.trace(PROMPT, remote=True) as tracer:
            mark = nnsight.save(leave_a_mark())  # noqa: F841
        seen.append((mark, tracer.backend.meta))
    assert all(found is None for (found, _), _meta in seen), seen
    assert seen[-1][1]["spare"] is True, "the request after an isolated job found no spare ready"


def scan_own_memory(pattern_parts):
    """Every match of the pattern in this process's anonymous writable memory
    (heap, arenas, stacks): what code scanning its own memory with ctypes finds."""
    import ctypes
    import re

    pattern = re.compile(b"".join(pattern_parts))
    found = set()
    for line in open("/proc/self/maps"):
        fields = line.split()
        if not fields[1].startswith("rw") or (len(fields) > 5 and fields[5].startswith("/")):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if end - start <= 1 << 30:
            found.update(m.group(0).decode() for m in pattern.finditer(ctypes.string_at(start, end - start)))
    return sorted(found)


def test_no_residue_of_an_earlier_job_in_the_next_process(jail, model):
    """A job's payload (here carrying a marker, as it might carry a presigned
    URL or a secret prompt) must leave nothing the next job's process can find
    by scanning its own memory, in both modes: the child's zygote (exec'd, or
    forked from the fork server before the worker's first job) never received
    a payload."""
    marker = "NDIF" + "RESIDUE" + uuid.uuid4().hex[:24] + "END"
    with model.trace(PROMPT, remote=True):
        carried = nnsight.save(len(marker))
    assert carried == len(marker)
    with model.trace(PROMPT, remote=True):
        own = nnsight.save("NDIF" + "RESIDUE" + os.urandom(12).hex() + "END")
        found = nnsight.save(scan_own_memory([b"NDIF", b"RESIDUE[0-9a-f]{24}END"]))
    assert own in found, "the scan did not even find what this job put in its own memory"
    assert marker not in found and found == [own], found
