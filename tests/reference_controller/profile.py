"""The reference's step-cost profile: the package's ``StepProfile`` and
``prior_profile`` (the decision-cost rewrite did not change them), and
``ProfileCorrection`` as it was before the rewrite: the package's, whose
learning (``observe``, ``ratio``, the plain steps' offset) the rewrite did
not change, with the pure-Python banding and the NumPy ``ratios_from`` the
rewrite replaced by ``profile.band`` and ``_band_ratios``.
"""

from __future__ import annotations

import math

import numpy as np

from vllm_specplug.controller.correction import ProfileCorrection as _Correction
from vllm_specplug.controller.profile import StepProfile, prior_profile  # noqa: F401


class ProfileCorrection(_Correction):
    """The package's correction, banded and read as before the rewrite."""

    @staticmethod
    def _band(n: float, bands: int) -> int:
        return min(max(int(math.log2(max(n, 1.0))), 0), bands - 1)

    def _at(self, tokens: float, batch: int) -> tuple[int, int]:
        return self._band(batch, self.BATCH_BANDS), self._band(tokens, self.BANDS)

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
