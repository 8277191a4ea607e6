"""Run several trusted requests for one resident model, sharing forwards where safe.

The order of one batch (:func:`run_batch`):

1. **Prepare.** Each request is deserialized (its block recompiled under a
   filename of its own: several requests from one client file and line are
   alive at once, and nnsight caches parsed ``with`` blocks by filename and
   line), screened by its source, and run in its own greenlet up to its forward,
   where it parks (``park.hook``).
2. **Group.** Each parked request is inspected (``screen.inspect``): same call,
   same forward kwargs, same env (and, for a generate or with
   ``NDIF_COBATCH_PAD=0``, the same token length) share a forward, at most
   ``max_batch`` rows at a time.
3. **Forward.** One ``Envoy.interleave`` on the resident model per group, with a
   co-batcher (``batcher.make``) holding every request's rows and every
   request's workers re-offset into them, nnsight's ``defer_exceptions`` on,
   and the guards around it: the weights' stamps read before and after (a
   write poisons the batch: everyone runs alone on the restored model), every
   value served as a copy of the worker's own part (written back when changed;
   a changed copy of a value shared by every row, or a swap of one, sends its
   writer alone), a reader of a value whose rows are every user's (not split
   by user) run alone.
4. **Finish.** Each request's greenlet is resumed: nnsight's own last step
   pushes its values into its frame; a session parks again for its next trace
   (step 2 again). Its saves are collected from its own saved-id set and
   compacted (no view of the batch's storage leaves in a result).
5. **Alone.** Every request that could not share, or whose shared run tripped a
   guard or raised, is run again from its payload by ``request.run_alone``, the
   trusted path of a request alone. An error is therefore always the one the request
   gives alone, never an artifact of co-batching. The stamps are read after
   each of these runs while another request is still to run.

Why stamps, not the whole fingerprint (``integrity.Stamps``): the whole read
of every weight cost 40-100 ms on the bench's gpt2-medium shape, twice per
batch, on the forward's path. The stamps (version counters, storages, sampled
words; ~1 ms) show every in-place write through a weight or a view of it and
every write through ``.data`` that changes a sampled word; any stamp change
poisons the batch, even a write undone before the forward ended (which the
whole fingerprint before and after did not see). A ``.data`` write to words
no sample covers is what only the whole check sees: the worker reads it after
every ``NDIF_TRUSTED_CHECK_EVERY`` jobs, each job of a batch counted
(``ResidentModels.check_after_trusted``), the same bound as for jobs run one
at a time.

Everything runs on the calling thread: greenlets cannot switch across threads.
"""

from __future__ import annotations

import itertools
import linecache
import logging
import sys
import types
from typing import Any, Callable, Optional

import torch
from greenlet import GreenletExit, greenlet
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.interleaver import EarlyStopException
from nnsight.tracing import globals as nnsight_globals
from nnsight.tracing.tracer import dec, inc

from workers import execute
from workers.models import integrity

from . import batcher
from . import park as parking
from . import screen
from .request import Outcome, Request, run_alone

log = logging.getLogger("ndif_celery.worker")

_FILE_IDS = itertools.count()


