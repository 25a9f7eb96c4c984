"""The controller's step-cost profile, measured on the simulated engine.

The plugin measures a ``StepProfile`` on its engine before serving
(``vllm_specplug.profiling.run_rounds``); the simulator runs that same
function on its own engine and clock, through a bench that has the
plugin's bench's interface:

- dummy requests of ``PROMPT_TOKENS`` prompt tokens are added and
  prefilled in one untimed step (which still warms its shape); each later
  step adds one token to every context (the placeholder drafts are
  rejected);
- a step at K_step > 0 after K_step = 0 ones catches the draft up on what
  it skipped under the zero-cost fallback, and reports the tokens that
  catch-up ran over (the plugin's unit; the simulator has no KV blocks to
  round them to).

The steps run on the engine's ``StepClock``: the discarded warm-ups are the
cold first steps of those shapes, so the engine serves with them warm; the
measurement's own noise and stalls come from ``rng``.

The profile carries no capture sizes (as the plugin's does not): between
measured sizes the controller interpolates linearly over what the engine
runs as a step function.  Nor does it know contexts longer than the dummy
requests' (attention reads more KV), or token counts past its largest size
(prefill chunks: extrapolated at the last slope).  The controller's
``ProfileCorrection`` is what absorbs those.
"""

from __future__ import annotations

import numpy as np

from vllm_specplug.controller import StepProfile
from vllm_specplug.profiling import BUDGET_S, PROMPT_TOKENS, ProfileSequenceError, run_rounds
from vllm_specplug.tools.sim.clock import Realism, StepClock
from vllm_specplug.tools.sim.cost import PassShape, Setup, StepCost


class _Bench:
    """Dummy requests on the simulated engine: contexts, the draft's gap, the clock."""

    def __init__(self, setup: Setup, timer: StepClock) -> None:
        self.setup, self.timer = setup, timer
        self.cost = StepCost(setup)
        self.ctx = np.zeros(0)
        self.gap = np.zeros(0)  # tokens each request's draft skipped (zero-cost fallback)
        self.seconds = 0.0
        self.proposed = 0  # drafts the last step proposed per request (the plugin's bench's)

    def add(self, n: int) -> None:
        """``n`` new requests, prefilled in one step (untimed)."""
        if n <= 0:
            return
        old = self.ctx
        chunk = np.full(n, float(PROMPT_TOKENS))
        t = self.cost.step(old, np.zeros(old.size, dtype=np.int64), 0, np.zeros(n), chunk)
        tokens = old.size + n * PROMPT_TOKENS
        self.seconds += self.timer.seconds(t, tokens, False)
        self.ctx = np.concatenate((old + 1, chunk + 1))
        self.gap = np.concatenate((self.gap + 1, chunk + 1))
        self.proposed = 0

    def step(self, k_step: int, drafts: int) -> tuple[float, int, int]:
        """One step of every request; (seconds, tokens scheduled, tokens caught up)."""
        if drafts > self.proposed:
            raise ProfileSequenceError(f"{drafts} drafts verified after {self.proposed} proposed")
        self.proposed = k_step
        b = self.ctx.size
        t = self.cost.step(self.ctx, np.full(b, drafts, dtype=np.int64), k_step)
        tokens = b * (1 + drafts)
        catchup = 0
        zero_cost = not self.setup.draft_at_k0
        if zero_cost and k_step > 0 and self.gap.sum() > 0:
            gap = self.gap
            done = self.ctx - gap
            pairs = float((gap * done + gap * (gap + 1) / 2).sum())
            t += float(self.cost.draft_pass(float(gap.sum()), float(done.sum()), pairs,
                                            PassShape(0, 0.0, gap, done)))
            catchup = int(gap.sum())
        seconds = self.timer.seconds(t, tokens, k_step > 0)
        self.seconds += seconds
        self.ctx = self.ctx + 1
        if zero_cost:
            if k_step == 0:
                self.gap = self.gap + 1
            else:
                self.gap = np.zeros(b)
        return seconds, tokens, catchup

    @property
    def size(self) -> int:
        return int(self.ctx.size)


def measure_profile(setup: Setup, rng: np.random.Generator,
                    clock: StepClock | None = None, budget_s: float = BUDGET_S) -> StepProfile:
    """The plugin's start-up measurement on ``setup``'s simulated engine.

    ``clock``: the engine's clock, whose cold shapes the measurement warms;
    without one, a fresh clock of the setup's default realism.
    """
    timer = clock.fork(rng) if clock is not None else StepClock(
        Realism.for_setup(setup.noise), rng)
    bench = _Bench(setup, timer)
    profile = run_rounds(bench, setup.max_k, max(1, setup.max_concurrency),
                         setup.workload.max_batched_tokens, not setup.draft_at_k0,
                         lambda: bench.seconds, budget_s)
    profile.meta.update(source="sim", setup=setup.key)
    return profile


__all__ = ["measure_profile"]
