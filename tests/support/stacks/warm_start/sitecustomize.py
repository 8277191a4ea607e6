"""The shim of a warm-started Celery worker or beat (tests only; see tests/support/stacks/launcher.py).

Python imports this at the start of every process of a stack started with
``warm=True``. In anything but ``python -m celery ... worker`` or ``...
beat`` it does nothing. In those it asks the test launcher to fork the
service, then stays as the process ``up`` knows: it passes signals on and
ends as the service ended. If the launcher cannot take it, it starts cold.
"""

import os
import sys


def _shim() -> None:
    import json
    import socket

    path = os.environ.get("NDIF_TEST_LAUNCHER")
    argv = list(getattr(sys, "orig_argv", ()))
    if not path or argv[1:3] != ["-m", "celery"] or not {"worker", "beat"} & set(argv):
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        request = {"args": argv[3:], "env": dict(os.environ), "cwd": os.getcwd()}
        fds = [0, 1, 2]
        sock.sendmsg([json.dumps(request).encode() + b"\n"],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, b"".join(fd.to_bytes(4, sys.byteorder) for fd in fds))])
        reader = sock.makefile("rb")
        reply = json.loads(reader.readline() or b"{}")
    except OSError:
        sock.close()
        return
    if "pid" not in reply:  # {"cold": true}: this worker's settings differ from the launcher's
        sock.close()
        return
    pid = reply["pid"]
    try:
        _stand_in(pid, reader)
    finally:
        os._exit(1)  # never on to a cold start: the worker ran, warm


def _stand_in(pid, reader) -> None:
    """Pass signals on to worker ``pid`` until it ends; then end the same way."""
    import json
    import signal

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, forward)
    while True:
        try:
            line = reader.readline()
            break
        except InterruptedError:
            continue
    code = json.loads(line).get("exit", 1) if line else 1
    if code < 0:  # ended by a signal: end by the same one
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 1)


_shim()
