"""The live correction of the step-cost profile's prices.

``ProfileCorrection`` is the only price learnt from live steps: per band of
step size, the median ratio of measured to profiled time, tracked with a
fixed step in log space and clipped to [0.5, 2].  Drafting steps share a
level; a plain decoding shape measured lately keeps its own price, which
drafting steps never move.  A few slow first steps move a price a few
percent, not to one that keeps drafting off for good.
"""

from __future__ import annotations

import math

import numba
import numpy as np


@numba.njit(cache=True)
def band(n, bands):
    """The power-of-two band of a count: band b holds [2^b, 2^(b+1)), band 0
    also 0 and 1, the last band (``bands - 1``) everything past it."""
    b, x = 0, int(max(n, 1.0))
    while x >= 2 and b < bands - 1:
        x >>= 1
        b += 1
    return b


@numba.njit(cache=True)
def _band_ratios(logs, level, low, high, start, count):
    """``ProfileCorrection.ratio`` at ``start``, ``start + 1``, ... tokens (token
    bands by ``band``)."""
    out = np.empty(count)
    end, t, i = start + count, start, 0
    while t < end:
        b = band(t, logs.size)
        stop = end if b == logs.size - 1 else min(end, 1 << (b + 1))
        v = math.exp(min(max(level + logs[b], low), high))
        while t < stop:
            out[i] = v
            i += 1
            t += 1
    return out


