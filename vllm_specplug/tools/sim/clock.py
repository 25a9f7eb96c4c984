"""The simulated clock: noise-free step costs turned into measured seconds.

``StepCost`` says what a step costs on an idle, warmed-up engine.  A real
engine's step times are not that clean, and the controller is fed the
measured ones, so every policy's engine runs on a ``StepClock`` that
multiplies each step's cost by

- a cold-shape factor: the first ``cold_steps`` steps of a shape not run
  before take ``cold_factor`` times as long (kernel selection, allocator
  growth, compilation of a new size).  A shape is whether the step drafts
  (K_step >= 1) and the power-of-two band of its token count;
- a rare stall: with probability ``stall_prob`` a step takes
  ``stall_factor`` times as long (a host hiccup, a preempted process);
- lognormal noise of shape ``noise`` with mean 1.

The streams are seeded per cell: the noise and the stalls come from two
generators of their own, so turning stalls off leaves the noise draws
unchanged.  The oracle plans on the noise-free cost; its steps run on the
same clock as everyone else's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class Realism:
    noise: float = 0.05  # lognormal sigma (mean-one) of every step
    cold_steps: int = 2  # steps of a new shape that run slow
    cold_factor: float = 3.0
    stall_prob: float = 0.005
    stall_factor: float = 5.0

    @classmethod
    def for_setup(cls, noise: float, realistic: bool = True,
                  cold_steps: int | None = None) -> "Realism":
        """The default clock, or (``realistic=False``) noise alone."""
        r = cls(noise=noise)
        if cold_steps is not None:
            r = replace(r, cold_steps=cold_steps)
        return r if realistic else replace(r, cold_steps=0, stall_prob=0.0)


def shape_of(tokens: float, drafting: bool) -> tuple[bool, int]:
    """(drafts?, power-of-two band of the scheduled tokens)."""
    return bool(drafting), int(math.log2(max(float(tokens), 1.0)))


class StepClock:
    def __init__(self, realism: Realism, noise_rng: np.random.Generator,
                 stall_rng: np.random.Generator | None = None,
                 seen: dict | None = None) -> None:
        self.realism = realism
        self.noise_rng = noise_rng
        self.stall_rng = noise_rng if stall_rng is None else stall_rng
        # Steps run so far per shape (shared with forks: one engine's warmth).
        self.seen: dict[tuple[bool, int], int] = {} if seen is None else seen
        self.cold_steps_run = 0
        self.stalls = 0

    def fork(self, rng: np.random.Generator) -> "StepClock":
        """The same engine's warmth, timed with other random streams (a
        measurement that must not shift the serving steps' noise)."""
        return StepClock(self.realism, rng, rng, self.seen)

    def seconds(self, cost_s: float, tokens: float, drafting: bool) -> float:
        """Measured seconds of a step whose noise-free cost is ``cost_s``."""
        r = self.realism
        factor = 1.0
        if r.cold_steps > 0:
            key = shape_of(tokens, drafting)
            n = self.seen.get(key, 0)
            self.seen[key] = n + 1
            if n < r.cold_steps:
                factor *= r.cold_factor
                self.cold_steps_run += 1
        if r.stall_prob > 0 and self.stall_rng.random() < r.stall_prob:
            factor *= r.stall_factor
            self.stalls += 1
        if r.noise > 0:
            z = float(self.noise_rng.standard_normal())
            factor *= math.exp(r.noise * z - 0.5 * r.noise ** 2)
        return cost_s * factor


__all__ = ["Realism", "StepClock", "shape_of"]
