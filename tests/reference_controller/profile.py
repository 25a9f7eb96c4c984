"""The reference's step-cost profile: the package's ``StepProfile`` and
``prior_profile`` (the decision-cost rewrite did not change them), and
``ProfileCorrection`` as it was before the rewrite (its ``ratios_from``
took the NumPy path the new one replaced), with the plain steps' offset
added since in both (a change of what is decided, not of how fast).
"""

from __future__ import annotations

import math

import numpy as np

from vllm_specplug.controller.profile import StepProfile, prior_profile  # noqa: F401


class ProfileCorrection:
    """Per step shape, a median ratio of measured to profiled step time.

    A shape is the power-of-two band of the step's tokens and that of its
    requests: one request verifying four drafts and five requests decoding
    plainly both run five tokens, but not the same draft passes nor
    attention over the same contexts.  Its ratio is a level common to all
    shapes (a host faster than when the profile was cached, contexts longer
    than the profile's) times its own residual, so a shape the policy has not
    run is priced at the level, as the shapes it runs are, and plans in
    different shapes compare at one price.  Plain steps (K_step = 0) are
    priced at one more term, an offset of their own learnt from the
    decoding plain steps run at any batch size (the level moves with
    drafting steps only): a profile can price plain and drafting work with
    different errors, and a plan that drafts every step at a batch size
    never runs that size's plain step, so would never learn its price (a
    plain step runs where the plan falls back, at another batch size).
    Each kept step moves its shape's ratio, and the level or the offset,
    toward its own by at most ``step`` (running medians): a stall or a
    few cold first steps move a price by a few percent at most, a steady
    mismatch is absorbed within a few dozen steps.  Ratios stay in
    [``low``, ``high``], residuals are forgotten toward the level and the
    level and the offset toward 1 (``forget`` per observed step): the
    profile remains the source of the price.
    """

    BANDS = 24        # token bands
    BATCH_BANDS = 12  # request bands

    def __init__(self, step: float = 0.02, low: float = 0.5, high: float = 2.0,
                 forget: float = 0.002) -> None:
        self.step = step
        # A shape no step visits any more drifts back to the level, instead
        # of keeping an old price.
        self.keep = 1.0 - forget
        self.low, self.high = math.log(low), math.log(high)
        self._level = 0.0
        self._plain = 0.0  # the plain steps' offset
        self._log = np.zeros((self.BATCH_BANDS, self.BANDS))  # residuals
        self.observations = 0

    @staticmethod
    def _band(n: float, bands: int) -> int:
        return min(max(int(math.log2(max(n, 1.0))), 0), bands - 1)

    def _at(self, tokens: float, batch: int) -> tuple[int, int]:
        return self._band(batch, self.BATCH_BANDS), self._band(tokens, self.BANDS)

    def ratio(self, tokens: float, batch: int, plain: bool = False) -> float:
        """The ratio of a step's shape; ``plain``: of a plain step (K_step = 0)."""
        off = self._plain if plain else 0.0
        return math.exp(min(max(self._level + off + self._log[self._at(tokens, batch)],
                                self.low), self.high))

    def ratios_from(self, start: int, count: int, batch: int) -> np.ndarray:
        """Ratios for steps of ``batch`` requests and ``start``, ``start + 1``,
        ... ``start + count - 1`` tokens."""
        row = np.clip(self._level + self._log[self._band(batch, self.BATCH_BANDS)], self.low,
                      self.high)
        lo, hi = self._band(start, self.BANDS), self._band(start + count - 1, self.BANDS)
        if lo == hi:
            return np.full(count, math.exp(row[lo]))
        # Band b holds [2^b, 2^(b+1)); the last band holds everything past it.
        edges = [start] + [1 << b for b in range(lo + 1, hi + 1)] + [start + count]
        lengths = [e1 - e0 for e0, e1 in zip(edges, edges[1:])]
        return np.repeat(np.exp(row[lo:hi + 1]), lengths)

    def observe(self, tokens: float, batch: int, profiled: float, measured: float,
                plain: bool = False) -> bool:
        """Fold in one step (``plain``: K_step = 0); returns whether it was kept
        (garbage timings are not)."""
        if not (profiled > 0 and math.isfinite(measured) and measured > 0):
            return False
        at = self._at(tokens, batch)
        self._log *= self.keep
        self._plain *= self.keep
        seen = math.log(measured / profiled)
        # The shape's own price moves one step whatever the level does.
        off = self._plain if plain else 0.0
        total = self._toward(self._level + off + self._log[at], seen)
        if plain:
            # The offset is the decoding plain steps' running median over
            # the level, which drafting steps alone move: a host faster or
            # slower moves both, and plain steps never pull drafting prices
            # toward theirs.  A step with a prefill chunk (more tokens than
            # requests) corrects its own shape only: a chunk's error is not
            # a decoding step's.
            if tokens <= batch:
                self._plain = self._toward(off, seen - self._level)
            self._level *= self.keep
        else:
            self._level = self._toward(self._level * self.keep, seen)
        self._log[at] = total - self._level - (self._plain if plain else 0.0)
        self.observations += 1
        return True

    def _toward(self, cur: float, seen: float) -> float:
        cur += min(max(seen - cur, -self.step), self.step)  # met, not circled
        return min(max(cur, self.low), self.high)

    def learnt(self) -> dict[str, float]:
        """The level (``"common"``), the plain steps' offset (``"plain"``) and the
        shapes steps have moved (drafting steps' ratios), as
        ``"<tokens>x<batch>"`` (each band's first value) -> ratio."""
        rows, cols = np.nonzero(self._log)
        return {"common": round(math.exp(self._level), 3),
                "plain": round(math.exp(self._plain), 3)} | {
            f"{1 << int(c)}x{1 << int(r)}": round(self.ratio(1 << int(c), 1 << int(r)), 3)
            for r, c in zip(rows, cols)}
