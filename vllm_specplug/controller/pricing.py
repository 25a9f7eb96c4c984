"""What a plan costs: the priced decision, the profile with its live correction
(``StepPricer``), and one step's prices (``_Prices``, built by
``StepPrices.prices``, which ``GoodputPolicy`` inherits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from vllm_specplug.controller.correction import ProfileCorrection
from vllm_specplug.controller.profile import StepProfile, convex_rise


@dataclass
class Decision:
    k_step: int
    k: np.ndarray  # per request, same order as the batch
    predicted_seconds: float = float("nan")
    predicted_tokens: float = float("nan")
    plain_seconds: float = float("nan")
    plain_tokens: float = float("nan")
    # The estimator's survival rows the plan read (batch order), and for a
    # goodput plan whose drafts a per-position stop may extend, what
    # ``SpecController.stop_rule`` needs: (req_ids, rows, ceilings, prices,
    # the argmax's decision where this one was changed after it, else None).
    survival: np.ndarray | None = field(default=None, repr=False)
    basis: tuple | None = field(default=None, repr=False)

    @property
    def predicted_speedup(self) -> float:
        if not (self.predicted_seconds > 0 and self.plain_seconds > 0):
            return float("nan")
        return (self.predicted_tokens / self.predicted_seconds) / (
            self.plain_tokens / self.plain_seconds
        )


def decode_curve(profile: StepProfile, base: float, batch: int, width: int) -> np.ndarray:
    """Profiled seconds of a drafting step of ``batch`` requests over ``base``
    tokens by the number n of slots it verifies (0..``batch * width``),
    before its further draft passes: the target's and the draft's first pass,
    made non-decreasing and convex in n (``convex_rise``).  A verified token
    does not cost less than the one before it, so a profile point a repeat
    would not reproduce (one 2-token step measured a third dearer than the
    1- and 9-token steps) is spread over its neighbours instead of pricing
    one place in every step.  Captured sizes (CUDA graphs) keep their real
    staircase: there the curve is only made non-decreasing."""
    raw = profile.verify_and_first(base + np.arange(batch * width + 1, dtype=np.float64))
    return np.maximum.accumulate(raw) if profile.pad_sizes is not None else convex_rise(raw)


class StepPricer:
    """The profile with its live correction: seconds of a planned step.

    ``width`` (the plans' deepest draft): a decoding drafting step is
    corrected against the price its plan read, the convex curve of
    ``decode_curve``, not the profile's raw point, so that what the
    correction learns at a shape is what the plans there pay (the Qwen
    pair's CPU profile priced four requests' K=1 step 12% under its raw
    point on that curve; corrected against the point, the plans kept the
    discount).
    """

    def __init__(self, profile: StepProfile, correction: ProfileCorrection | None = None,
                 width: int = 0) -> None:
        self.profile = profile
        self.correction = correction or ProfileCorrection()
        self.width = width
        self._curves: dict[int, np.ndarray] = {}

    def seconds(self, tokens: float, batch: int, k_step: int, catchup_tokens: float = 0.0) -> float:
        raw = self.profiled(tokens, batch, k_step, catchup_tokens)
        return raw * self.correction.ratio(tokens, batch, k_step)

    def profiled(self, tokens: float, batch: int, k_step: int,
                 catchup_tokens: float = 0.0) -> float:
        """The profile's seconds of a step as a plan prices it."""
        profile, n = self.profile, int(tokens) - batch
        if k_step > 0 and self.width and 0 < n <= batch * self.width and n + batch == tokens:
            curve = self._curves.get(batch)
            if curve is None:
                if len(self._curves) > 256:
                    self._curves.clear()
                curve = self._curves[batch] = decode_curve(profile, batch, batch, self.width)
            return float(curve[n] + (k_step - 1) * profile.draft_pass(batch)
                         + profile.catchup(catchup_tokens))
        return profile.step(tokens, batch, k_step, catchup_tokens)

    def observe(self, tokens: float, batch: int, k_step: int, seconds: float,
                catchup_tokens: float = 0.0) -> bool:
        raw = self.profiled(tokens, batch, k_step, catchup_tokens)
        return self.correction.observe(tokens, batch, raw, seconds, k_step)


@dataclass
class _Prices:
    """One step's prices for ``GoodputPolicy.decide_priced`` (``GoodputPolicy.prices``)."""
    batch: int
    fixed_k_step: int | None
    plain_full: float    # the plain step, prefill chunk included
    prefill_p: float     # the prefill chunk's profiled target seconds
    prefill_s: float     # ... at the plain step's correction
    unseen_s: float      # catch-up and draft prefill, paid by a drafting plan
    owed: float          # unseen_s per token yielded (0 without a horizon)
    plain: float         # plain decoding's seconds, without the prefill chunk
    plain_charged: float # ... plus its share of what skipping the draft adds
    by_n: np.ndarray | None = None   # a drafting step's decode seconds by slots verified
    # Its correction for 0..n-1 slots, row j at K_step j (``ProfileCorrection.ratios_from``).
    ratios: Callable[[int], np.ndarray] | None = None
    draft_pass: float = 0.0


class StepPrices:
    """A step shape's prices from the profile and its correction, for the
    goodput policy's argmax (``GoodputPolicy`` is one; it sets ``_cached_shape``)."""

    def prices(self, batch: int, width: int, base_tokens: float, pricer: StepPricer,
               fixed_k_step: int | None = None, catch_up_s: float = 0.0,
               horizon: float | None = None, skip_s: float = 0.0) -> _Prices:
        """What ``decide`` prices, for ``decide_priced``: one step's shape, any survival."""
        profile, corr = pricer.profile, pricer.correction
        base = max(float(base_tokens), float(batch))
        shape = self._shape(profile, base, batch, width)
        prefill_p, prefill_f, plain_p, by_n, draft_pass = shape[4:]
        # Every plan of this step is priced at the correction of the step's
        # own shape, prefill chunk and all; the plain plan at a plain step's.
        ratio = corr.ratio(base, batch)
        plain_ratio = corr.ratio(base, batch, 0)
        # The plain step with its prefill chunk: at least the plain step without it.
        plain_full = (plain_p + prefill_p) * plain_ratio
        prefill_s = prefill_p * plain_ratio
        unseen_s = catch_up_s + prefill_f * ratio  # paid by drafting plans
        per_token = 1.0 / max(horizon, 1.0) if horizon is not None else 0.0
        pr = _Prices(batch, fixed_k_step, plain_full, prefill_p, prefill_s, unseen_s,
                     owed=unseen_s * per_token, plain=plain_full - prefill_s,
                     plain_charged=plain_full - prefill_s + skip_s * per_token * batch)
        if fixed_k_step == 0 or width == 0 or batch == 0:
            return pr
        pr.by_n, pr.draft_pass = by_n, draft_pass
        # The correction's ratios for the step's tokens and 0..all slots, by
        # K_step (up to the pinned one), taken once per decision; a plan of n
        # slots reads the first n + 1.
        full, passes = [], max(width, fixed_k_step or 0)

        def ratios(count: int) -> np.ndarray:
            if not full:
                full.append(corr.ratios_from(int(base), by_n.size, batch, passes))
            return full[0][:, :count]

        pr.ratios = ratios
        return pr

    def _shape(self, profile: StepProfile, base: float, batch: int, width: int) -> tuple:
        """The profile's prices of a step shape, cached while the profile and the shape
        stay (a batch decoding step after step asks for the same one)."""
        cached = self._cached_shape
        if (cached is not None and cached[0] is profile and cached[1] == base
                and cached[2] == batch and cached[3] == width):
            return cached
        # The prefill chunk's share, not below zero: the token curves are the
        # measured medians, and a step over more tokens can measure cheaper
        # (see by_n below).
        plain_p = profile.target(batch)
        prefill_p = max(profile.target(base) - plain_p, 0.0)
        # The draft's pass over the prefill chunk, when a plain step would
        # skip it (zero-cost fallback); otherwise what drafting adds is the
        # step's own cost.
        prefill_f = (max(profile.first(base) - profile.first(batch), 0.0)
                     if profile.skips_draft_at_k0 else 0.0)
        by_n, draft_pass = None, 0.0
        if width and batch:
            # A drafting step's decode work by slots verified, before its
            # K_step-dependent draft passes: the step less its prefill share,
            # read from the step's own size up (a smaller shape, a 1-token
            # step measured slower than a 4-token one, never raises it).
            by_n = decode_curve(profile, base, batch, width) - prefill_p - prefill_f
            by_n.flags.writeable = False
            draft_pass = profile.draft_pass(batch)
        self._cached_shape = (profile, base, batch, width, prefill_p, prefill_f, plain_p, by_n,
                              draft_pass)
        return self._cached_shape
