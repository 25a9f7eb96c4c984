"""The controller's step-cost profile, measured on the simulated engine.

The plugin measures a ``StepProfile`` on its engine before serving
(``vllm_specplug.profiling.measure``); the simulator runs the same
procedure on its own engine and clock, with the plugin's constants
(``WARMUP``, ``REPEATS`` .. ``MAX_REPEATS``, ``SHAPE_S``, ``PROMPT_TOKENS``,
``BUDGET_S``, ``robust_median``):

- one dummy request runs two untimed steps of each kind first (plain,
  verifying K drafts, K_step 1, K_step K);
- dummy requests of ``PROMPT_TOKENS`` prompt tokens are added and
  prefilled (untimed steps, which still warm their shapes); each later step
  adds one token to every context (the placeholder drafts are rejected);
- per batch size ``B`` = 1, 2, 4, ... up to ``max_num_seqs`` (and
  ``max_num_seqs`` itself), while ``B (1 + K)`` fits the token budget, five
  shapes, each ``WARMUP`` discarded steps, then at least ``REPEATS`` timed
  ones (up to ``MAX_REPEATS`` while they add up to less than ``SHAPE_S``),
  of which the median of those within 1.5x of the fastest is kept:

      K_step 0, K drafts verified    target(B (1 + K))
      K_step 0, no drafts            target(B)
      K_step 1, no drafts            target(B) + first(B)
      K_step 1, K drafts             target(B (1 + K)) + first(B (1 + K))
      K_step K, K drafts             ... + (K - 1) pass(B)

  with one K_step 1 step between the K_step 0 ones and the rest: under the
  zero-cost fallback it catches the draft up on what it skipped, and its
  time less ``target(B) + first(B)`` is the catch-up curve;
- ``first`` and ``pass`` are differences of medians, clipped at zero;
- batches stop once the next one (taken to last twice as long as the last)
  would end past ``BUDGET_S`` seconds.

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
from vllm_specplug.profiling import (
    BUDGET_S,
    MAX_REPEATS,
    PROMPT_TOKENS,
    REPEATS,
    SHAPE_S,
    WARMUP,
    robust_median,
)
from vllm_specplug.sim.clock import Realism, StepClock
from vllm_specplug.sim.cost import Setup, StepCost


class _Bench:
    """Dummy requests on the simulated engine: contexts, the draft's gap, the clock."""

    def __init__(self, setup: Setup, timer: StepClock) -> None:
        self.setup, self.timer = setup, timer
        self.cost = StepCost(setup)
        self.ctx = np.zeros(0)
        self.gap = np.zeros(0)  # tokens each request's draft skipped (zero-cost fallback)
        self.told = 0  # ... as the plugin counts them: tokens scheduled at K_step 0
        self.seconds = 0.0
        self.shapes = 0

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
        self.told += tokens

    def step(self, k_step: int, drafts: int) -> tuple[float, int, int]:
        """One step of every request; (seconds, tokens scheduled, catch-up tokens told)."""
        b = self.ctx.size
        t = self.cost.step(self.ctx, np.full(b, drafts, dtype=np.int64), k_step)
        tokens = b * (1 + drafts)
        catchup = 0
        zero_cost = not self.setup.draft_at_k0
        if zero_cost and k_step > 0 and self.gap.sum() > 0:
            gap = self.gap
            done = self.ctx - gap
            pairs = float((gap * done + gap * (gap + 1) / 2).sum())
            t += float(self.cost.draft_pass(float(gap.sum()), float(done.sum()), pairs))
            catchup = self.told
        seconds = self.timer.seconds(t, tokens, k_step > 0)
        self.seconds += seconds
        self.ctx = self.ctx + 1
        if zero_cost:
            if k_step == 0:
                self.gap, self.told = self.gap + 1, self.told + tokens
            else:
                self.gap, self.told = np.zeros(b), 0
        return seconds, tokens, catchup

    def shape(self, k_step: int, drafts: int) -> tuple[float, int]:
        times, tokens = [], 0
        for _ in range(WARMUP):
            self.step(k_step, drafts)
        while len(times) < REPEATS or (len(times) < MAX_REPEATS and sum(times) < SHAPE_S):
            seconds, tokens, _ = self.step(k_step, drafts)
            times.append(seconds)
        self.shapes += 1
        return float(robust_median(times)), tokens


def measure_profile(setup: Setup, rng: np.random.Generator,
                    clock: StepClock | None = None, budget_s: float = BUDGET_S) -> StepProfile:
    """The plugin's start-up measurement on ``setup``'s simulated engine.

    ``clock``: the engine's clock, whose cold shapes the measurement warms;
    without one, a fresh clock of the setup's default realism.
    """
    timer = clock.fork(rng) if clock is not None else StepClock(
        Realism.for_setup(setup.noise), rng)
    k = setup.max_k
    max_batch = max(1, setup.max_concurrency)
    token_budget = setup.workload.max_batched_tokens
    bench = _Bench(setup, timer)
    # Untimed warm-up steps of each kind before the first shape, as the
    # plugin runs them.
    bench.add(1)
    for k_step, drafts in ((0, 0), (0, k), (1, 0), (k, k)) * 2:
        bench.step(k_step, drafts)
    target: dict[int, list[float]] = {}
    first: dict[int, list[float]] = {}
    passes: dict[int, float] = {}
    catchups: dict[int, float] = {}
    b = 1
    while b <= max_batch and b * (1 + k) <= token_budget:
        before = bench.seconds
        bench.add(b - bench.ctx.size)
        a_wide, t_wide = bench.shape(0, k)
        a_plain, t_plain = bench.shape(0, 0)
        c_secs, _, c_tokens = bench.step(1, 0)
        f_plain, _ = bench.shape(1, 0)
        f_wide, _ = bench.shape(1, k)
        e_wide, _ = bench.shape(k, k) if k > 1 else (f_wide, 0)
        target.setdefault(t_plain, []).append(a_plain)
        target.setdefault(t_wide, []).append(a_wide)
        first.setdefault(t_plain, []).append(max(f_plain - a_plain, 0.0))
        first.setdefault(t_wide, []).append(max(f_wide - a_wide, 0.0))
        passes[b] = max(e_wide - f_wide, 0.0) / max(k - 1, 1)
        if not setup.draft_at_k0 and c_tokens:
            catchups[int(c_tokens)] = max(c_secs - f_plain, 0.0)
        # The next batch size takes about twice as long as this one did.
        if bench.seconds + 2.0 * (bench.seconds - before) > budget_s:
            break
        b = b * 2 if b * 2 <= max_batch or b == max_batch else max_batch
    tokens = sorted(target)
    return StepProfile(
        tokens, [float(np.median(target[t])) for t in tokens],
        [float(np.median(first[t])) for t in tokens],
        sorted(passes), [passes[x] for x in sorted(passes)],
        catchup_tokens=sorted(catchups) or None,
        catchup_s=[catchups[c] for c in sorted(catchups)] or None,
        meta={"source": "sim", "setup": setup.key, "seconds": round(bench.seconds, 3),
              "shapes": bench.shapes, "repeats": REPEATS, "warmup": WARMUP})


__all__ = ["measure_profile"]
