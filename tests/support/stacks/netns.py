"""Hosts as Linux network namespaces: a farm spread over machines, on one machine.

Why: every other test runs every process on one host over loopback, where a
hidden single-host assumption (a service bound to 127.0.0.1, an address
advertised that only its own host can reach, a directory taken as shared)
cannot show, and neither can a host whose link dies while its processes live
on (the race in which the broker hands a job to a dead worker connection). Here each host is a network namespace of
its own (``ip netns``), with its own loopback and one interface, ``eth0``, on a
private subnet; the subnet's bridge lives in a namespace of its own too (the
"switch"), so the machine's own network is never touched: no interface, route
or address is added outside the namespaces this module made.

    with Network(tmp_path) as net:
        a, b = net.add("a"), net.add("b")
        server = b.start("http", [sys.executable, "-m", "http.server", "--bind", b.address, "8080"])
        a.call(lambda: httpx.get(f"http://{b.address}:8080/"))   # from a thread inside host a
        b.cut()                                                   # its link goes down

The test process itself stays in the machine's namespace. Code that must
reach a host runs in a thread that entered another host's namespace
(:meth:`Host.call`, ``setns(2)`` applies to the calling thread only, and the
threads it starts inherit it): an address of the subnet is never dialled from
the machine's own namespace, where it would leave through the default route.

Everything is removed after (:meth:`Network.close`, also at exit): every
process in each namespace (``ip netns pids``) is killed, then the namespaces,
which takes their interfaces with them. Names carry a prefix and the test
process's pid, so concurrent runs never meet, and namespaces left by a run
whose process is gone (killed before it could clean up) are removed by the
next one. Needs root and iproute2: :func:`unavailable` says why not, for a skip.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import ctypes
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Optional

PREFIX = "ndift"
SUBNET = "10.199.0"  # /24, exists only inside the namespaces; .1 is unused, hosts from .2
CLONE_NEWNET = 0x40000000
_networks = itertools.count()
_libc = ctypes.CDLL(None, use_errno=True)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` exited {done.returncode}: {done.stderr.strip()}")
    return done


def unavailable() -> str:
    """Why namespaces cannot be made here ('' when they can): for a skip reason."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "network namespaces need iproute2's `ip` and util-linux's `unshare`"
    probe = f"{PREFIX}{os.getpid()}.{next(_networks)}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        bridge = _ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if bridge.returncode != 0:
            return f"cannot make a bridge inside a namespace: {bridge.stderr.strip()}"
        return ""
    finally:
        _ip("netns", "del", probe, check=False)


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def remove_leftovers() -> list[str]:
    """Remove the namespaces of earlier runs whose process is gone; their names."""
    removed = []
    for name in _namespaces():
        match = re.fullmatch(rf"{PREFIX}(\d+)\.\d+-.+", name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            _remove_namespace(name)
            removed.append(name)
    return removed


def _kill_everything_in(namespace: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process in ``namespace`` until none is left."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = [int(pid) for pid in _ip("netns", "pids", namespace, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in namespace {namespace} would not die")
        time.sleep(0.05)


def _remove_namespace(namespace: str) -> None:
    _kill_everything_in(namespace)
    _ip("netns", "del", namespace, check=False)


def _enter(namespace: str) -> None:
    """Move the calling thread (only it) into ``namespace``'s network."""
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)
    wanted = os.stat(f"/var/run/netns/{namespace}").st_ino
    if os.readlink("/proc/thread-self/ns/net") != f"net:[{wanted}]":
        raise RuntimeError(f"this thread is not in namespace {namespace} after setns")