class _InFlight:
    """One request while its batch runs: its tracer, greenlet, park and own state."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.tracer: Any = None
        self.filename = ""
        self.envoys: list = []
        self.greenlet: Optional[greenlet] = None
        self.park: Optional[parking.Park] = None
        self.saves: set = set()  # its saved ids (park.per_request_saves)
        self.depth = 1  # its trace depth (as execute.run's inc())
        self.buffer = parking.BufferedLog()
        self.solo = ""  # why it runs alone; '' while it may share
        self.finished = False
        self.rounds = 0
        self.cobatch = 0  # the most requests a forward it shared held

    @property
    def log_stream(self) -> Any:
        return self.buffer.stream

    @property
    def active(self) -> bool:
        return not self.solo and not self.finished


def run_batch(model: Any, requests: list[Request], max_batch: int = 16, pad: bool = True,
              restore: Optional[Callable[[], Any]] = None) -> list[Outcome]:
    """Run ``requests`` (trusted, one model) on ``model``; one :class:`Outcome` each, in order.

    ``max_batch``: most rows (prompts) one shared forward holds (1: every request
    alone). ``pad``: merge requests of different token lengths (left-padded).
    ``restore()``: called when the weights' stamps show a write; returns the
    model to go on with (the worker's ``ResidentModels.check_written``: the
    whole check, a reload where a weight changed). Without it, a write raises
    ``RuntimeError`` (a server fault: the model is not what was loaded).
    """
    if any(not r.trusted for r in requests):
        raise ValueError("untrusted requests are never co-batched: run them in their jailed child")
    if max_batch <= 1 or len(requests) <= 1:
        why = screen.COBATCH_OFF if max_batch <= 1 else screen.ALONE_IN_BATCH
        return [run_alone(model, r, why) for r in requests]
    run = _Batch(model, pad, max_batch, restore)
    return run.run([_InFlight(r) for r in requests])


class _Batch:
    def __init__(self, model: Any, window: bool, max_rows: int, restore: Optional[Callable[[], Any]]) -> None:
        self.model = model
        self.window = window
        self.max_rows = max_rows
        self.restore = restore
        self.stamps = integrity.Stamps(model._module)
        self.router = parking.LogRouter(sys.stdout)
        self.dims = batcher.model_dims(model)
        self.weights = batcher.model_storages(model)
        self.limit = batcher.max_positions(model)
        self.poisoned = ""  # set when weights were written: everything left runs alone

    def run(self, states: list[_InFlight]) -> list[Outcome]:
        with execute.request_scope(self.model), parking.per_request_saves(), self.router.installed():
            inc()  # the workers run in this greenlet during a shared forward: inside a trace
            try:
                for state in states:
                    self._prepare(state)
                while True:
                    parked = [s for s in states if s.active and s.park is not None]
                    if not parked or self.poisoned:
                        break
                    for group, (fill, width) in self._groups(parked):
                        if self.poisoned:  # the model was restored: the rest run alone
                            break
                        self._share(group, fill, width)
                outcomes = [self._collect(s) if s.finished and not s.solo else None for s in states]
            finally:
                self._unwind(states)
                dec()
        for state, outcome in zip(states, outcomes):
            if outcome is not None:
                state.buffer.release(state.request.log)
        # Whatever could not share, alone, from its payload.
        pending = [i for i, o in enumerate(outcomes) if o is None]
        for n, i in enumerate(pending):
            state = states[i]
            outcomes[i] = run_alone(self.model, state.request, state.solo or self.poisoned or "it did not finish")
            if n + 1 < len(pending):
                self._check_weights()
        return outcomes

    # -- 1. prepare --------------------------------------------------------------------

    def _prepare(self, state: _InFlight) -> None:
        request = state.request
        try:
            state.tracer = execute.deserialize(self.model, request.blob, request.compress, request.env)
        except execute.RequestError:
            state.solo = "its payload could not be read"
            return
        state.filename = _own_filename(state.tracer)
        frame = state.tracer.info.frame
        roots = {id(e.root): e.root for e in [getattr(state.tracer, "envoy", None),
                                               *frame.f_locals.values(), *frame.f_globals.values()]
                 if isinstance(e, Envoy)}
        state.envoys = list(roots.values())
        edits = [m for envoy in state.envoys for m in envoy._edits]
        why = screen.source_reason(screen.block_sources(state.filename, edits))
        if why:
            state.solo = why
            return

        def on_park(park: parking.Park) -> None:
            state.greenlet.parent.switch(park)

        for envoy in state.envoys:
            parking.hook(envoy, on_park)
        tracer = state.tracer
        state.greenlet = greenlet(run=lambda: tracer.execute(tracer.info.code))
        state.greenlet._cobatch_owner = state
        self._advance(state)
        if state.finished and not state.solo and state.rounds == 0:
            state.solo = "it ran no forward"

    def _advance(self, state: _InFlight) -> None:
        """Into the request until it parks at its next forward, finishes or fails."""
        try:
            parked = parking.advance(state)
        except Exception:  # noqa: BLE001 - confirmed alone, so the user reads the solo error
            log.debug("job %s failed in a shared forward", state.request.job_id, exc_info=True)
            state.park = None
            state.solo = "it failed in a shared forward; its error is confirmed by running it alone"
            return
        if isinstance(parked, parking.Park):
            state.park = parked
            state.rounds += 1
        else:
            state.park = None
            state.finished = True

    # -- 2. group ------------------------------------------------------------------------

    def _groups(self, parked: list[_InFlight]) -> list[tuple[list[_InFlight], tuple[int, int]]]:
        keyed: dict = {}
        for state in parked:
            key, why = screen.inspect(self.model, state.park, state.request.env)
            if key is None:
                state.solo = why
                continue
            if screen.length_bound(self.model, state.park.fn_name, self.window):
                key += (state.park.length,)
            keyed.setdefault(key, []).append(state)
        groups = []
        for members in keyed.values():
            for chunk in self._chunks(members):
                for bucket, sizes in self._safe_widths(chunk):
                    if len(bucket) == 1 and bucket[0].rounds == 1:
                        bucket[0].solo = screen.ALONE_IN_BATCH
                    else:
                        groups.append((bucket, sizes))
        return groups

    def _chunks(self, members: list[_InFlight]):
        chunk: list = []
        for state in members:
            if chunk and _rows(chunk) + state.park.rows > self.max_rows:
                yield chunk
                chunk = []
            chunk.append(state)
        if chunk:
            yield chunk

    def _safe_widths(self, chunk: list[_InFlight]) -> list[tuple[list[_InFlight], tuple[int, int]]]:
        """The chunk with its filler rows and width (``layout``); or, where no
        width fits the model's positions, its lengths apart (a length whose
        sizes are ambiguous even so runs alone)."""
        bound = screen.length_bound(self.model, chunk[0].park.fn_name, self.window)
        found = batcher.layout({s.park.length for s in chunk}, _rows(chunk), self.dims, self.limit, not bound)
        if found is not None:
            return [(chunk, found)]
        buckets: dict = {}
        for state in chunk:
            buckets.setdefault(state.park.length, []).append(state)
        out = []
        for bucket in buckets.values():
            found = batcher.layout({bucket[0].park.length}, _rows(bucket), self.dims, self.limit, not bound)
            if found is None:
                for state in bucket:
                    state.solo = screen.NO_LAYOUT
            else:
                out.append((bucket, found))
        return out

    # -- 3. one shared forward, 4. finish --------------------------------------------------

    def _share(self, group: list[_InFlight], fill: int, width: int) -> None:
        model = self.model
        batch = batcher.make(model, self.window)
        batch.weights = self.weights
        workers: list = []
        for state in group:
            park = state.park
            start, rows = batch.add_request(park.encoding, park.length, len(park.batcher.invokes))
            park.start = start
            for mediator in park.workers:
                if mediator.batch_group is not None:
                    mediator.batch_group = [start + mediator.batch_group[0], mediator.batch_group[1]]
                else:  # a whole-batch worker: the whole of *its request's* rows (hazard 1)
                    mediator.batch_group = [start, rows]
                mediator._cobatch_owner = state
                mediator.start = types.MethodType(parking.safe_start, mediator)
            workers += park.workers
        for _ in range(fill):
            batch.add_filler({key: value[:1] for key, value in group[0].park.encoding.items()})
        batch.target_width = width

        first = group[0].park
        fn = first.fn if isinstance(first.fn, str) else first.fn.__func__.__get__(model, type(model))
        interleaver = model.interleaver
        # Edits first, as Envoy.interleave orders them: a stored edit's swap lands
        # before a trace's read of the same place.
        interleaver.mediators = [m for s in group for m in s.park.edits] + \
                                [m for s in group for m in s.park.mediators]
        interleaver.defer_exceptions = True
        interleaver.check_dangling_mediators = lambda: parking.check_dangling_deferred(
            interleaver, self.router.warn_for)
        model._remoteable_set_env(group[0].request.env)
        failure = ""
        result = None
        try:
            result = model.interleave(fn, batcher=batch, **first.forward)
        except Exception as error:  # noqa: BLE001 - not one request's: all of them alone
            log.debug("a shared forward failed", exc_info=True)
            failure = f"the shared forward failed ({type(error).__name__})"
        finally:
            interleaver.defer_exceptions = False
            interleaver.__dict__.pop("check_dangling_mediators", None)
            interleaver.cancel()
            # Done with the workers: what ties each to its request goes now, or the
            # request <-> worker cycles keep this forward's autograd graph alive
            # until the next cyclic collection (hazard 8).
            for mediator in workers:
                mediator.__dict__.pop("start", None)
                mediator.__dict__.pop("_cobatch_owner", None)
        batch.write_back()  # the copies changed after their visit: a shared one sends its writer alone
        if self.stamps.changed(model._module):
            self._restore()
            self.poisoned = failure = "a weight was written during a shared forward"
        early = set() if failure else _ended_early(model, first, [s.park for s in group], result)
        for state in group:
            park = state.park
            state.cobatch = max(state.cobatch, len(group))
            if failure:
                state.solo = failure
            elif id(park) in early:
                state.solo = "its generation met an end-of-sequence token before the batch's last step"
            elif batch.refused_in(park.start, park.rows):
                state.solo = "it replaced or wrote a value shared by the whole batch"
            elif batch.unlaid_in(park.start, park.rows):
                state.solo = "it read a value holding every user's rows in a layout not split by user"
            elif len(park.workers) > 1 and any(isinstance(m.exception, EarlyStopException) for m in park.workers):
                state.solo = "it stopped (tracer.stop()) one of several invokes"
        for state in group:
            if not state.solo:
                self._advance(state)

    # -- 5. results --------------------------------------------------------------------------

    def _collect(self, state: _InFlight) -> Outcome:
        saved = state.saves
        values = {name: value for name, value in state.tracer.info.frame.f_locals.items() if id(value) in saved}
        return Outcome(state.request.job_id, saved=batcher.compact(values), meta={"cobatch": state.cobatch})

    def _check_weights(self) -> None:
        if self.stamps.changed(self.model._module):
            self._restore()

    def _restore(self) -> None:
        if self.restore is None:
            raise RuntimeError("a request wrote the model's weights and run_batch was given no restore()")
        self.model = self.restore()
        self.stamps = integrity.Stamps(self.model._module)
        self.weights = batcher.model_storages(self.model)

    def _unwind(self, states: list[_InFlight]) -> None:
        """Every greenlet ended, every hook and per-request filename gone, and
        the request <-> greenlet cycles broken."""
        for state in states:
            g = state.greenlet
            if g is not None and not g.dead:
                try:
                    g.throw(GreenletExit)
                except BaseException:  # noqa: BLE001 - it is being discarded
                    pass
            if g is not None:
                g.__dict__.pop("_cobatch_owner", None)
            for envoy in state.envoys:
                parking.unhook(envoy)
            if state.filename:
                _forget(state.filename)
            state.greenlet = state.park = None
        self.model.interleaver.cancel()


def _rows(states: list) -> int:
    return sum(state.park.rows for state in states)


def _own_filename(tracer: Any) -> str:
    """Recompile the request's block under a filename of its own (see the module doc)."""
    frame = tracer.info.frame
    old = frame.f_code.co_filename
    lines = linecache.getlines(old)
    new = f"{old}#cobatch{next(_FILE_IDS)}"
    linecache.cache[new] = (sum(len(x) for x in lines), None, lines, new)
    tracer.info.code = compile("".join(lines), new, "exec").replace(co_name=frame.f_code.co_name)
    frame.f_code.co_filename = new
    return new


def _forget(filename: str) -> None:
    linecache.cache.pop(filename, None)
    nnsight_globals.SOURCES.pop(filename, None)
    for key in [k for k in nnsight_globals.BLOCKS if k[0] == filename]:
        del nnsight_globals.BLOCKS[key]


def _ended_early(model: Any, first: parking.Park, parks: list, result: Any) -> set:
    """Parks whose rows of a shared generate met an end-of-sequence token before
    the last step. Alone, such a request stops there: fewer steps reach its
    ``tracer.iter`` and its output is shorter. Shared, the batch goes on."""
    if first.fn_name != "generate" or not isinstance(result, torch.Tensor):
        return set()
    config = getattr(model._module, "generation_config", None)
    eos = first.forward.get("eos_token_id", getattr(config, "eos_token_id", None))
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if not eos or result.shape[1] <= first.length + 1:
        return set()
    steps = result[:, first.length:-1]  # every new token but the last
    hit = torch.isin(steps, torch.tensor(eos, device=steps.device)).any(dim=1)
    return {id(p) for p in parks if bool(hit[p.start:p.start + p.rows].any())}
