"""Run one nnsight request against a resident model (the server recipe).

Split into prepare (deserialize under this model), run (execute the block,
collect the saves) and the hygiene around both, so the same steps can later
run in an isolated child or over several jobs at once. What differs between
the nnsight versions a worker can run is its adapter's (``workers.adapters``).
"""

from __future__ import annotations

import contextlib
import io
import linecache
import logging
import os
import site
import sysconfig
import traceback
import weakref
from typing import Any, Callable, Optional

import torch

from ndif_celery import output_bounds

from . import baseline
from .adapters import current as adapter

log = logging.getLogger("ndif_celery.worker")


class RequestError(Exception):
    """A failure the user should read as one sentence, not a server traceback.

    ``kind`` is what sort of failure it is for the ledger and metrics
    (``user`` unless said otherwise)."""

    def __init__(self, message: str, kind: str = "user") -> None:
        super().__init__(message)
        self.kind = kind


def result_too_big(size: int, limit: int) -> RequestError:
    return RequestError(
        f"Your job's result is {size} bytes, over this server's limit of {limit} bytes (NDIF_MAX_RESULT_BYTES)."
    )


def result_over_quota(size: int, used: int, quota: int, ttl_s: float) -> RequestError:
    return RequestError(
        f"Your job's result is {size} bytes, and this API key's stored results already hold {used} bytes of its "
        f"quota of {quota} bytes (NDIF_RESULT_QUOTA_BYTES), so it was not kept. Stored results count until they "
        f"expire, {ttl_s:g} s after their job ended (NDIF_JOB_TTL_S); blocking traces within "
        "NDIF_MAX_INLINE_BYTES are sent over the websocket and not stored."
    )


def payload_error(error: BaseException) -> RequestError:
    return RequestError(
        f"Your request payload could not be read ({type(error).__name__}: {error}). "
        "It may be truncated or corrupted in transit, or compressed differently than the "
        "request declared. If it persists, check that the client and server nnsight versions "
        "match (nnsight.compare())."
    )


@contextlib.contextmanager
def request_scope(model: Any):
    """Leave no trace of a request in process-global state, nor on the model.

    nnsight memoizes compiled blocks by (filename, line) and the payload
    registers its source in ``linecache``; none of it is re-validated, so a
    later request from the same trace site would run this one's block. What
    the block changed on the shared model (its configs, tokenizer, modules'
    and envoys' attributes) is put back as loaded (``workers.baseline``).
    Grads left on the shared weights by a backward are dropped as well.
    """
    saved_linecache = dict(linecache.cache)
    caches = adapter().caches(model)
    saved_caches = [dict(cache) for cache in caches]
    kept = baseline.of(model)
    if kept.dirty:  # the last request was interrupted while its changes were being put back
        _log_put_back(kept.restore())
    kept.dirty = True
    try:
        yield
    finally:
        _restore(linecache.cache, saved_linecache)
        for cache, saved in zip(caches, saved_caches):
            _restore(cache, saved)
        adapter().after_run()
        adapter().unwind(model)  # anything a failed or cancelled run left parked
        _log_put_back(baseline.of(model).restore())  # (a PEFT swap retook it: the current one)
        # The live tree, not a kept list: a parameter a block swapped in keeps no grad into the next job.
        model._module.zero_grad(set_to_none=True)


def _log_put_back(changed: list[str]) -> None:
    if changed:
        log.info("a request changed the shared model; put back as loaded: %s", "; ".join(changed[:20]))


# A loaded model's persistent objects (every module by path, for the payload's
# unpickler), read once per model (a reload is a new module): walking the tree
# for each request cost most of a millisecond of a small model's few. A block
# that swaps a tensor or a module holding one in changes the tree: the stamps
# see it, and the model is reloaded or, its values intact, read again
# (``forget_tree``). ``LAYERED``: the model took a PEFT adapter from a request's
# env (which changes the tree), and is walked for every request from then on.
_PERSISTENT: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
LAYERED = object()


def forget_tree(model: Any) -> None:
    """The model's tree changed: read it again at the next request."""
    if _PERSISTENT.get(model._module) is not LAYERED:
        _PERSISTENT.pop(model._module, None)


