"""The controller's settings (``ControllerSettings``, with the acceptance
estimate's defaults) and its running statistics (``ControllerStats``, with the
kernel that counts a plan into them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numba
import numpy as np

# The defaults of ``ControllerSettings`` (and so of the config and the
# server).  Each tuned value names its source; docs/internals.md ("Constants
# that shape decisions") has the measurements, tests/test_constants.py keeps
# the two in step.
#
# The acceptance estimate (``AcceptanceEstimator``): a verification's weight
# kept per new one; the pull toward the pool (pseudo-trials); the pool's
# acceptance before anything is observed.
# Source: 97a4086 (0.85 / 2 never put an always-failing request below ~0.14);
# constants_sweep.py at 59dd374: 0.8, 0.1, 0.4 and 0.8 within the noise.
FORGETTING = 0.9
PRIOR_STRENGTH = 0.5
INITIAL_ACCEPTANCE = 0.6
# The gain over plain decoding a plan must promise (``GoodputPolicy``).
# Source: constants_sweep.py at 59dd374: 0 let the CPU zero-cost drift cell fall to 0.967.
MIN_GAIN = 0.02
# A probe's first size, and its back-off (steps, doubled per failed probe up to the cap).
# Source: constants_sweep.py at 59dd374: flat around each (a 1-step back-off: 2 cells under 0.97).
PROBE_K = 1
PROBE_INTERVAL = 4
PROBE_MAX_INTERVAL = 32


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
    min_gain: float = MIN_GAIN
    probe_k: int = PROBE_K
    probe_interval: int = PROBE_INTERVAL
    probe_max_interval: int = PROBE_MAX_INTERVAL
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
