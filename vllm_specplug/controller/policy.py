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

    def decide(
        self,
        survival: np.ndarray,
        ceilings: np.ndarray,
        base_tokens: float,
        cost: StepCostModel,
        fixed_k_step: int | None = None,
    ) -> Decision:
        batch, width = survival.shape
        mask = np.arange(width)[None, :] < ceilings[:, None]
        s = np.where(mask, survival, 0.0).ravel()
        order = np.argsort(-s, kind="stable")
        s_sorted = s[order]
        n_valid = int(np.count_nonzero(s_sorted > 0.0))
        order = order[:n_valid]
        s_sorted = s_sorted[:n_valid]
        positions = order % width + 1
        if fixed_k_step is None:
            k_steps = np.concatenate(([0], np.maximum.accumulate(positions)))
        else:
            k_steps = np.full(n_valid + 1, fixed_k_step)
        n = np.arange(n_valid + 1)
        tokens = batch + np.concatenate(([0.0], np.cumsum(s_sorted)))
        seconds = cost.predict_many(batch, base_tokens + n, k_steps, self.optimism)
        seconds = np.maximum(seconds, 1e-9)
        goodput = tokens / seconds
        best = int(np.argmax(goodput))
        if best > 0 and goodput[best] < goodput[0] * (1.0 + self.min_gain):
            best = 0
        k = np.bincount(order[:best] // width, minlength=batch)
        k_step = int(k_steps[best]) if fixed_k_step is None else fixed_k_step
        return Decision(
            k_step=k_step,
            k=k,
            predicted_seconds=float(seconds[best]),
            predicted_tokens=float(tokens[best]),
            plain_seconds=float(seconds[0]),
            plain_tokens=float(tokens[0]),
        )


class StaticPolicy:
    name = "static"

    def __init__(self, k: int) -> None:
        self.k = k

    def decide(self, ceilings: np.ndarray, fixed_k_step: int | None = None) -> Decision:
        k = np.minimum(ceilings, self.k)
        k_step = fixed_k_step if fixed_k_step is not None else self.k
        return Decision(k_step=int(k_step), k=k)


class HeuristicPolicy:
    """Per request: +2 after a fully accepted draft, -1 (not below 1) otherwise."""

    name = "heuristic"

    def __init__(self, initial_k: int, max_k: int) -> None:
        self.initial_k = initial_k
        self.max_k = max_k
        self._k: dict[str, int] = {}

    def observe(self, req_id: str, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        k = self._k.get(req_id, self.initial_k)
        k = k + 2 if accepted >= drafted else k - 1
        self._k[req_id] = min(max(k, 1), self.max_k)

    def remove(self, req_id: str) -> None:
        self._k.pop(req_id, None)

    def decide(
        self, req_ids: list[str], ceilings: np.ndarray, fixed_k_step: int | None = None
    ) -> Decision:
        k = np.array([self._k.get(r, self.initial_k) for r in req_ids], dtype=np.int64)
        k = np.minimum(k, ceilings)
        k_step = fixed_k_step if fixed_k_step is not None else int(k.max(initial=0))
        return Decision(k_step=k_step, k=k)