def persistent_objects(model: Any, env: Optional[dict]) -> dict:
    """The model's persistent objects under ``env`` (applied here), the caller's own copy."""
    if (env or {}).get("peft"):
        _PERSISTENT[model._module] = LAYERED
    layered = model.__dict__.get("peft")
    adapter().set_env(model, env)
    if model.__dict__.get("peft") != layered and baseline.ATTRIBUTE in model.__dict__:
        baseline.take(model)  # the farm swapped the adapter: the tree as it now is is the one to keep
    kept = _PERSISTENT.get(model._module)
    if kept is LAYERED:
        return adapter().persistent_objects(model)
    if kept is None:
        kept = _PERSISTENT[model._module] = adapter().persistent_objects(model)
    return dict(kept)


def _restore(target: dict, snapshot: dict) -> None:
    target.clear()
    target.update(snapshot)


def deserialize(model: Any, blob: bytes, compress: bool, env: dict) -> Any:
    persistent = persistent_objects(model, env)
    try:
        return adapter().deserialize(model, blob, compress, persistent)
    except Exception as error:  # noqa: BLE001 - any unreadable payload is the same user error
        missing = adapter().unknown_module(error)
        if missing is not None:
            raise RequestError(
                "The model architecture on this server doesn't match the one your code was traced "
                f"against ({missing}). Compare versions with `from nnsight import ndif; print(ndif.compare())`."
            ) from None
        raise payload_error(error) from None


def run(prepared: Any, log: Callable[[str], None]) -> dict:
    """Execute the block; return the values it saved, by variable name."""
    stream = LogStream(log)
    with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
        try:
            return adapter().run(prepared)
        finally:
            stream.flush_partial()


def format_user_error(error: BaseException) -> str:
    """The user's own traceback: only frames of code the user wrote and shipped.

    Frames of installed libraries (nnsight, torch, transformers), of the
    standard library and of this server are dropped; if that leaves nothing,
    nnsight's own cleaning is used instead.
    """
    if isinstance(error, RequestError):
        return str(error)
    tb = adapter().clean_traceback(error.__traceback__)
    frames = traceback.extract_tb(tb)
    users = [frame for frame in frames if not frame.filename.startswith(_LIBRARY_DIRS)]
    lines = ["Traceback (most recent call last):\n"]
    lines.extend(traceback.format_list(users or frames))
    lines.extend(traceback.format_exception_only(type(error), error))
    return "".join(lines)


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY_DIRS = tuple(
    {os.path.join(_ROOT, package) + os.sep for package in ("workers", "web", "ndif_celery")}
    | {p for p in sysconfig.get_paths().values()}
    | {p for p in site.getsitepackages()}
    | {os.path.dirname(os.__file__)}
)


class LogStream(io.TextIOBase):
    """A file whose every complete line becomes a LOG status for the client.

    A line is kept only up to ``bounds.LOG_LINE_BYTES`` characters while it
    is being written (the rest is counted, and the line ends with a note that
    says how much was cut): a print of 100 MB, or a million writes without a
    newline, must not pile up in this process's memory."""

    def __init__(self, log: Callable[[str], None], max_line: int = output_bounds.LOG_LINE_BYTES) -> None:
        self._log = log
        self._partial = ""
        self._max = max_line
        self._cut = 0  # bytes of the current line dropped so far

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        lines = text.split("\n")
        for line in lines[:-1]:
            self._add(line)
            self._emit()
        self._add(lines[-1])
        return len(text)

    def _add(self, piece: str) -> None:
        room = self._max - len(self._partial)
        if len(piece) > room:
            self._cut += len(piece[max(0, room):].encode("utf-8", "replace"))
            piece = piece[: max(0, room)]
        if piece:
            self._partial += piece

    def _emit(self) -> None:
        line = output_bounds.truncate(self._partial, self._max, dropped=self._cut) if self._cut else self._partial
        self._partial, self._cut = "", 0
        self._log(line)

    def flush_partial(self) -> None:
        if self._partial or self._cut:
            self._emit()


def no_grad_weights(module: torch.nn.Module) -> None:
    """Resident weights never need grads; activations opt in with requires_grad_."""
    module.requires_grad_(False)
