"""The live correction of the step-cost profile's prices.

``ProfileCorrection`` is the only price learnt from live steps: per band of
step size, the median ratio of measured to profiled time, tracked with a
fixed step in log space and clipped to [0.5, 2].  Drafting steps share a
level per count of draft passes, times an offset per band of requests
(none at one request); a plain decoding shape measured lately keeps its own
price, which drafting steps never move.  A few slow first steps move a price a few
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
def _band_ratios(chunk, offset, rows, js, batch, level, own, weight, low, high, start, count):
    """``ProfileCorrection.ratio`` at ``start``, ``start + 1``, ... tokens (token
    bands by ``band``), one row per K_step ``js[j]``: up to ``batch * (1 +
    js[j])`` tokens that pass row's level (its ``own`` weighed against
    ``level`` by ``weight``), past it ``level`` plus ``chunk`` (a step with a
    prefill chunk, by token band); either plus the batch's ``offset``."""
    out = np.empty((rows.size, count))
    bands = chunk.shape[0]
    for j in range(rows.size):
        limit = batch * (1 + js[j])
        end, t, i = start + count, start, 0
        while t < end:
            b = band(t, bands)
            stop = end if b == bands - 1 else min(end, 1 << (b + 1))
            r = rows[j] if t <= limit else 0
            lv = level + chunk[b]
            if r:
                stop = min(stop, limit + 1)
                lv = level + weight[r] * (own[r] - level)
            v = math.exp(min(max(lv + offset, low), high))
            while t < stop:
                out[j, i] = v
                i += 1
                t += 1
    return out