class ProfileCorrection:
    """Per step shape, a median ratio of measured to profiled step time.

    A shape is the power-of-two band of the step's tokens and that of its
    requests: one request verifying four drafts and five requests decoding
    plainly both run five tokens, but not the same draft passes nor
    attention over the same contexts.  A drafting shape's ratio is a level
    common to all of them (a host faster than when the profile was cached,
    contexts longer than the profile's) times its own residual, so a shape
    the policy has not run is priced at the level, as the shapes it runs
    are, and plans in different shapes compare at one price.  A plain
    decoding shape (K_step = 0, no prefill chunk) measured lately is priced
    at its own ratio alone, weighed against a prior as it was measured
    lately: drafting steps move the level, and a plain price riding on it
    moved with them (served ShareGPT at eight requests: the plain step's
    price rose 0.15 -> 0.21 s in one wave of drafting steps with no plain
    step run, where plain steps ran 0.15-0.18 s).  The prior, for plain
    shapes not measured lately, is the level times an offset of their own
    learnt from the decoding plain steps run at any batch size: a profile
    can price plain and drafting work with different errors, and a plan
    that drafts every step at a batch size never runs that size's plain
    step, so would never learn its price (a plain step runs where the plan
    falls back, at another batch size).  Each kept step moves its shape's
    ratio, and the level or the offset, toward its own by at most ``step``
    (running medians): a stall or a few cold first steps move a price by a
    few percent at most, a steady mismatch is absorbed within a few dozen
    steps.  Ratios stay in [``low``, ``high``]; residuals are forgotten
    toward the level, plain shapes' weights toward the prior, the level and
    the offset toward 1 (``forget`` per observed step): the profile remains
    the source of the price.  Per request band it also counts the decoding
    plain steps it has seen, forgotten at the same rate (``plain_seen``): a
    band whose plain price nothing has measured lately is priced from the
    prior only (``SpecController`` probes it).
    """

    # Power-of-two bands of a step's tokens and of its requests.
    # Source: dd2c4cc (the request bands: served ShareGPT c=4 drafting steps
    # measured/predicted 1.00-1.04, 1.07-1.18 keyed by tokens alone).
    BANDS = 24
    BATCH_BANDS = 12
    # At most this much (in log) a step; ratios clipped to [LOW, HIGH];
    # residuals, plain shapes' weights, level and offset forgotten by FORGET a step.
    # Source: the stall and warm-up tests (test_profile.py); constants_sweep.py
    # at 59dd374: a 0.8-1.25 clip and a forgetting of 0 or 0.02 decide alike.
    STEP = 0.02
    LOW, HIGH = 0.5, 2.0
    FORGET = 0.002

    def __init__(self, step: float = STEP, low: float = LOW, high: float = HIGH,
                 forget: float = FORGET) -> None:
        self.step = step
        # A shape no step visits any more drifts back to the level, instead
        # of keeping an old price.
        self.keep = 1.0 - forget
        self.low, self.high = math.log(low), math.log(high)
        self._level = 0.0
        self._plain = 0.0  # the plain steps' offset
        self._log = np.zeros((self.BATCH_BANDS, self.BANDS))  # residuals
        # Plain decoding shapes: their own log ratio, and how far it was
        # measured lately (1: the last step was it), against the prior.
        self._own = np.zeros((self.BATCH_BANDS, self.BANDS))
        self._weight = np.zeros((self.BATCH_BANDS, self.BANDS))
        self._plain_seen = np.zeros(self.BATCH_BANDS)
        self.observations = 0

    def _at(self, tokens: float, batch: int) -> tuple[int, int]:
        return band(float(batch), self.BATCH_BANDS), band(float(tokens), self.BANDS)

    def _log_ratio(self, tokens: float, batch: int, plain: bool) -> float:
        at = self._at(tokens, batch)
        if plain and tokens <= batch:
            prior = self._level + self._plain
            return prior + self._weight[at] * (self._own[at] - prior)
        return self._level + (self._plain if plain else 0.0) + self._log[at]

    def ratio(self, tokens: float, batch: int, plain: bool = False) -> float:
        """The ratio of a step's shape; ``plain``: of a plain step (K_step = 0)."""
        return math.exp(min(max(self._log_ratio(tokens, batch, plain), self.low), self.high))

    def ratios_from(self, start: int, count: int, batch: int) -> np.ndarray:
        """Ratios for steps of ``batch`` requests and ``start``, ``start + 1``,
        ... ``start + count - 1`` tokens."""
        return _band_ratios(self._log[band(float(batch), self.BATCH_BANDS)], self._level,
                            self.low, self.high, int(start), int(count))

    def seed(self, plain_batches, repeats: float, plain: float = 1.0,
             drafting: float = 1.0) -> None:
        """Start from what the engine timed at start-up (``profiling``'s
        ``meta["start_check"]``): drafting steps at ``drafting`` times the
        profile (the level), plain steps at ``plain`` times it (the level and
        the plain offset), and ``repeats`` decoding plain steps seen in the
        request band of each of ``plain_batches``."""
        clip = lambda x: min(max(x, self.low), self.high)  # noqa: E731
        self._level = clip(math.log(drafting))
        self._plain = clip(math.log(plain)) - self._level
        for b in plain_batches:
            at = band(float(b), self.BATCH_BANDS)
            self._plain_seen[at] = max(self._plain_seen[at], float(repeats))

    def plain_seen(self, batch: int) -> float:
        """The decoding plain steps of ``batch``'s request band seen lately
        (each forgotten as a shape's residual is)."""
        return float(self._plain_seen[band(float(batch), self.BATCH_BANDS)])

    def observe(self, tokens: float, batch: int, profiled: float, measured: float,
                plain: bool = False) -> bool:
        """Fold in one step (``plain``: K_step = 0); returns whether it was kept
        (garbage timings are not)."""
        if not (profiled > 0 and math.isfinite(measured) and measured > 0):
            return False
        at = self._at(tokens, batch)
        self._log *= self.keep
        self._weight *= self.keep
        self._plain *= self.keep
        self._plain_seen *= self.keep
        seen = math.log(measured / profiled)
        # The shape's own price moves one step whatever the level does.
        total = self._toward(self._log_ratio(tokens, batch, plain), seen)
        if plain and tokens <= batch:
            # A plain decoding shape keeps its own price: drafting steps,
            # which move the level, never move it.  The offset is the
            # decoding plain steps' running median over the level, the
            # prior of plain shapes not measured lately.
            self._own[at], self._weight[at] = total, 1.0
            self._plain = self._toward(self._plain, seen - self._level)
            self._plain_seen[at[0]] += 1.0
            self._level *= self.keep
        elif plain:
            # A step with a prefill chunk (more tokens than requests)
            # corrects its own shape only: a chunk's error is not a
            # decoding step's.
            self._level *= self.keep
            self._log[at] = total - self._level - self._plain
        else:
            self._level = self._toward(self._level * self.keep, seen)
            self._log[at] = total - self._level
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
