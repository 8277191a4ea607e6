"""A clean process that forks the isolated children for one resident model.

Untrusted jobs are never forked from the worker but from a *zygote*, one
per resident model. With ``NDIF_ISOLATION=zygote`` (the default) it is a
fresh interpreter the worker execs, with an environment holding no secrets;
with ``NDIF_ISOLATION=fork`` it is forked from the worker's fork server
(``workers.isolation.forkserver``: the worker's pristine state from before any client,
job or CUDA, scrubbed of secrets), which saves the interpreter start and the
imports. From there on both are the same process: it builds the model's
skeleton (``from_model_key`` on meta) and points it at the worker's weights
(``workers.isolation.shared_weights``: a private mapping of the shared CPU file, CUDA
IPC handles for GPU tensors). The zygote never receives a payload, a result,
a key or a URL, so a child forked from it inherits nothing of any earlier
job and holds no secret of the worker. It
is also the GPU path: the zygote never initialises CUDA, so its children can;
each opens the GPU weights' IPC handles before it locks itself in (no PID
namespace there: CUDA IPC does not cross one).

Each child runs the one child entry point (``workers.isolation.child.main``): the
worker creates the two pipes, hands them to the zygote over a Unix socket
(``SCM_RIGHTS``) with the job's policy, and talks to the child directly. The
zygote answers with JSON lines only (``forked``, ``exited``); the worker
never unpickles anything from it.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from typing import Any, Optional

from . import control_channel
from . import jail
from .child import kill_group
from .child import main as child_main
from .parent import IsolationPolicy

READY_TIMEOUT_S = 300.0  # imports and the skeleton; a big model's config is quick, imports are not
_PREPROCESSORS = ("tokenizer", "image_processor", "feature_extractor", "processor")
ENV_KEEP = (*jail.ENV_ALLOWLIST, "HF_HOME", "HF_HUB_CACHE", "PYTHONPATH", "CUDA_VISIBLE_DEVICES",
             "NDIF_TORCH_THREADS")


class ZygoteError(Exception):
    pass


class ZygoteChild:
    """A child the zygote forked, seen from the worker: the ``ForkedChild`` interface."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.status: Optional[int] = None
        self._exited = threading.Event()

    def ended(self, status: int) -> None:
        self.status = status
        self._exited.set()

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """Its wait status, as the zygote reported it; None if it is still
        running after ``timeout`` s (callers always give one: see parent._wait_for)."""
        if not self._exited.wait(timeout):
            return None
        return self.status if self.status is not None else 0

    def kill(self) -> None:
        kill_group(self.pid)


class Zygote:
    """The worker's handle on the zygote of one resident model."""

    def __init__(self, model: Any, shared: Any, model_key: str, dtype: Optional[str], fork_server: Any = None,
                 threads: int = 0) -> None:
        self.model_id = id(model)
        # NDIF_ISOLATION: "zygote" = a fresh interpreter exec'd here; "fork" = a
        # fork of the worker's fork server (workers.isolation.forkserver). Same code after that.
        self.mode = "fork" if fork_server is not None else "zygote"
        self.cuda = bool(shared.cuda)
        self._lock = threading.Lock()
        self._children: dict[int, ZygoteChild] = {}
        self._forked: dict[int, ZygoteChild] = {}  # fork request id -> its child, until fork() takes it
        self._replies = threading.Condition()
        self._next = 0
        self.error: Optional[str] = None
        self.ready = threading.Event()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        env = {k: v for k, v in os.environ.items() if k in ENV_KEEP}
        # torch.cuda.is_available() without this initialises the CUDA driver,
        # after which no forked child can use the GPU.
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        keep = [theirs.fileno()] + ([shared.cpu_fd] if shared.cpu_fd >= 0 else [])
        try:
            if fork_server is not None:
                self.process = fork_server.spawn(theirs.fileno(), shared.cpu_fd)
            else:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "workers.isolation.zygote", str(theirs.fileno()), str(shared.cpu_fd)],
                    env=env, pass_fds=keep, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True,
                    cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        module = model._module
        header = {
            "model_key": model_key,
            "kwargs": {**{name: getattr(model, name) for name in _PREPROCESSORS if getattr(model, name, None) is not None},
                       "config": getattr(module, "config", None), **({"dtype": dtype} if dtype else {})},
            "shared": shared.header(),
            # A skeleton reads the repo's generation settings from no file: a
            # speech model's (suppressed and forced tokens) must be the worker's.
            "generation_config": getattr(module, "generation_config", None),
            "training": [path for path, sub in module.named_modules() if sub.training],
            "modules": [path for path, _ in module.named_modules()],
            "threads": threads,  # as the worker chose for this model (workers.models.threads)
        }
        try:
            self.process.stdin.write(pickle.dumps(header))  # to the zygote: trusted direction
            self.process.stdin.close()
        except BrokenPipeError:
            pass
        self._reader = threading.Thread(target=self._read, name="ndif-zygote", daemon=True)
        self._reader.start()

    # -- the worker's side --

    def fits(self, model: Any) -> bool:
        return self.model_id == id(model) and self.process.poll() is None and self.error is None

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        control_channel.wait_ready(self, timeout, ZygoteError, "the isolation zygote")

    def fork(self, out_fd: int, in_fd: int, policy: Any, workdir: str, cgroup: str) -> ZygoteChild:
        """Have the zygote fork a child that runs ``child.main`` on these pipes.

        The policy goes without its secrets: the zygote never learns them (its
        environment has none), so there is nothing for the child to scrub."""
        self.wait_ready()
        with self._lock:
            self._next += 1
            request = self._next
            message = json.dumps({"fork": request, "policy": {**asdict(policy), "secrets": []}, "workdir": workdir,
                                  "cgroup": cgroup}).encode()
            socket.send_fds(self.sock, [message], [out_fd, in_fd])
        deadline = time.monotonic() + 30
        with self._replies:
            while request not in self._forked:
                if self.error or time.monotonic() > deadline:
                    raise ZygoteError(self.error or "the isolation zygote did not fork a child in 30 s")
                self._replies.wait(0.1)
            return self._forked.pop(request)

    def close(self) -> None:
        """Stop the zygote: EOF on its socket ends it (and it kills its
        children); one still importing is killed, as it holds nothing to keep."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.process.wait(1)
        except subprocess.TimeoutExpired:
            self.process.kill()  # its children die with it (parent-death signal)
            self.process.wait()
        self.sock.close()
        self._fail("the isolation zygote was stopped")

    def _read(self) -> None:
        for message in control_channel.messages(self.sock):
            if control_channel.settled(self, message):
                continue
            if "forked" in message:
                child = ZygoteChild(int(message["pid"]))
                with self._replies:
                    self._children[child.pid] = child
                    self._forked[int(message["forked"])] = child
                    self._replies.notify_all()
            elif "exited" in message:
                with self._replies:
                    child = self._children.pop(int(message["exited"]), None)
                if child is not None:
                    child.ended(int(message["status"]))
        code = self.process.wait()
        self._fail(self.error or f"the isolation zygote exited (status {code})")

    def _fail(self, reason: str) -> None:
        """The zygote is gone: every child it had is gone with it (they die with their parent)."""
        if self.error is None:
            self.error = reason
        self.ready.set()
        with self._replies:
            children = list(self._children.values()) + list(self._forked.values())
            self._children = {}
            self._replies.notify_all()
        for child in children:
            if child.status is None:
                child.ended(9)  # as if SIGKILLed (os.WIFSIGNALED(9) holds)


# --- the zygote process ----------------------------------------------------------


def main(argv: list) -> None:
    """An exec'd zygote (NDIF_ISOLATION=zygote): the header comes on stdin."""
    serve(int(argv[1]), int(argv[2]), sys.stdin.buffer)


