"""Per-request, per-position acceptance estimates with forgetting.

A step that drafted ``k`` tokens for a request and saw ``a`` of them accepted
tells us: positions ``1..a`` succeeded, position ``a+1`` failed (when
``a < k``), and positions after that were never tested (censored).  We keep,
for every request and every draft position, exponentially forgotten counts of
successes and trials of the *conditional* acceptance probability
``alpha_p = P(position p accepted | position p-1 accepted)``.

Sparse per-request data is shrunk toward a global per-position profile (the
same counts pooled over the last few requests, see ``POOL_FORGETTING``),
which is itself shrunk toward a configured prior.  How strongly a request
is shrunk is estimated from how much the live requests differ beyond
sampling noise
(``_update_prior_strength``).  The survival probability of slot ``j`` (the
chance that drafts ``1..j`` are all accepted) is the running product of
``alpha``; the expected number of accepted tokens when a request gets ``j``
slots is the sum of its first ``j`` survival probabilities.

State lives in preallocated NumPy arrays indexed by a row per request.  The
survival table is kept up to date as observations arrive (only the rows just
observed are recomputed, plus every live row when the global profile has
moved), so a decision for a whole batch reads it with one gather.
"""

from __future__ import annotations

import numpy as np

from vllm_specplug.controller.estimator_kernels import _conditional, _count, _survival
from vllm_specplug.controller.settings import FORGETTING, INITIAL_ACCEPTANCE, PRIOR_STRENGTH


