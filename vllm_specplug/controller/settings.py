"""The controller's settings (``ControllerSettings``, with the acceptance
estimate's defaults) and its running statistics (``ControllerStats``, with the
kernel that counts a plan into them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numba
import numpy as np

# The acceptance estimate's defaults (``AcceptanceEstimator``'s), also
# ``ControllerSettings``' (and so the server's).
FORGETTING = 0.9
PRIOR_STRENGTH = 0.5
INITIAL_ACCEPTANCE = 0.6


@numba.njit(cache=True)
def _count_plan(k, ceilings, k_counts):
    """A plan in the statistics: per-K counts; returns the slots and the requests in fallback."""
    slots = fallback = 0
    for i in range(k.size):
        if k[i] < k_counts.size:
            k_counts[k[i]] += 1
        slots += k[i]
        if k[i] == 0 and ceilings[i] > 0:
            fallback += 1
    return slots, fallback


@dataclass
class ControllerSettings:
    max_k: int
    policy: str = "goodput"
    static_k: int | None = None
    forgetting: float = FORGETTING
    prior_strength: float = PRIOR_STRENGTH
    initial_acceptance: float = INITIAL_ACCEPTANCE
    min_gain: float = 0.02
    probe_k: int = 1
    probe_interval: int = 4
    probe_max_interval: int = 32
    # False: live step times do not correct the profile's prices.
    profile_correction: bool = True


@dataclass
class ControllerStats:
    steps: int = 0
    sum_k_step: int = 0
    request_steps: int = 0
    granted_slots: int = 0
    fallback_request_steps: int = 0
    probes_sent: int = 0
    probes_succeeded: int = 0
    plain_probes: int = 0
    recoveries: int = 0
    drafted: int = 0
    accepted: int = 0
    # k_counts[k]: request-steps that were granted k drafts.
    k_counts: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))

    @property
    def k_histogram(self) -> dict[int, int]:
        return {k: int(n) for k, n in enumerate(self.k_counts.tolist()) if n}
