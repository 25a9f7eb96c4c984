"""Policies: how many draft slots each request gets in the next step.

Every policy answers the same question with the same inputs: for a batch of
``B`` decoding requests with per-request ceilings, return ``k[r]`` (drafts to
verify for request ``r`` next step) and ``K_step`` (how many draft positions
the proposer runs), with ``k[r] <= K_step <= max_k``.

- ``GoodputPolicy`` (the default) maximises predicted accepted tokens per
  second using the acceptance estimator and the step-cost model.
- ``StaticPolicy`` is fixed K, the baseline everyone runs today.
- ``HeuristicPolicy`` is Hugging Face assisted generation's rule: +2 after a
  fully accepted draft, -1 otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_specplug.controller.cost_model import StepCostModel
from vllm_specplug.controller.estimator import AcceptanceEstimator


@dataclass
class Decision:
    k_step: int
    k: np.ndarray  # per request, same order as the batch
    predicted_seconds: float = float("nan")
    predicted_tokens: float = float("nan")
    plain_seconds: float = float("nan")
    plain_tokens: float = float("nan")

    @property
    def predicted_speedup(self) -> float:
        if not (self.predicted_seconds > 0 and self.plain_seconds > 0):
            return float("nan")
        return (self.predicted_tokens / self.predicted_seconds) / (
            self.plain_tokens / self.plain_seconds
        )


class GoodputPolicy:
    """Give draft slots where they raise accepted tokens per second.

    For each K_step j (draft positions the proposer runs, shared by the whole
    batch) the best plan is closed-form: a slot (request r, position p <= j)
    is worth it when its survival probability s[r, p] (the chance that
    drafts 1..p are all accepted) is at least lambda * c_T, where c_T is the
    cost of verifying one token and lambda the value of time in tokens per
    second.  The j with the largest net gain, expected accepted drafts minus
    lambda times the extra step time (verification and j draft passes), is
    the plan; none is plain decoding, whether the drafts are bad or the
    batch is compute-bound.  lambda is found by Dinkelbach's iteration:
    start from plain decoding's rate, take the best plan's rate, repeat; it
    converges to the best achievable rate in a few rounds.

    Rates count decode work only: prefill tokens in the same step cost the
    same time whatever is drafted, so they do not lower the bar for drafts.
    Step times for the final choice of j are lower confidence bounds of the
    cost model (``optimism`` standard errors), so a K_step the data has not
    covered is tried and measured rather than trusted to the prior forever.
    """

    name = "goodput"
    ROUNDS = 2
    # A draft catch-up is paid once and buys speculation for as long as the
    # drafts stay good; a plan is charged this many steps' share of it.  It
    # replaces the draft passes the skipped steps did not run, so over the
    # gap it costs less than vLLM's always-on first pass did.
    CATCHUP_AMORTIZATION_STEPS = 8

    def __init__(self, min_gain: float = 0.02, optimism: float = 1.0) -> None:
        # Speculation must promise at least this relative gain over plain
        # decoding; keeps noise in the estimates from flapping near 1.0x.
        self.min_gain = min_gain
        # Standard errors of cost optimism for plans the data has not covered.
        self.optimism = optimism
        self._cache: dict = {}
        self._catchup_share = 0.0

    def decide(
        self,
        survival: np.ndarray,
        ceilings: np.ndarray,
        base_tokens: float,
        cost: StepCostModel,
        fixed_k_step: int | None = None,
        capped: bool | None = None,
        catchup_tokens: float = 0.0,
    ) -> Decision:
        """Best plan for ``survival`` (rows non-increasing along positions).

        ``base_tokens`` is what the step schedules besides drafts (one per
        decoding request plus prefill chunks).  ``capped`` says whether any
        ceiling is below the table's width (computed when None).
        """
        batch, width = survival.shape
        if capped is None:
            capped = bool(ceilings.min(initial=width) < width)
        s = survival
        if capped:
            s = np.where(self._positions(width) < ceilings[:, None], s, 0.0)
        a0, a_tok, a_pass = cost.linear_terms(batch)
        self._catchup_share = (cost.catchup_seconds(catchup_tokens, batch)
                               / self.CATCHUP_AMORTIZATION_STEPS if catchup_tokens > 0 else 0.0)
        prefill_s = a_tok * max(base_tokens - batch, 0.0)
        t_plain = a0 + a_tok * batch  # a decode-only plain step
        if fixed_k_step is None:
            js = self._positions(width + 1)[0]
        else:
            js = np.array([fixed_k_step])
        lam = batch / t_plain if t_plain > 0 else 0.0
        for _ in range(self.ROUNDS):
            j, tokens, n, seconds = self._best_j(s, js, lam, a0, a_tok, a_pass, batch,
                                                 t_plain, cost, optimistic=False)
            rate = tokens / seconds if seconds > 0 else 0.0
            if rate <= lam * (1.0 + 1e-6):
                break
            lam = rate
        j, tokens, n, seconds = self._best_j(s, js, lam, a0, a_tok, a_pass, batch, t_plain,
                                             cost, optimistic=True)
        plain_rate = batch / t_plain if t_plain > 0 else 0.0
        if (fixed_k_step is None and j > 0 and seconds > 0
                and tokens / seconds < plain_rate * (1.0 + self.min_gain)):
            j, tokens, n, seconds = 0, float(batch), 0, t_plain
        if n == 0 and fixed_k_step is None:
            j = 0
        bar = lam * a_tok
        if n > 0:
            # The same slot rule as _best_j: with a zero verification cost
            # the bar is 0 and only positive survival counts (slots above a
            # ceiling are 0 and must never be granted).
            take = s[:, :j] >= bar if bar > 0 else s[:, :j] > 0
            k = np.count_nonzero(take, axis=1)
        else:
            k = np.zeros(batch, dtype=np.int64)
            if fixed_k_step is None:
                seconds, tokens = t_plain, float(batch)
        return Decision(
            k_step=int(j),
            k=k,
            predicted_seconds=float(seconds + prefill_s),
            predicted_tokens=float(tokens),
            plain_seconds=float(t_plain + prefill_s),
            plain_tokens=float(batch),
        )

    def _best_j(self, s, js, lam, a0, a_tok, a_pass, batch, t_plain, cost, optimistic):
        """(j, expected tokens, slots, decode seconds) of the best plan at ``lam``."""
        bar = lam * a_tok
        take = s >= bar if bar > 0 else s > 0
        # Per position: slots taken and their expected accepted tokens;
        # cumulative over positions gives every K_step's plan at once.
        width = s.shape[1]
        n_cum = np.zeros(width + 1)
        gain_cum = np.zeros(width + 1)
        np.cumsum(np.count_nonzero(take, axis=0), out=n_cum[1:])
        np.cumsum((s * take).sum(axis=0), out=gain_cum[1:])
        n_j, gain_j = n_cum[js], gain_cum[js]
        if optimistic:
            seconds = cost.predict_many(batch, batch + n_j, js.astype(float), self.optimism)
            if js[0] == 0:
                seconds[0] = t_plain  # plain decoding is judged at its point estimate
        else:
            seconds = a0 + a_tok * (batch + n_j) + a_pass * js
        if self._catchup_share > 0:
            seconds = seconds + np.where(js > 0, self._catchup_share, 0.0)
        seconds = np.maximum(seconds, 1e-12)
        net = gain_j - lam * (seconds - t_plain)
        best = int(np.argmax(net))
        return (int(js[best]), float(batch + gain_j[best]), int(n_j[best]),
                float(seconds[best]))

    def _positions(self, width: int) -> np.ndarray:
        pos = self._cache.get(width)
        if pos is None:
            pos = self._cache[width] = np.arange(width)[None, :]
        return pos


class StaticPolicy:
    name = "static"

    def __init__(self, k: int) -> None:
        self.k = k

    def decide(self, ceilings: np.ndarray, fixed_k_step: int | None = None) -> Decision:
        k = np.minimum(ceilings, self.k)
        k_step = fixed_k_step if fixed_k_step is not None else self.k
        return Decision(k_step=int(k_step), k=k)


class HeuristicPolicy:
    """Per request: +2 after a fully accepted draft, -1 (not below 1) otherwise.

    State is one integer per estimator row, so the controller can update and
    read a whole batch with array operations.
    """

    name = "heuristic"

    def __init__(self, initial_k: int, max_k: int, capacity: int = 64) -> None:
        self.initial_k = initial_k
        self.max_k = max_k
        self._k = np.full(capacity, initial_k, dtype=np.int64)

    def ensure_capacity(self, capacity: int) -> None:
        if capacity > self._k.size:
            grown = np.full(capacity, self.initial_k, dtype=np.int64)
            grown[: self._k.size] = self._k
            self._k = grown

    def reset(self, row: int) -> None:
        self._k[row] = self.initial_k

    def observe(self, rows: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        seen = drafted > 0
        rows, drafted, accepted = rows[seen], drafted[seen], accepted[seen]
        k = np.where(accepted >= drafted, self._k[rows] + 2, self._k[rows] - 1)
        self._k[rows] = np.clip(k, 1, max(self.max_k, 1))

    def decide(
        self, rows: np.ndarray, ceilings: np.ndarray, fixed_k_step: int | None = None
    ) -> Decision:
        k = np.minimum(self._k[rows], ceilings)
        k_step = fixed_k_step if fixed_k_step is not None else int(k.max(initial=0))
        return Decision(k_step=k_step, k=k)
