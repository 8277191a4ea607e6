"""Each request runs in a greenlet of its own, up to its forward, and parks there.

nnsight's ``InterleavingTracer.execute`` prepares a trace (runs the block to
collect its invokes: one ``Mediator`` each, and a ``Batcher`` of their inputs),
then calls ``envoy.interleave(fn, batcher=...)`` for one forward, then pushes each
worker's values back into the trace frame. The engine cuts that at the middle:
the request's own deserialized root envoy gets an *instance attribute*
``interleave`` (:func:`hook`) that hands what was prepared to the engine and
parks the request's greenlet. The engine runs one forward for many parked
requests, then switches back into each, and nnsight's own last step runs as if
its forward had just returned. A session parks once per inner trace.

Process-global nnsight state that is per *thread* (so shared by greenlets of
one thread) is made per request here:

* the saved-id set (``nnsight.tracing.tracer._saves``) is routed to the request
  the current greenlet works for (:func:`owner`): one set for everyone would
  hand a user names whose ids another user saved (hazard 5);
* the trace depth (``tracer._local.depth``) is saved and restored around each
  switch into a request (:func:`advance`);
* stdout / stderr are routed to the owning request's log buffer
  (:class:`LogRouter`).

And the two places nnsight would abort the whole forward for one worker are
made per worker (hazard 7): :func:`safe_start` (a worker that raises or stops
before its first read) and :func:`check_dangling_deferred` (a worker still
parked after the forward: an out-of-order read).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from greenlet import getcurrent
from nnsight.intervention.interleaver import EarlyStopException, dangling_unwind
from nnsight.tracing import tracer as nnsight_tracer

from workers.execute import LogStream


@dataclass
class Park:
    """A request stopped at ``envoy.interleave(...)``, with what it prepared."""

    fn: Any
    batcher: Any
    kwargs: dict
    mediators: list
    edits: list
    # filled in by the screen / the engine
    fn_name: str = ""
    encoding: dict = field(default_factory=dict)
    forward: dict = field(default_factory=dict)
    length: int = 0
    rows: int = 0
    start: int = 0

    @property
    def workers(self) -> list:
        return self.edits + self.mediators


def hook(envoy: Any, on_park: Callable[["Park"], None]) -> None:
    """Make ``envoy.interleave`` (the request's own deserialized root envoy) park
    instead of running: ``on_park(park)`` switches to the engine, which resumes
    this greenlet once the shared forward is done."""

    def interleave(fn: Any, *args: Any, batcher: Any = None, **kwargs: Any) -> Any:
        if args or batcher is None:
            raise NotImplementedError("co-batching handles traced calls only")
        interleaver = envoy.interleaver
        park = Park(fn=fn, batcher=batcher, kwargs=kwargs,
                    mediators=list(interleaver.mediators), edits=list(envoy._edits))
        # The interleaver is the resident model's, shared by every request:
        # leave it empty for the next request's preparation.
        interleaver.mediators = []
        interleaver.batcher = None
        on_park(park)
        # Resumed after the shared forward: a worker's error is this request's,
        # raised where a solo run would have raised it.
        for mediator in park.workers:
            error = mediator.exception
            if error is not None and not isinstance(error, EarlyStopException):
                raise error
        return None

    envoy.__dict__["interleave"] = interleave


def unhook(envoy: Any) -> None:
    envoy.__dict__.pop("interleave", None)


def owner(g: Any) -> Optional[Any]:
    """The request a greenlet works for: a request's own greenlet, a worker of one
    of its mediators, or a greenlet a worker switched into (a backward's)."""
    hops = 0
    while g is not None and hops < 16:
        found = getattr(g, "_cobatch_owner", None)
        if found is not None:
            return found
        ref = getattr(g, "mediator", None)
        mediator = ref() if ref is not None else None
        found = getattr(mediator, "_cobatch_owner", None)
        if found is not None:
            return found
        g = g.parent
        hops += 1
    return None


_ORIGINAL_SAVES = nnsight_tracer._saves


def _routed_saves() -> set:
    found = owner(getcurrent())
    return found.saves if found is not None else _ORIGINAL_SAVES()


@contextlib.contextmanager
def per_request_saves():
    """Route nnsight's saved-id set to the current request while the batch runs."""
    nnsight_tracer._saves = _routed_saves
    try:
        yield
    finally:
        nnsight_tracer._saves = _ORIGINAL_SAVES


def advance(state: Any) -> Any:
    """Switch into a request's greenlet (``state.greenlet``) with its own trace
    depth; return what it parked with (a :class:`Park`), or None when it finished.
    An exception it raised propagates."""
    local = nnsight_tracer._local
    outer = getattr(local, "depth", 0)
    local.depth = state.depth
    try:
        return state.greenlet.switch()
    finally:
        state.depth = getattr(local, "depth", 0)
        local.depth = outer


def safe_start(mediator: Any, interleaver: Any = None) -> None:
    """``Mediator.start``, except that a worker that raises (or ``stop()``\\ s)
    before its first read records it on itself rather than aborting every
    user's forward. Installed as an instance attribute for one forward."""
    try:
        type(mediator).start(mediator, interleaver)
    except Exception as exception:  # EarlyStopException included
        mediator.exception = exception
        mediator.pending = None


def check_dangling_deferred(interleaver: Any, warn: Callable[[Any, str], None]) -> None:
    """``Interleaver.check_dangling_mediators``, recording per worker instead of
    raising at the whole batch; the expected case (a ``tracer.iter`` loop that
    outran the run) warns to that worker's request (``warn(owner, text)``)."""
    for mediator in interleaver.mediators:
        if not mediator.alive:
            continue
        error, expected = dangling_unwind(mediator)
        try:
            mediator.worker.throw(error)
        except BaseException as thrown:  # noqa: BLE001 - recorded for its own request
            if expected is None or thrown is not error:
                mediator.exception = thrown
            else:
                warn(getattr(mediator, "_cobatch_owner", None), expected)


class LogRouter(io.TextIOBase):
    """stdout / stderr while a batch runs: each write goes to the log buffer of
    the request whose code is running (found by greenlet), else to ``fallback``.

    Buffered per request, not sent: a request whose shared run does not stand is
    run again alone, and the user must see that run's lines, once.
    """

    def __init__(self, fallback: Any) -> None:
        self.fallback = fallback
        self.speaking_for: Any = None

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        found = self.speaking_for or owner(getcurrent())
        if found is None:
            return self.fallback.write(text)
        return found.log_stream.write(text)

    def flush(self) -> None:
        pass

    @contextlib.contextmanager
    def installed(self):
        with contextlib.redirect_stdout(self), contextlib.redirect_stderr(self):
            yield self

    def warn_for(self, request: Any, text: str) -> None:
        """``warnings.warn(text)`` as the request's own code would have (into its log)."""
        self.speaking_for = request
        try:
            warnings.warn(text, stacklevel=2)
        finally:
            self.speaking_for = None


class BufferedLog:
    """A request's log lines, held until its result stands (then ``release``d to
    its ``log`` callable) or dropped (it is run again alone)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.stream = LogStream(self.lines.append)

    def release(self, log: Callable[[str], None]) -> None:
        self.stream.flush_partial()
        for line in self.lines:
            log(line)
        self.lines = []
