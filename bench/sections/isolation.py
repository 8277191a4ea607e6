"""The isolation table: the same small trace in the worker's process and in a
jailed child (through a fork-server zygote and an exec'd zygote), each on a
stack of its own, against the local run and the null server.

A section of its own because it starts and stops its own two stacks and
spaces its requests (``ISOLATION_GAP_S``), unlike the timed workloads.
``bench.workloads`` (torch) is imported inside: see ``bench/run.py``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Optional

from bench import measure
from bench.columns import Column

ISOLATION_GAP_S = 0.25  # between the isolation table's requests (see IsolationSection.isolation)


class IsolationSection:
    """Mixin of ``bench.core.Bench``: ``isolation()``."""

    def isolation(self) -> None:
        """The same trace in-process, in a child of a zygote forked from the
        worker's fork server (NDIF_ISOLATION=fork) and in one of an exec'd
        zygote (NDIF_ISOLATION=zygote, the default), each its own stack, interleaved."""
        from bench.workloads import small_trace

        reps = self.plan.isolation_reps
        self.iso_stack = self.new_stack(NDIF_DEFAULT_TRUSTED="0", NDIF_ISOLATION="fork")
        self.zygote_stack = self.new_stack(NDIF_DEFAULT_TRUSTED="0", NDIF_ISOLATION="zygote")
        jailed = (self.iso_stack, self.zygote_stack)
        self.at_once(lambda stack: stack.start(), jailed)
        # Each one's first request would deploy the model (seconds in a jailed worker): both at once first.
        key = self.model.to_model_key()
        self.at_once(lambda stack: stack.cli("deploy", key, "--timeout", "300", timeout=360, check=True), jailed)
        ref = self.refs.get("small_trace") or self.reference("isolation", small_trace, self.model)
        self.null.prepare(ref, self.compress, self.max_inline)
        hosts = {"local": None, "null": self.null.url, "ours": self.stack.url, "ours_isolated": self.iso_stack.url,
                 "ours_zygote": self.zygote_stack.url}
        columns = {col: Column() for col in hosts}
        for host in hosts.values():
            for _ in range(max(self.plan.warmup, 2)):
                with contextlib.suppress(Exception):
                    self.call(small_trace, self.model, host)
        order = list(hosts)
        for rep in range(reps):
            shift = rep % len(order)
            for col in order[shift:] + order[:shift]:
                # Spaced: each stack's spare child is prepared (forked, jailed,
                # warmed) in the background after a job; without a pause the
                # next column would be timed against the previous stack's
                # preparation on these few cores, not against its own path.
                time.sleep(ISOLATION_GAP_S)
                self.measure_into(columns[col], small_trace, self.model, hosts[col], ref)
        # And back to back on each stack: the next request may have to wait for its spare.
        burst = {col: Column() for col in ("ours", "ours_isolated", "ours_zygote")}
        for col, column in burst.items():
            for _ in range(max(reps // 2, 2)):
                self.measure_into(column, small_trace, self.model, hosts[col], ref)
        burst_p50 = {col: column.summary().get("p50_ms") for col, column in burst.items()}
        for stack in (self.iso_stack, self.zygote_stack):
            stack.discard()
        self.iso_stack = self.zygote_stack = None
        summary = {col: c.summary() for col, c in columns.items()}

        def added(col: str) -> Optional[float]:
            if summary["ours"].get("p50_ms") and summary[col].get("p50_ms"):
                return round(summary[col]["p50_ms"] - summary["ours"]["p50_ms"], 3)
            return None

        def server_p50(col: str) -> Optional[float]:
            values = columns[col].server.get("isolated_ms", [])
            return round(measure.percentile(values, .5), 3) if values else None

        fork_added, zygote_added = added("ours_isolated"), added("ours_zygote")
        burst_notes = []
        if all(burst_p50.values()):
            burst_notes = [f"back to back ({max(reps // 2, 2)} each, no pause): client p50 in-process "
                           f"{burst_p50['ours']:.1f} ms, fork {burst_p50['ours_isolated']:.1f} ms "
                           f"({burst_p50['ours_isolated'] - burst_p50['ours']:+.1f}), zygote "
                           f"{burst_p50['ours_zygote']:.1f} ms ({burst_p50['ours_zygote'] - burst_p50['ours']:+.1f})"]
        self.record("isolation", columns, f"{reps} reps per column, interleaved, {ISOLATION_GAP_S * 1000:.0f} ms apart; "
                                          "ours_isolated and ours_zygote are stacks with NDIF_DEFAULT_TRUSTED=0 "
                                          "(NDIF_ISOLATION=fork / zygote)",
                    {"isolated_added_p50_ms": fork_added, "zygote_added_p50_ms": zygote_added,
                     "back_to_back_p50_ms": burst_p50, "gap_s": ISOLATION_GAP_S,
                     "isolated_meta": {"isolated_ms_p50": server_p50("ours_isolated"),
                                       "zygote_isolated_ms_p50": server_p50("ours_zygote")}},
                    notes=[f"{label} - in-process, client p50: {value:+.1f} ms" if value is not None else
                           f"{label} - in-process: not measured"
                           for label, value in (("isolated (fork)", fork_added), ("isolated (zygote)", zygote_added))]
                    + burst_notes)
