"""MiniMax-M1 staged output-length extension.

RL starts with a short output window and moves to the next one only when two measured
gates pass (M1 section 4): the perplexity of generated sequences has converged, and the
99th percentile of output lengths has come close to the window (the policy is pushing
against the limit). Each window carries its own eps_high and gradient clip, lowered at
each step up as M1 did against late-stage instability.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tasks.train.config import LengthGates, LengthWindow


@dataclass
class GateReading:
    perplexity_converged: bool
    length_near_window: bool
    advanced: bool
    window_index: int


class LengthSchedule:
    def __init__(self, windows: list[LengthWindow], gates: LengthGates):
        if not windows:
            raise ValueError("a length schedule needs at least one window")
        self.windows = list(windows)
        self.gates = gates
        self.index = 0
        self.steps_in_window = 0
        self.perplexities: list[float] = []

    @property
    def window(self) -> LengthWindow:
        return self.windows[self.index]

    @property
    def is_last(self) -> bool:
        return self.index == len(self.windows) - 1

    def perplexity_converged(self) -> bool:
        """The last ``ppl_patience`` perplexities spread less than ``ppl_tolerance`` (relative)."""
        recent = self.perplexities[-self.gates.ppl_patience:]
        if len(recent) < self.gates.ppl_patience:
            return False
        mean = sum(recent) / len(recent)
        return mean > 0 and (max(recent) - min(recent)) / mean <= self.gates.ppl_tolerance

    def length_near_window(self, p99_length: float) -> bool:
        return p99_length >= self.gates.p99_fraction * self.window.max_tokens

    def observe(self, perplexity: float, p99_length: float) -> GateReading:
        """Feed one RL step's measurements; step up to the next window when both gates pass."""
        self.steps_in_window += 1
        if not math.isnan(perplexity):  # NaN (no tokens generated) carries no evidence
            self.perplexities.append(float(perplexity))
        converged = self.perplexity_converged()
        near = self.length_near_window(p99_length)
        advance = (converged and near and not self.is_last
                   and self.steps_in_window >= self.gates.min_steps_per_window)
        if advance:
            self.index += 1
            self.steps_in_window = 0
            self.perplexities = []
        return GateReading(converged, near, advance, self.index)

    def state_dict(self) -> dict:
        return {"index": self.index, "steps_in_window": self.steps_in_window, "perplexities": list(self.perplexities)}

    def load_state_dict(self, state: dict) -> None:
        self.index = int(state["index"])
        self.steps_in_window = int(state["steps_in_window"])
        self.perplexities = [float(p) for p in state["perplexities"]]