class AcceptanceEstimator:
    def __init__(
        self,
        max_positions: int,
        forgetting: float = FORGETTING,
        prior_strength: float = PRIOR_STRENGTH,
        initial_acceptance: float = INITIAL_ACCEPTANCE,
        initial_capacity: int = 64,
    ) -> None:
        if max_positions < 1:
            raise ValueError("max_positions must be >= 1")
        self.max_positions = max_positions
        self.forgetting = forgetting
        self.prior_strength = prior_strength
        self.initial_acceptance = initial_acceptance
        self._global_prior_trials = self.POOL_ANCHOR

        # Forgotten successes and trials, per row and position, in one table
        # (_succ and _trials are views of it) so a step's update is one
        # gather and one scatter.
        self._counts = np.zeros((initial_capacity, 2, max_positions))
        self._succ, self._trials = self._counts[:, 0], self._counts[:, 1]
        self._surv = np.zeros((initial_capacity, max_positions))
        # Pooled over the last few requests (POOL_FORGETTING): successes, trials.
        self._global = np.zeros((2, max_positions))
        self._opened = np.zeros(initial_capacity, dtype=bool)  # first verification seen
        # req_id -> row of every per-request array; others may read it.
        self.row_of: dict[str, int] = {}
        self._free_rows: list[int] = list(range(initial_capacity - 1, -1, -1))
        self._profile: np.ndarray | None = None
        # Weight of the global profile in each position's prior (see conditional).
        self.base_prior_strength = prior_strength
        self._set_prior_strength(prior_strength)
        self._observed_steps = 0
        # Global profile the cached survival rows were computed with.
        self._surv_profile = self.global_profile()

    # Pseudo-trials that anchor the pool to ``initial_acceptance``; small so a
    # few dozen observations replace it.
    # Source: constants_sweep.py at 59dd374: 1 and 16 within the noise.
    POOL_ANCHOR = 4.0
    # The share of a deeper position's prior taken from the request's own
    # estimate at the position before (the rest from the pool): without it a
    # request that accepts all it is offered (censored at the end) would be
    # held to the pool's depth (see conditional).
    # Source: constants_sweep.py at d7f86db: 0 (pool only) -0.010 to -0.025 on the
    # switch and mixed cells at one request; 0.25 and 0.75 within the noise.
    OWN_PREVIOUS_SHARE = 0.5

    def _set_prior_strength(self, strength: float) -> None:
        self.prior_strength = strength
        self._prior_share = np.full(self.max_positions,
                                    (1.0 - self.OWN_PREVIOUS_SHARE) * strength)
        self._prior_share[0] = strength

    # -- request lifecycle -------------------------------------------------
    def add(self, req_id: str) -> int:
        row = self.row_of.get(req_id)
        if row is not None:
            return row
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self._counts[row] = 0.0
        self._opened[row] = False
        self.row_of[req_id] = row
        self._refresh_survival(np.array([row], dtype=np.intp))
        return row

    def reset(self, req_ids) -> None:
        """Forget what was observed of these requests (unknown ids are skipped)."""
        rows = [self.row_of[r] for r in req_ids if r in self.row_of]
        if rows:
            rows = np.array(rows, dtype=np.intp)
            self._counts[rows] = 0.0
            self._refresh_survival(rows)

    # The pool's counts are scaled by this each time a request that drafted
    # finishes, so the pool is what the last few requests saw, whatever
    # their length and however many run at once.  A pool forgotten per
    # observation covers a fixed number of verifications instead (a few
    # short requests at one request, part of a long one, a step or two at
    # 64), so after a change of workload new requests would start from the
    # old workload's acceptance for several requests.  Replayed over the
    # recorded served traces (benchmarks/estimator_replay.py) this predicts
    # the verified outcomes better than forgetting per observation, and
    # halves the overestimate in the first steps of the requests that
    # follow a change of workload.
    # Source: daf5895, estimator_replay.py on 9 Qwen traces: 0.5-0.8 alike, 0.6 best.
    POOL_FORGETTING = 0.6

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self._free_rows.append(row)
            if self._trials[row, 0] > 0:
                self._global *= self.POOL_FORGETTING
                self._profile = None

    def _live_rows(self) -> np.ndarray:
        """Every live request's row."""
        return np.fromiter(self.row_of.values(), dtype=np.intp, count=len(self.row_of))

    def row(self, req_id: str) -> int:
        return self.row_of[req_id]

    @property
    def capacity(self) -> int:
        """Rows allocated; every row index handed out is below this."""
        return self._counts.shape[0]

    def __len__(self) -> int:
        return len(self.row_of)

    def _grow(self) -> None:
        old = self._counts.shape[0]
        new = old * 2
        self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
        self._succ, self._trials = self._counts[:, 0], self._counts[:, 1]
        self._surv = np.concatenate([self._surv, np.zeros_like(self._surv)])
        self._opened = np.concatenate([self._opened, np.zeros(old, dtype=bool)])
        self._free_rows.extend(range(new - 1, old - 1, -1))

    # A request's estimate is refreshed whenever it is observed; the others
    # follow the global profile once it has moved by this much (absolute
    # acceptance, any position).  Staleness below it changes no decision.
    # Source: constants_sweep.py at 59dd374: 0 and 0.05 moved no cell by 0.01.
    PROFILE_TOLERANCE = 0.01

    # -- learning ----------------------------------------------------------
    def observe(self, req_id: str, drafted: int, accepted: int) -> None:
        """Record one verification: ``drafted`` offered, ``accepted`` kept."""
        if drafted <= 0:
            return
        row = self.row_of.get(req_id)
        if row is None:
            row = self.add(req_id)
        self.observe_rows(np.array([row]), np.array([drafted]), np.array([accepted]))

    def observe_rows(self, rows: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """Record one step's verifications for many rows at once.

        ``rows`` must be distinct (one verification per request per step).
        Rows that drafted nothing are left untouched: no trial, no forgetting.
        A request's first verification, the drafts that open its response, is
        not counted: in the recorded served traces it accepted 0.62 on code
        against 0.95 after it, 0.90 on chat against 0.79 (benchmarks/README.md).
        """
        rows = _count(self._counts, self._global, self._opened, rows, drafted, accepted,
                      self.forgetting)
        if rows.size == 0:
            return
        self._profile = None
        profile = self.global_profile()
        self._observed_steps += 1
        restrung = (self._observed_steps % self.POOL_EVERY == 0
                    and self._update_prior_strength())
        # (Compared as lists: eight positions, cheaper than array calls.)
        moved = max(abs(a - b) for a, b in zip(self._profile_list, self._surv_profile.tolist()))
        if moved > self.PROFILE_TOLERANCE or restrung:
            # The pooled profile every request shrinks toward, or the pull
            # toward it, has moved: refresh every live row, not only the
            # ones just observed.
            self._surv_profile = profile
            rows = self._live_rows()
        self._refresh_survival(rows)

    # How strongly a request's estimate is pulled toward the pooled profile
    # is re-estimated every POOL_EVERY observed steps from how alike the
    # live requests are (empirical Bayes), between the configured strength
    # and POOL_MAX_STRENGTH, once POOL_MIN_ROWS requests have drafted.
    # Source: 5feab62 (the mechanism: simulator 0.982 -> 0.992 of the best fixed);
    # constants_sweep.py at 59dd374: every 1 or 32 steps, 4 or 16 rows decide alike.
    POOL_EVERY = 8
    POOL_MIN_ROWS = 8
    POOL_MAX_STRENGTH = 16.0
    # The pull while fewer than POOL_MIN_ROWS requests can be compared (see
    # _update_prior_strength).
    # Source: c222268 (test_sim.py c=1 cells, 6 seeds: 0.988 -> 0.994).
    POOL_FEW_STRENGTH = 4.0
    # A change of the pull under this share of it is ignored (it would
    # refresh every live row for a negligible change).
    # Source: constants_sweep.py at d7f86db: 0 and 0.3 within the noise.
    PULL_CHANGE = 0.1

    def _update_prior_strength(self) -> bool:
        """Set the prior strength from the live requests' spread; True when it changed.

        With a few forgotten observations each, requests whose drafts are
        equally good look different by chance (10 observations of a 0.8
        acceptance spread +-0.13), and a policy that hands out slots by the
        estimates then favours the lucky ones: the longest draft sets
        K_step, so the whole batch pays draft passes for a few requests,
        and the favoured estimates are too high.  How far apart the
        requests really are is the spread of their position-1 acceptance
        beyond what sampling explains; a beta prior with that variance has
        ``v / tau2 - 1`` pseudo-trials.  Alike requests (easy or hard
        traffic) get a strong pull toward the pool; a batch of easy and
        hard requests keeps the weak configured one; fewer than
        ``POOL_MIN_ROWS`` requests, which cannot be compared, a middle one.
        """
        rows = self._live_rows()
        t = self._trials[rows, 0]
        have = t >= 1.0
        strength = self.base_prior_strength
        cap = max(self.POOL_MAX_STRENGTH, strength)  # never below the configured pull
        if np.count_nonzero(have) < self.POOL_MIN_ROWS:
            # Too few requests to tell how much they differ.  The pool is
            # then mostly the same few requests' longer history (the last
            # few requests, a request's own estimate ~7 verifications), and
            # the configured weak pull left a lone request's deeper
            # positions to a handful of censored trials: on the simulated
            # 8B + EAGLE at one request on hard text it took K=1 in 27% of
            # steps where K=2 pays (0.968 of the best static K; 0.983 with
            # this pull, and every c=1 cell of tests/test_sim.py 0.988 ->
            # 0.994 on average, drift and switch included).
            strength = max(strength, self.POOL_FEW_STRENGTH)
        else:
            t, succ = t[have], self._succ[rows[have], 0]
            total = float(t.sum())
            g = float(succ.sum()) / total
            v = g * (1.0 - g)
            # Sampling variance of a forgotten mean: v * sum(w^2) / sum(w)^2;
            # a row's weights are f^0..f^(n-1), so sum(w^2) follows from t.
            f = self.forgetting
            if f < 1.0:
                r = np.clip(1.0 - t * (1.0 - f), 0.0, 1.0)
                w2 = (1.0 - r * r) / (1.0 - f * f)
            else:
                w2 = t
            spread = float(((succ - g * t) ** 2 / t).sum())  # sum t (p_r - g)^2
            tau2 = (spread - v * float((w2 / t).sum())) / total
            if v <= 1e-9 or tau2 <= v / (cap + 1.0):
                strength = cap
            else:
                strength = min(max(v / tau2 - 1.0, strength), cap)
        if abs(strength - self.prior_strength) <= self.PULL_CHANGE * self.prior_strength:
            return False
        self._set_prior_strength(strength)
        return True

    # -- estimates ---------------------------------------------------------
    def global_profile(self) -> np.ndarray:
        """Conditional acceptance per position pooled over all requests.

        A position with few trials borrows from the position before it
        (acceptance is strongly correlated along a draft), the first from
        the configured prior.  Cached until the next observation.
        """
        if self._profile is not None:
            return self._profile
        m = self._global_prior_trials
        succ, trials = self._global.tolist()
        g = []
        prior = self.initial_acceptance
        for p in range(self.max_positions):
            prior = (succ[p] + m * prior) / (trials[p] + m)
            g.append(prior)
        self._profile_list = g
        self._profile = np.array(g)
        return self._profile

    def conditional(self, rows: np.ndarray) -> np.ndarray:
        """``alpha[r, p]`` for the given rows, shrunk toward a prior.

        The prior of position 1 is the global profile; the prior of position
        p > 1 weighs the global profile and the request's own estimate at
        p - 1 (``OWN_PREVIOUS_SHARE``, half each).  Without that a request that always accepts
        everything it is offered (censored at the end) would never be
        trusted with a longer draft than the global profile allows.
        """
        # alpha_p = (s_p + m * prior_p) / (t_p + m) with
        # prior_p = (1 - w) g_p + w alpha_{p-1} is the linear recurrence
        # alpha_p = a_p + b_p * alpha_{p-1}, solved in closed form:
        # alpha_p = B_p * sum_{j<=p} a_j / B_j with B_p = b_1 * ... * b_p.
        # All terms are positive, so there is no cancellation; only an
        # underflowing B (no forgetting, very long histories) needs the loop.
        return self._compute_conditional(rows, self.global_profile())

    def _compute_conditional(self, rows: np.ndarray, g: np.ndarray) -> np.ndarray:
        return _conditional(self._counts, rows, self._prior_share, g, self.prior_strength)

    # Subtracted per row (times the row index) from the cached survival so
    # that no two requests hold exactly equal values: a policy that cuts the
    # table at a threshold then selects exactly the slots it counted.
    # Not tuned: correctness (test_decision_equivalence.py, test_policy.py).
    TIE_BREAK = 1e-12

    def _refresh_survival(self, rows: np.ndarray) -> None:
        """Recompute the cached survival table for ``rows`` (after new data or a new profile)."""
        _survival(self._counts, rows, self._prior_share, self._surv_profile,
                  self.prior_strength, self.TIE_BREAK, self._surv)

    def survival(self, rows: np.ndarray) -> np.ndarray:
        """``S[r, j]``: probability that drafts ``1..j+1`` are all accepted."""
        return self._surv[rows]

