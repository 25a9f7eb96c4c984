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
    """Admit draft slots in order of survival while they raise goodput.

    Goodput of a plan = (B + sum of survival probabilities of its slots) /
    predicted step time.  Because survival is non-increasing along a
    request's positions, the plans "the n most likely slots" are prefix
    closed per request; we evaluate all of them at once (sort, cumulative
    sums, running max of the position for K_step) and keep the best.  No slot
    paying for itself is exactly the fallback to plain decoding, whether the
    drafts are bad or the batch is compute-bound.
    """

    name = "goodput"

    def __init__(self, min_gain: float = 0.02, optimism: float = 1.0) -> None:
        # Speculation must promise at least this relative gain over plain
        # decoding; keeps noise in the estimates from flapping near 1.0x.
        self.min_gain = min_gain
        # Standard errors of cost optimism for plans the data has not covered.
        self.optimism = optimism
        self._cache: dict = {}

    def decide(
        self,
        survival: np.ndarray,
        ceilings: np.ndarray,
        base_tokens: float,
        cost: StepCostModel,
        fixed_k_step: int | None = None,
        capped: bool | None = None,
    ) -> Decision:
        """Best plan for ``survival`` (rows non-increasing, values distinct).

        ``capped`` says whether any ceiling is below the table's width (the
        caller may know it already; computed when None).
        """
        batch, width = survival.shape
        # Candidate plans are "every slot with survival >= theta" for each
        # value theta in the table: prefix closed per request because
        # survival never rises along a request's positions.  A plan's K_step
        # is the deepest position any request reaches, read off the
        # per-position maximum (itself non-increasing) by binary search.
        # Slots above a request's ceiling get -1 and are cut off with the
        # zeros after sorting (they must not count towards K_step).  A
        # threshold
        # selects exactly the slots counted for it (the estimator keeps
        # survival values distinct across requests).
        s = survival
        if capped is None:
            capped = bool(ceilings.min(initial=width) < width)
        if capped:
            s = np.where(self._positions(width) < ceilings[:, None], s, -1.0)
        ascending = np.sort(s, axis=None)
        values = ascending[np.searchsorted(ascending, 0.0, side="right"):][::-1]
        n = values.size
        tokens = np.empty(n + 1)
        tokens[0] = 0.0
        np.cumsum(values, out=tokens[1:])
        tokens += batch
        if fixed_k_step is None:
            # Positions whose best survival is >= the cut value, counted as
            # width minus the ones below it in the (ascending) reversed maximum.
            k_steps = np.empty(n + 1)
            k_steps[0] = 0
            np.subtract(width, np.searchsorted(s.max(axis=0)[::-1], values), out=k_steps[1:])
        else:
            k_steps = fixed_k_step
        seconds = cost.predict_many(batch, base_tokens + self._counts(n), k_steps,
                                    self.optimism)
        # Optimism is for trying more drafting than the data covers; plain
        # decoding is the baseline and is judged at its point estimate, or a
        # well-measured speculative plan would lose to an untested plain one.
        seconds[0] = cost.predict_many(batch, np.array([float(base_tokens)]), 0.0)[0]
        goodput = tokens / np.maximum(seconds, 1e-9)
        best = int(np.argmax(goodput))
        if best > 0 and goodput[best] < goodput[0] * (1.0 + self.min_gain):
            best = 0
        if best == 0:
            k = np.zeros(batch, dtype=np.int64)
        else:
            k = np.count_nonzero(s >= values[best - 1], axis=1)
            if fixed_k_step is not None:
                k = np.minimum(k, fixed_k_step)
        k_step = int(k_steps[best]) if fixed_k_step is None else fixed_k_step
        return Decision(
            k_step=k_step,
            k=k,
            predicted_seconds=float(seconds[best]),
            predicted_tokens=float(tokens[best]),
            plain_seconds=float(seconds[0]),
            plain_tokens=float(tokens[0]),
        )

    # Shape-keyed constants, built once: the hot path allocates no index arrays.
    def _positions(self, width: int) -> np.ndarray:
        pos = self._cache.get(width)
        if pos is None:
            pos = self._cache[width] = np.arange(width)[None, :]
        return pos

    def _counts(self, n: int) -> np.ndarray:
        counts = self._cache.get(("n", n))
        if counts is None:
            counts = self._cache[("n", n)] = np.arange(n + 1, dtype=float)
        return counts


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
