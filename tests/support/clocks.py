"""Clocks a test drives, for code that takes ``clock=`` (the prober's rule "red for a minute")."""

from __future__ import annotations


class StepClock:
    """Each read returns the time and moves it on by ``step_s``: a prober reads it once
    per probe, so probes in a row are ``step_s`` apart. ``advance`` jumps on."""

    def __init__(self, start: float = 1_800_000_000.0, step_s: float = 0.0) -> None:
        self.now = start
        self.step_s = step_s

    def __call__(self) -> float:
        now = self.now
        self.now += self.step_s
        return now

    def advance(self, seconds: float) -> None:
        self.now += seconds