class Host:
    """One host: a network namespace with ``eth0`` at :attr:`address` on the
    subnet, its own loopback, hostname (each process runs in a UTS namespace
    of its own) and folder; the processes started in it; threads inside it."""

    def __init__(self, network: "Network", name: str, number: int) -> None:
        self.network = network
        self.name = name
        self.namespace = f"{network.prefix}-{name}"
        self.address = f"{SUBNET}.{number}"
        self.folder = network.folder / name
        self.folder.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, subprocess.Popen] = {}
        self.call_timeout_s = 300.0

    # -- processes ----------------------------------------------------------------

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` as run on this host: in its namespace, under its hostname."""
        return ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$0" && exec "$@"', self.name, *argv]

    def start(self, service: str, argv: list[str], env: Optional[dict] = None, cwd: Optional[Path] = None
              ) -> subprocess.Popen:
        """Start ``argv`` on this host in the background, output to ``<folder>/<service>.log``."""
        log = (self.folder / f"{service}.log").open("ab")
        proc = subprocess.Popen(self.command(argv), env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.processes[service] = proc
        return proc

    def run(self, argv: list[str], env: Optional[dict] = None, cwd: Optional[Path] = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host to its end; output captured as text."""
        return subprocess.run(self.command(argv), env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def log(self, service: str, lines: int = 40) -> str:
        path = self.folder / f"{service}.log"
        text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else ["(no log)"]
        return f"==> {self.name}: {service} <==\n" + "\n".join(text)

    def pids(self) -> list[int]:
        return [int(pid) for pid in _ip("netns", "pids", self.namespace, check=False).stdout.split()]

    def kill(self) -> None:
        """Every process on this host dies at once (SIGKILL), as in a crash."""
        _kill_everything_in(self.namespace)
        for proc in self.processes.values():
            proc.wait(timeout=10)
        self.processes.clear()

    # -- the link ------------------------------------------------------------------

    def cut(self) -> None:
        """Take this host's link down: its processes live on, and nothing they
        send or are sent arrives, as when a host's cable or switch port dies."""
        _ip("-n", self.namespace, "link", "set", "eth0", "down")

    def restore(self) -> None:
        _ip("-n", self.namespace, "link", "set", "eth0", "up")

    # -- code inside the host ------------------------------------------------------

    def call(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)`` in a thread inside this host's network; its
        result (``TimeoutError`` after :attr:`call_timeout_s`: a test never hangs)."""
        return self.submit(fn, *args, **kwargs).result(timeout=self.call_timeout_s)

    def submit(self, fn: Callable, *args, **kwargs) -> concurrent.futures.Future:
        """The same, without waiting, in a thread of its own: a daemon, so a
        client left waiting on a host that is gone (a socket no packet will
        ever reach again) cannot keep the test process from exiting."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            future.set_running_or_notify_cancel()
            try:
                _enter(self.namespace)
                future.set_result(fn(*args, **kwargs))
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(error)

        threading.Thread(target=run, name=f"host-{self.name}", daemon=True).start()
        return future


class Network:
    """A switch namespace holding the subnet's bridge, and hosts plugged into it."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.prefix = f"{PREFIX}{os.getpid()}.{next(_networks)}"  # two networks of one process never meet
        self.switch = f"{self.prefix}-switch"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []
        remove_leftovers()
        atexit.register(self.close)
        self._make(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def _make(self, namespace: str) -> None:
        _ip("netns", "add", namespace)
        self._made.append(namespace)
        _ip("-n", namespace, "link", "set", "lo", "up")

    def add(self, name: str) -> Host:
        """A host on the subnet at the next address, its link up."""
        if not re.fullmatch(r"[a-z][a-z0-9]{0,11}", name) or name in self.hosts or name == "switch":
            raise ValueError(f"host names are short, lowercase and unique: {name!r}")
        host = Host(self, name, number=len(self.hosts) + 2)
        self._plug(host)
        self.hosts[name] = host
        return host

    def _plug(self, host: Host) -> None:
        self._make(host.namespace)
        port = f"p-{host.name}"  # the switch's end, named in the switch's own namespace
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", host.namespace, "link", "set", "eth0", "up")

    def renew(self, host: Host) -> None:
        """``host`` comes back as a fresh machine at the same address: its
        processes killed and its namespace made anew, so nothing its old
        kernel still held (a socket's unsent bytes, waiting for a link that
        was cut) reaches anyone once it is back, as after a reboot."""
        host.kill()
        _ip("-n", self.switch, "link", "del", f"p-{host.name}")  # both ends, now (a namespace goes lazily)
        _remove_namespace(host.namespace)
        self._made.remove(host.namespace)
        self._plug(host)

    def close(self) -> None:
        """Kill every process in every namespace made, then remove them all."""
        errors = []
        for namespace in reversed(self._made):
            try:
                _remove_namespace(namespace)
            except Exception as exc:  # noqa: BLE001 - remove the others all the same
                errors.append(f"{namespace}: {exc}")
        for host in self.hosts.values():
            for proc in host.processes.values():
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=10)
        self._made.clear()
        atexit.unregister(self.close)
        if errors:
            raise RuntimeError("could not remove every namespace: " + "; ".join(errors))

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