def serve(sock_fd: int, cpu_fd: int, header_file: Any) -> None:
    """Build the skeleton, map the weights, fork children until the worker
    lets go. Shared by the exec'd zygote and the fork server's (never returns)."""
    sock = socket.socket(fileno=sock_fd)
    try:
        header = pickle.loads(header_file.read())  # from the worker, which started us
        model = _build(header, cpu_fd)
    except BaseException as error:  # noqa: BLE001 - reported, then gone
        control_channel.reply(sock, {"error": f"the isolation zygote could not build the model: {type(error).__name__}: {error}"})
        os._exit(1)
    if cpu_fd >= 0:
        os.close(cpu_fd)  # the private mapping stays; children get no handle on the shared file
    control_channel.reply(sock, {"ready": True})
    _serve(sock, model, header)


def _build(header: dict, cpu_fd: int) -> Any:
    import torch

    from workers import adapters

    from . import shared_weights

    threads = header.get("threads") or os.environ.get("NDIF_TORCH_THREADS")
    if threads and int(threads) > 0:
        torch.set_num_threads(int(threads))
    model = adapters.current().load(header["model_key"], dispatch=False, **header["kwargs"])
    module = model._module
    paths = [path for path, _ in module.named_modules()]
    if paths != header["modules"]:
        raise ZygoteError("the model's skeleton does not have the resident model's modules")
    shared_weights.attach(module, header["shared"], cpu_fd, "cpu")
    if header.get("generation_config") is not None:
        module.generation_config = header["generation_config"]
    if header["shared"].get("quantized"):  # attach replaced its quantized layers: the envoys follow
        model._update(module)
    training = set(header["training"])
    for path, sub in module.named_modules():
        sub.training = path in training
    model.dispatched = True
    if torch.cuda.is_initialized():
        raise ZygoteError("building the model's skeleton initialised CUDA, so no child could use the GPU")
    return model


def _serve(sock: socket.socket, model: Any, header: dict) -> None:
    cuda = bool(header["shared"]["cuda"])
    children: set = set()
    for request, fds in control_channel.requests(sock, 2, children):
        policy = IsolationPolicy(**{**request["policy"], "secrets": tuple(request["policy"]["secrets"]),
                           "readable": tuple(request["policy"]["readable"])})
        out_fd, in_fd = fds
        pid = os.fork()
        if pid == 0:
            sock.close()
            before = (lambda: _attach_cuda(model, header, policy)) if cuda else None
            child_main(model, policy, out_fd, in_fd, request["workdir"], request["cgroup"], before_jail=before)
        os.close(out_fd)
        os.close(in_fd)
        children.add(pid)
        control_channel.reply(sock, {"forked": request["fork"], "pid": pid})
    for pid in children:  # the worker is gone or let go of us
        kill_group(pid)
    os._exit(0)


def _attach_cuda(model: Any, header: dict, policy: Any) -> None:
    """In a child, before its jail: CUDA up, the GPU weights mapped through
    their IPC handles, and its allocator capped at the job's memory allowance
    (a guard against runaway allocation, not a boundary: see docs/security.md)."""
    import torch

    from . import shared_weights

    torch.cuda.init()
    shared_weights.attach(model._module, header["shared"], devices="cuda")
    for index in range(torch.cuda.device_count()):
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, policy.memory_bytes / total), index)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv)
