"""The baseline policies the goodput policy is compared with: vLLM's static K
(``StaticPolicy``) and Hugging Face assisted generation's rule (``HeuristicPolicy``)."""

from __future__ import annotations

import numpy as np

from vllm_specplug.controller.pricing import Decision


class StaticPolicy:
    name = "static"

    def __init__(self, k: int) -> None:
        self.k = k

    def decide(self, ceilings: np.ndarray, fixed_k_step: int | None = None) -> Decision:
        k_step = fixed_k_step if fixed_k_step is not None else self.k
        # A pinned K_step below K runs fewer draft positions than K.
        k = np.minimum(ceilings, min(self.k, k_step))
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
        if fixed_k_step is None:
            return Decision(k_step=int(k.max(initial=0)), k=k)
        return Decision(k_step=fixed_k_step, k=np.minimum(k, fixed_k_step))
