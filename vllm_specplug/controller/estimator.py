"""Per-request, per-position acceptance estimates with forgetting.

A step that drafted ``k`` tokens for a request and saw ``a`` of them accepted
tells us: positions ``1..a`` succeeded, position ``a+1`` failed (when
``a < k``), and positions after that were never tested (censored).  We keep,
for every request and every draft position, exponentially forgotten counts of
successes and trials of the *conditional* acceptance probability
``alpha_p = P(position p accepted | position p-1 accepted)``.

Sparse per-request data is shrunk toward a global per-position profile (the
same counts pooled over every request), which is itself shrunk toward a
configured prior.  The survival probability of slot ``j`` (the chance that
drafts ``1..j`` are all accepted) is the running product of ``alpha``; the
expected number of accepted tokens when a request gets ``j`` slots is the sum
of its first ``j`` survival probabilities.

State lives in preallocated NumPy arrays indexed by a row per request, so a
decision for a whole batch is a handful of vectorised operations.
"""

from __future__ import annotations

import numpy as np


class AcceptanceEstimator:
    def __init__(
        self,
        max_positions: int,
        forgetting: float = 0.85,
        global_forgetting: float = 0.99,
        prior_strength: float = 2.0,
        initial_acceptance: float = 0.6,
        initial_capacity: int = 64,
    ) -> None:
        if max_positions < 1:
            raise ValueError("max_positions must be >= 1")
        self.max_positions = max_positions
        self.forgetting = forgetting
        self.global_forgetting = global_forgetting
        self.prior_strength = prior_strength
        self.initial_acceptance = initial_acceptance
        # Pseudo-trials that anchor the global profile to the prior; small so
        # a few dozen observations replace it.
        self._global_prior_trials = 4.0

        self._succ = np.zeros((initial_capacity, max_positions))
        self._trials = np.zeros((initial_capacity, max_positions))
        self._global_succ = np.zeros(max_positions)
        self._global_trials = np.zeros(max_positions)
        self._rows: dict[str, int] = {}
        self._free_rows: list[int] = list(range(initial_capacity - 1, -1, -1))
        self._positions = np.arange(max_positions)

    # -- request lifecycle -------------------------------------------------
    def add(self, req_id: str) -> int:
        row = self._rows.get(req_id)
        if row is not None:
            return row
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self._succ[row] = 0.0
        self._trials[row] = 0.0
        self._rows[req_id] = row
        return row

    def remove(self, req_id: str) -> None:
        row = self._rows.pop(req_id, None)
        if row is not None:
            self._free_rows.append(row)

    def row(self, req_id: str) -> int:
        return self._rows[req_id]

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def _grow(self) -> None:
        old = self._succ.shape[0]
        new = old * 2
        self._succ = np.concatenate([self._succ, np.zeros_like(self._succ)])
        self._trials = np.concatenate([self._trials, np.zeros_like(self._trials)])
        self._free_rows.extend(range(new - 1, old - 1, -1))

    # -- learning ----------------------------------------------------------
    def observe(self, req_id: str, drafted: int, accepted: int) -> None:
        """Record one verification: ``drafted`` offered, ``accepted`` kept."""
        if drafted <= 0:
            return
        drafted = min(drafted, self.max_positions)
        accepted = max(0, min(accepted, drafted))
        row = self._rows.get(req_id)
        if row is None:
            row = self.add(req_id)
        successes = self._positions < accepted
        # Position ``accepted`` (0-based) is the first rejection, if any.
        tested = self._positions < min(accepted + 1, drafted)
        self._succ[row] *= self.forgetting
        self._trials[row] *= self.forgetting
        self._succ[row] += successes
        self._trials[row] += tested
        self._global_succ *= self.global_forgetting
        self._global_trials *= self.global_forgetting
        self._global_succ += successes
        self._global_trials += tested

    # -- estimates ---------------------------------------------------------
    def global_profile(self) -> np.ndarray:
        """Conditional acceptance per position pooled over all requests.

        A position with few trials borrows from the position before it
        (acceptance is strongly correlated along a draft), the first from
        the configured prior.
        """
        m = self._global_prior_trials
        g = np.empty(self.max_positions)
        prior = self.initial_acceptance
        for p in range(self.max_positions):
            prior = (self._global_succ[p] + m * prior) / (self._global_trials[p] + m)
            g[p] = prior
        return g

    def conditional(self, rows: np.ndarray) -> np.ndarray:
        """``alpha[r, p]`` for the given rows, shrunk toward a prior.

        The prior of position 1 is the global profile; the prior of position
        p > 1 is the mean of the global profile and the request's own
        estimate at p - 1.  Without that a request that always accepts
        everything it is offered (censored at the end) would never be
        trusted with a longer draft than the global profile allows.
        """
        m = self.prior_strength
        g = self.global_profile()
        succ = self._succ[rows]
        trials = self._trials[rows]
        alpha = np.empty_like(succ)
        prior = np.full(succ.shape[0], g[0])
        for p in range(self.max_positions):
            alpha[:, p] = (succ[:, p] + m * prior) / (trials[:, p] + m)
            if p + 1 < self.max_positions:
                prior = 0.5 * (g[p + 1] + alpha[:, p])
        return alpha

    def survival(self, rows: np.ndarray) -> np.ndarray:
        """``S[r, j]``: probability that drafts ``1..j+1`` are all accepted."""
        return np.cumprod(self.conditional(rows), axis=1)

    def expected_accepted(self, req_id: str, slots: int) -> float:
        if slots <= 0:
            return 0.0
        s = self.survival(np.array([self._rows[req_id]]))[0]
        return float(s[:slots].sum())
