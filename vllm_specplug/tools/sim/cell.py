"""A simulator cell: its spec (setup, scenario, policy, concurrency, seed,
options), the seeded random streams it draws from, and its setup."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import numpy as np

from vllm_specplug.tools.sim.cost import Setup, make_setup


@dataclass(frozen=True)
class CellSpec:
    setup: str
    scenario: str
    policy: str
    concurrency: int
    seed: int = 0
    gpu: str = "h200"
    draft_at_k0: bool = True
    warmup: float = 0.5  # request generations (x concurrency completions) not measured
    measure: float = 1.0  # request generations measured
    min_window: int = 3  # completions measured, at least
    max_steps: int = 20000
    noise: float | None = None  # None: the setup's default
    arrival_rate: float | None = None  # requests/s; None: closed loop
    tp: int | None = None
    prefill: bool = True  # False: prompts arrive already cached (decode-only steps)
    realism: bool = True  # False: no cold first steps and no stalls (noise only)
    cold_steps: int = 2  # slow first steps of each new step shape (see clock.Realism)

    def key(self) -> str:
        return (f"{self.setup}/{self.gpu}/{'today' if self.draft_at_k0 else 'zero'}/"
                f"{'' if self.prefill else 'decode-only/'}"
                f"{'' if self.realism else 'ideal/'}"
                f"{'' if self.cold_steps == 2 else f'cold{self.cold_steps}/'}"
                f"{self.scenario}/{self.policy}/c{self.concurrency}/s{self.seed}")


def _seed(spec: CellSpec, purpose: str) -> np.random.Generator:
    """Independent streams per purpose; the workload and acceptance streams
    do not depend on the policy, so every policy sees the same requests."""
    words = [spec.setup, spec.gpu, spec.scenario, str(spec.concurrency), purpose]
    h = hashlib.sha256("/".join(words).encode()).digest()
    return np.random.default_rng([spec.seed, int.from_bytes(h[:8], "little")])



def setup_for(spec: CellSpec) -> Setup:
    return make_setup(spec.setup, gpu=spec.gpu, draft_at_k0=spec.draft_at_k0, tp=spec.tp,
                      noise=spec.noise)


def with_policy(spec: CellSpec, policy: str) -> CellSpec:
    return replace(spec, policy=policy)