class ProfileCorrection:
    """Per step shape, a median ratio of measured to profiled step time.

    A shape is the power-of-two band of the step's tokens, that of its
    requests and that of its draft passes (K_step): one request verifying
    four drafts and five requests decoding plainly both run five tokens,
    but not the same draft passes nor attention over the same contexts; and
    eight requests verifying one draft each (16 tokens, one pass) and
    verifying two (24 tokens, two passes) share a token band but not the
    error of the draft's price (served Qwen pair at eight requests: K = 2
    steps ran 1.02x the profile, K = 1 steps 1.15x; keyed by tokens alone,
    the K = 1 plans read the K = 2 steps' ratio).  A drafting shape's ratio is
    the level of its draft passes times the offset of its band of requests,
    so a shape the policy has not run is priced at its passes' level, as the
    shapes it runs are, and plans in different shapes compare at one price.
    The offset (none at one request) is what the band's drafting steps
    measured over that level, learnt by the same step rule and kept: priced
    at the level that the steps of other batch sizes and pass counts had
    set, each eight-request drafting episode's first ten steps ran 13% over
    their price (served Qwen pair, one server for every arm, A/B at
    f8c9bab; 5% with the offset, replayed).  It is
    learnt at the share that one request's drafting steps ran lately: steps
    of one band alone cannot tell the host's error from the band's, and
    leave it all to the level, which plain priors follow.  The
    passes' level is their own running ratio where steps with those passes
    ran lately, weighed against the level common to all drafting steps (a
    host faster than when the profile was cached, contexts longer than the
    profile's) as they were run lately, as a plain shape's price is against
    its prior: steps of two pass counts that run at different errors, one
    wave after the other (a fixed k = 2 arm between the adaptive arm's K = 1
    waves), each keep their price instead of swinging the one level.  A plain
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
    steps.  Ratios stay in [``low``, ``high``]; prefill chunks' residuals
    are forgotten toward the level, plain shapes' and pass counts' weights
    toward their prior, the level and the plain offset toward 1 (``forget``
    per observed step): the profile remains the source of the price.  Per
    request band it also counts the decoding plain steps it has seen,
    forgotten at the same rate (``plain_seen``): a band whose plain price
    nothing has measured lately is priced from the prior only
    (``SpecController`` probes it).
    """

    # Power-of-two bands of a step's tokens and of its requests.
    # Source: dd2c4cc (the request bands: served ShareGPT c=4 drafting steps
    # measured/predicted 1.00-1.04, 1.07-1.18 keyed by tokens alone).
    BANDS = 24
    BATCH_BANDS = 12
    # Draft passes of decoding steps: K_step 1, 2-3, 4-7, 8 and more (rows 1-4);
    # row 0 the steps with a prefill chunk, plain or drafting, whose error is
    # the chunk's.  Source: the A/B grid at e20e290 (the K = 1
    # and K = 2 steps' ratios above).
    PASS_ROWS = 5
    # At most this much (in log) a step; ratios clipped to [LOW, HIGH];
    # chunks' residuals, plain shapes' weights, level and plain offset
    # forgotten by FORGET a step (the request bands' offsets are kept).
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
        self._level = 0.0  # common to all drafting steps
        self._plain = 0.0  # the plain steps' offset
        # Each draft-pass row's level and how far it was run lately, against
        # the common level (row 0, the steps with a prefill chunk, reads the
        # common level; its plain ones times the plain offset).
        self._rows = np.zeros(self.PASS_ROWS)
        self._row_weight = np.zeros(self.PASS_ROWS)
        # Drafting steps' offset by request band over their rows' levels
        # (band 0, one request, stays 0); steps with a prefill chunk: their
        # residual over the level by request band and token band.
        self._offset = np.zeros(self.BATCH_BANDS)
        self._chunk = np.zeros((self.BATCH_BANDS, self.BANDS))
        # How far one request's drafting steps were run lately (1: the last
        # drafting step was one), the share of a step the offsets learn.
        self._single = 0.0
        self._by_width: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # _pass_rows
        # Plain decoding shapes: their own log ratio, and how far it was
        # measured lately (1: the last step was it), against the prior.
        self._own = np.zeros((self.BATCH_BANDS, self.BANDS))
        self._weight = np.zeros((self.BATCH_BANDS, self.BANDS))
        self._plain_seen = np.zeros(self.BATCH_BANDS)
        self.observations = 0

    def _at(self, tokens: float, batch: int) -> tuple[int, int]:
        return band(float(batch), self.BATCH_BANDS), band(float(tokens), self.BANDS)

    def pass_row(self, tokens: float, batch: int, k_step: int) -> int:
        """The residuals' row of a step: 0 with a prefill chunk (more tokens
        than its requests and ``k_step`` drafts each), else by its passes."""
        if k_step <= 0 or tokens > batch * (1 + k_step):
            return 0
        return 1 + band(float(k_step), self.PASS_ROWS - 1)

    def _row_level(self, row: int) -> float:
        """A pass row's level (log): its own weighed against the common one
        (row 0: the common one; ``_band_ratios`` reads it the same way)."""
        if row == 0:
            return self._level
        return self._level + self._row_weight[row] * (self._rows[row] - self._level)

    def _pass_rows(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """K_step 0..``width`` (0 read as 1) and each one's pass row as a
        decoding step, cached per width (a decision asks every step)."""
        cached = self._by_width.get(width)
        if cached is None:
            js = np.maximum(np.arange(width + 1), 1)
            rows = np.array([self.pass_row(1, 1, j) for j in js], dtype=np.int64)
            cached = self._by_width[width] = (js, rows)
        return cached

    def _log_ratio(self, tokens: float, batch: int, k_step: int) -> float:
        at = self._at(tokens, batch)
        if k_step <= 0 and tokens <= batch:
            prior = self._level + self._plain
            return prior + self._weight[at] * (self._own[at] - prior)
        row = self.pass_row(tokens, batch, k_step)
        if k_step <= 0:
            return self._level + self._plain + self._chunk[at]
        return self._row_level(row) + self._offset[at[0]] + (0.0 if row else self._chunk[at])

    def ratio(self, tokens: float, batch: int, k_step: int = 1) -> float:
        """The ratio of a step's shape (``k_step`` 0: a plain step)."""
        return math.exp(min(max(self._log_ratio(tokens, batch, k_step), self.low), self.high))

    def ratios_from(self, start: int, count: int, batch: int, width: int) -> np.ndarray:
        """Ratios of drafting steps of ``batch`` requests and ``start``, ``start +
        1``, ... ``start + count - 1`` tokens: row j for K_step j, 1..``width``
        (row 0 is row 1's), each as ``ratio`` reads it."""
        js, rows = self._pass_rows(width)
        at = band(float(batch), self.BATCH_BANDS)
        return _band_ratios(self._chunk[at], self._offset[at], rows, js, int(batch), self._level,
                            self._rows, self._row_weight, self.low, self.high, int(start),
                            int(count))

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
                k_step: int = 1) -> bool:
        """Fold in one step of ``k_step`` draft passes (0: a plain step); returns
        whether it was kept (garbage timings are not)."""
        if not (profiled > 0 and math.isfinite(measured) and measured > 0):
            return False
        at = self._at(tokens, batch)
        plain = k_step <= 0
        self._chunk *= self.keep
        self._single *= self.keep
        self._weight *= self.keep
        self._row_weight *= self.keep
        self._plain *= self.keep
        self._plain_seen *= self.keep
        seen = math.log(measured / profiled)
        row = 0 if plain else self.pass_row(tokens, batch, k_step)
        # A plain or prefill chunk shape's own price moves one step whatever
        # the level does (a decoding drafting step's is its row's and band's).
        total = 0.0 if row else self._toward(self._log_ratio(tokens, batch, k_step), seen)
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
            self._chunk[at] = total - self._level - self._plain
        else:
            # The common level and the passes' own move toward the step's
            # error less its request band's offset; the offset toward what
            # is left over the passes' level, at the share one request's
            # steps (whose band has none) ran lately.  A prefill chunk's
            # drafting step: its shape's residual is what is left of its
            # error over the level and the offset.
            offset = self._offset[at[0]]
            if row:
                self._rows[row] = self._toward(self._row_level(row), seen - offset)
                self._row_weight[row] = 1.0
            self._level = self._toward(self._level * self.keep, seen - offset)
            if not row:
                self._chunk[at] = total - self._level - offset
            elif at[0]:
                step = self.step * self._single
                self._offset[at[0]] = offset + min(max(
                    seen - self._row_level(row) - offset, -step), step)
            else:
                self._single = 1.0
        self.observations += 1
        return True

    def _toward(self, cur: float, seen: float) -> float:
        cur += min(max(seen - cur, -self.step), self.step)  # met, not circled
        return min(max(cur, self.low), self.high)

    def learnt(self) -> dict[str, float]:
        """The level (``"common"``), the plain steps' offset (``"plain"``), each pass
        row's level run lately (``"k<K_step>"``, its first K_step), the request
        bands' offsets drafting steps learnt (``"x<batch>"``, the band's first
        value) and the prefill chunk shapes steps have moved (``"<tokens>x<batch>k0"``)
        -> ratio."""
        first = lambda p: 0 if p == 0 else 1 << (int(p) - 1)  # noqa: E731
        clip = lambda x: round(math.exp(min(max(x, self.low), self.high)), 3)  # noqa: E731
        rows, cols = np.nonzero(self._chunk)
        return ({"common": clip(self._level), "plain": clip(self._plain)}
                | {f"k{first(p)}": clip(self._row_level(p))
                   for p in np.nonzero(self._row_weight)[0]}
                | {f"x{1 << int(r)}": clip(self._offset[r]) for r in np.nonzero(self._offset)[0]}
                | {f"{1 << int(c)}x{1 << int(r)}k0": clip(self._level + self._chunk[r, c])
                   for r, c in zip(rows, cols)})
