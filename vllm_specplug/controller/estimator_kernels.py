"""The acceptance estimator's compiled kernels (``estimator.AcceptanceEstimator``):
folding a step's verifications into the forgotten counts, and the conditional
and survival tables read from them."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True)
def _count(counts, pooled, opened, rows, drafted, accepted, forgetting):
    """Fold one step's verifications into the forgotten counts and the pool;
    returns the rows counted (not a request's first verification, nor one
    that drafted nothing)."""
    width = counts.shape[2]
    counted = np.empty(rows.size, dtype=np.int64)
    step = np.zeros((2, width))  # whole counts: summed exactly, added at once
    n = 0
    for i in range(rows.size):
        r = rows[i]
        if drafted[i] <= 0:
            continue
        if not opened[r]:
            opened[r] = True
            continue
        tried = min(drafted[i], width)
        kept = min(max(accepted[i], 0), tried)
        for p in range(width):
            # Successes: positions before the first rejection; trials: those
            # and the first rejection, if any; later ones were never tested.
            success = 1.0 if p < kept else 0.0
            trial = 1.0 if p < min(kept + 1, tried) else 0.0
            counts[r, 0, p] = counts[r, 0, p] * forgetting + success
            counts[r, 1, p] = counts[r, 1, p] * forgetting + trial
            step[0, p] += success
            step[1, p] += trial
        counted[n] = r
        n += 1
    if n:
        pooled += step
    return counted[:n]


@numba.njit(cache=True)
def _conditional(counts, rows, prior_share, g, m):
    """``AcceptanceEstimator.conditional`` of ``rows`` for the pooled profile ``g``:
    position p's prior weighs the pool by ``prior_share[p]`` and the row's own
    estimate at p - 1 by the rest of ``m``."""
    n, width = rows.size, counts.shape[2]
    a, inv, cum_b = np.empty((n, width)), np.empty((n, width)), np.empty((n, width))
    smallest = 1.0
    for i in range(n):
        cum = 1.0
        for p in range(width):
            inv[i, p] = 1.0 / (counts[rows[i], 1, p] + m)
            a[i, p] = (counts[rows[i], 0, p] + prior_share[p] * g[p]) * inv[i, p]
            if p > 0:
                cum *= (m - prior_share[p]) * inv[i, p]
            cum_b[i, p] = cum
        smallest = min(smallest, cum)
    if width == 1:
        return a
    for i in range(n):
        if smallest > 1e-200:
            total = 0.0
            for p in range(width):
                total += a[i, p] / cum_b[i, p]
                a[i, p] = total * cum_b[i, p]
        else:
            for p in range(1, width):
                a[i, p] += (m - prior_share[p]) * inv[i, p] * a[i, p - 1]
    return a


@numba.njit(cache=True)
def _survival(counts, rows, prior_share, g, m, tie_break, surv):
    """``surv[rows]``: the running product of the conditional acceptance, less
    ``tie_break`` times the row."""
    a = _conditional(counts, rows, prior_share, g, m)
    for i in range(rows.size):
        run = 1.0
        for p in range(a.shape[1]):
            run = a[i, p] if p == 0 else run * a[i, p]
            surv[rows[i], p] = run - rows[i] * tie_break
