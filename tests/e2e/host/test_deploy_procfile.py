"""``honcho start`` runs the ``Procfile`` as a working farm: every process
comes up, the real nnsight client gets its answer through it, and stopping
honcho leaves no process of the farm behind. The lines read without
running them: tests/unit/deploy/test_procfile.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

from tests.support.stacks.deploy_recipes import PROCFILE, ROOT, VENV_BIN, procfile
from tests.support.stacks.servers import free_ports, port_open
from tests.support.stacks.stack import _NOT_INHERITED


def _processes() -> dict[int, tuple[int, str, str, str]]:
    """pid -> (parent pid, state, start time, command line) of every process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        out[int(entry.name)] = (int(fields[1]), fields[0], fields[19], cmdline)
    return out


def _descendants(root: int) -> dict[int, tuple[str, str]]:
    """(start time, command line) of every live process below ``root``."""
    procs = _processes()
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, state, start, cmdline) in procs.items():
            if ppid == parent and pid not in found and state not in "ZX":
                found[pid] = (start, cmdline)
                frontier.append(pid)
    return found


def _marked(mark: str) -> dict[int, tuple[str, str]]:
    """Live processes whose environment carries ``mark`` (our farm's, whoever their parent now is)."""
    needle = f"DEPLOY_TEST_MARK={mark}".encode()
    found = {}
    for pid, (_, state, start, cmdline) in _processes().items():
        if state in "ZX":
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in environ:
            found[pid] = (start, cmdline)
    return found


def _still_alive(known: dict[int, tuple[str, str]]) -> dict[int, str]:
    procs = _processes()
    return {
        pid: cmdline for pid, (start, cmdline) in known.items()
        if pid in procs and procs[pid][2] == start and procs[pid][1] not in "ZX"
    }


def _started_by_honcho(honcho: int) -> list[str]:
    """The command line of what each Procfile line became.

    honcho runs each line from a copy of itself, through ``sh -c``: the line's
    process is the shell's child, or the shell itself where it execs its
    last command."""
    procs = _processes()

    def children(pid: int) -> list[int]:
        return [c for c, (parent, state, _, _) in procs.items() if parent == pid and state not in "ZX"]

    became, frontier = [], children(honcho)
    while frontier:
        pid = frontier.pop()
        cmdline = procs[pid][3]
        if cmdline == procs[honcho][3]:  # honcho's copy of itself for one line
            frontier.extend(children(pid))
        elif cmdline.startswith("/bin/sh -c") and len(children(pid)) == 1:
            became.append(procs[children(pid)[0]][3])
        else:
            became.append(cmdline)
    return became


def _tail(path: Path, lines: int = 80) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _wait_ready(proc, url: str, redis_url: str, flower_url: str, log: Path, timeout: float = 300) -> None:
    import httpx
    import redis

    from ndif_celery.state import registry

    pending = {"web": f"{url}/ping", "flower": f"{flower_url}/healthcheck", "worker": registry.WORKERS}
    deadline = time.monotonic() + timeout
    with contextlib.closing(redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)) as client, \
            httpx.Client(timeout=2, trust_env=False) as http:
        while pending:
            if proc.poll() is not None:
                raise AssertionError(f"honcho exited with {proc.returncode} while starting:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"not ready within {timeout}s, waiting for {sorted(pending)}:\n{_tail(log)}")
            for name, what in list(pending.items()):
                try:
                    ok = client.hlen(what) > 0 if name == "worker" else http.get(what).status_code == 200
                except (httpx.HTTPError, redis.RedisError, OSError):
                    ok = False
                if ok:
                    del pending[name]
            time.sleep(0.25)


@contextlib.contextmanager
def _client_at(url: str):
    import nnsight

    api = nnsight.CONFIG.API
    saved = api.HOST, api.APIKEY, api.COMPRESS
    api.HOST = url
    try:
        yield
    finally:
        api.HOST, api.APIKEY, api.COMPRESS = saved


def test_honcho_runs_the_procfile_as_a_working_farm_and_stops_all_of_it(tmp_path, hf_home, model):
    from tests.support.cases.conformance import assert_same, case_read_logits, case_zero_output
    from tests.support.clients.remote import PollUntilDone

    honcho = VENV_BIN / "honcho"
    assert honcho.is_file(), f"{honcho} is missing: pip install -e '.[test]' (honcho is a test extra)"
    api, redis_port, flower_port = free_ports(3)
    farm_env = tmp_path / "farm.env"  # what an operator puts in .env
    farm_env.write_text(
        f"NDIF_HOME={tmp_path / 'home'}\nNDIF_API_PORT={api}\n"
        f"NDIF_EMBEDDED_REDIS_PORT={redis_port}\nNDIF_FLOWER_PORT={flower_port}\n"
    )
    mark = uuid.uuid4().hex
    env = {
        k: v for k, v in os.environ.items()
        if k not in _NOT_INHERITED and not k.startswith("NDIF_") and "proxy" not in k.lower()
    }
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        NO_PROXY="127.0.0.1,localhost", PYTHONUNBUFFERED="1", DEPLOY_TEST_MARK=mark,
    )
    log = tmp_path / "honcho.log"
    url = f"http://127.0.0.1:{api}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(honcho), "-f", str(PROCFILE), "-d", str(ROOT), "-e", str(farm_env), "--no-colour", "start"],
            cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    seen: dict[int, tuple[str, str]] = {}
    try:
        _wait_ready(proc, url, f"redis://127.0.0.1:{redis_port}/0", f"http://127.0.0.1:{flower_port}", log)
        seen.update(_descendants(proc.pid))
        running = " ".join(cmdline for _, cmdline in seen.values())
        for program in ("redis-server", "gunicorn", "celery"):
            assert program in running, f"no {program} under honcho: {running}"
        # Each `ndif-celery <service>` execs its program: what honcho's shell started
        # is the service itself, not a Python process in front of it.
        became = _started_by_honcho(proc.pid)
        assert len(became) == len(procfile()), became
        assert not [line for line in became if "ndif-celery" in line or "ndif_celery.cli" in line], became
        for program in ("redis-server", "gunicorn", " worker", " beat", " flower"):
            assert [line for line in became if program in line], f"no line became {program}: {became}"
        started = log.read_text(errors="replace")
        for name in procfile():
            assert f"{name}.1 started" in started and f"{name}.1 stopped" not in started, f"{name}:\n{_tail(log)}"

        with _client_at(url):
            local = case_zero_output(model, lambda m: {}, tmp_path)
            assert_same(case_zero_output(model, lambda m: {"remote": True}, tmp_path), local, "blocking")
            local = case_read_logits(model, lambda m: {}, tmp_path)
            assert_same(case_read_logits(model, lambda m: {"backend": PollUntilDone(m)}, tmp_path), local, "non-blocking")

        seen.update(_descendants(proc.pid))
        seen.update(_marked(mark))
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"honcho did not exit within 60 s of SIGTERM:\n{_tail(log)}") from None
        assert "SIGTERM received" in log.read_text(errors="replace")

        deadline = time.monotonic() + 15
        while True:
            left = {**_still_alive(seen), **{pid: c for pid, (_, c) in _marked(mark).items()}}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not left, f"left running after honcho stopped: {left}\n{_tail(log)}"
        for port in (api, redis_port, flower_port):
            assert not port_open(port), f"something still listens on {port}"
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        # honcho gives every service its own process group: kill what is left of ours.
        leftovers = {**_still_alive(seen), **{pid: c for pid, (_, c) in _marked(mark).items()}}
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                pgid = os.getpgid(pid)
                if pgid != os.getpgrp():
                    os.killpg(pgid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
