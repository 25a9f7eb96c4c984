"""What each constant that shapes a decision is worth, on the simulator.

    .venv/bin/python benchmarks/constants_sweep.py [--only NAME ...] [--out FILE.json]

The sweep of ``tests/test_sim.py`` (both GPU setups on the measured H200
prices and the CPU profile with the zero-cost fallback; five scenarios;
c = 1 and 64 on GPU, 1 and 4 on CPU; six seeds a cell) is run once with
every policy, then the goodput policy alone once per variant: one constant
set to another value, its neutral one (0, or the rule switched off) among
them where it has one.  The fixed arms and the oracle do not depend on the
controller, so every variant is compared with the same baseline arms.
Printed per variant: the mean over cells of goodput / max(plain, best
static K), the lowest cell, the cells under 0.97, and the mean of the
per-cell change against the default (with the cells that moved by more
than 0.01).  A cell's mean of six seeds is noisy by about 0.005 at c = 1
and 0.013-0.03 at c = 64 (``tests/test_sim.py``).

Constants are changed by patching the class or module attribute or the
settings' default in this process (cells run serially here); the
``profile off`` variants price from parameter counts (``prior_profile``)
instead of the measured profile.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from unittest.mock import patch

import numpy as np

import vllm_specplug.controller.controller as controller_mod
import vllm_specplug.controller.profile as profile_mod
import vllm_specplug.profiling as profiling
import vllm_specplug.tools.sim.engine as engine
import vllm_specplug.tools.sim.profile as sim_profile
from vllm_specplug.controller import ControllerSettings
from vllm_specplug.controller.correction import ProfileCorrection
from vllm_specplug.controller.estimator import AcceptanceEstimator
from vllm_specplug.controller.profile import prior_profile
from vllm_specplug.tools.sim.cell import CellSpec
from vllm_specplug.tools.sim.report import aggregate, summarize
from vllm_specplug.tools.sim.sweep import run_sweep

GPU_SETUPS = ("70b-1b", "8b-eagle")
SCENARIOS = ("easy", "hard", "mixed", "drift", "switch")
FIXED = ("plain", "static-1", "static-2", "static-4", "static-8", "oracle")
SEEDS = range(6)
FAST = dict(warmup=0.5, measure=0.5)
WINDOW = {1: FAST, 64: dict(warmup=0.5, measure=2.0)}


def specs(policies) -> list[CellSpec]:
    """The cells of tests/test_sim.py's sweep, for ``policies``."""
    out = [CellSpec(setup, scen, pol, c, seed, **WINDOW[c])
           for setup in GPU_SETUPS for scen in SCENARIOS for c in (1, 64)
           for pol in policies for seed in SEEDS]
    out += [CellSpec("cpu-qwen", scen, pol, c, seed, draft_at_k0=False, min_window=8, **FAST)
            for scen in SCENARIOS for c in (1, 4) for pol in policies for seed in SEEDS]
    return out


# A variant is a function returning the patches (``unittest.mock.patch``
# context managers) that set it; they are undone when its cells are run.
def settings(**kw):
    """A variant of ``ControllerSettings``' defaults, as the simulator builds them."""
    return lambda: [patch.object(engine, "ControllerSettings",
                                 functools.partial(ControllerSettings, **kw))]


def attr(obj, name, value):
    return lambda: [patch.object(obj, name, value)]


def correction(**kw):
    return lambda: [patch.object(controller_mod, "ProfileCorrection",
                                 functools.partial(ProfileCorrection, **kw))]


def pool_anchor(trials: float):
    init = AcceptanceEstimator.__init__

    def patched(self, *a, **k):
        init(self, *a, **k)
        self._global_prior_trials = trials
        self._profile = None
        self._surv_profile = self.global_profile()
    return lambda: [patch.object(AcceptanceEstimator, "__init__", patched)]


def prompt_tokens(n: int):
    return lambda: [patch.object(profiling.testbench, "PROMPT_TOKENS", n),
                    patch.object(sim_profile, "PROMPT_TOKENS", n)]


def budget(seconds: float):
    return lambda: [patch.object(engine, "measure_profile",
                                 functools.partial(sim_profile.measure_profile, budget_s=seconds))]


def profile_off(draft_ratio: float | None = None, **prior):
    """``profile: off``: prices from parameter counts (``prior_profile``), the
    draft's share ``draft_ratio`` (None: the setup's own); ``prior``: the
    prior's constants.  The measurement still runs, untimed, so the engine's
    shapes are warmed as in the other arms."""
    measure = sim_profile.measure_profile

    def from_counts(setup, rng, clock=None):
        measure(setup, rng, clock)
        ratio = setup.draft_size_ratio() if draft_ratio is None else draft_ratio
        return prior_profile(setup.device.platform, ratio, setup.workload.max_batched_tokens,
                             setup.max_concurrency, draft_runs_at_k0=setup.draft_at_k0)
    return lambda: ([patch.object(engine, "measure_profile", from_counts)]
                    + [patch.object(profile_mod, k, v) for k, v in prior.items()])


# name -> the variant.  Defaults in the comments.
VARIANTS = {
    "min_gain=0": settings(min_gain=0.0),                      # 0.02
    "min_gain=0.05": settings(min_gain=0.05),
    "PROFILE_TOLERANCE=0": attr(AcceptanceEstimator, "PROFILE_TOLERANCE", 0.0),  # 0.01
    "PROFILE_TOLERANCE=0.05": attr(AcceptanceEstimator, "PROFILE_TOLERANCE", 0.05),
    "POOL_EVERY=1": attr(AcceptanceEstimator, "POOL_EVERY", 1),  # 8
    "POOL_EVERY=32": attr(AcceptanceEstimator, "POOL_EVERY", 32),
    "POOL_MIN_ROWS=4": attr(AcceptanceEstimator, "POOL_MIN_ROWS", 4),  # 8
    "POOL_MIN_ROWS=16": attr(AcceptanceEstimator, "POOL_MIN_ROWS", 16),
    "forgetting=0.8": settings(forgetting=0.8),                # 0.9
    "forgetting=0.95": settings(forgetting=0.95),
    "prior_strength=0.1": settings(prior_strength=0.1),        # 0.5
    "prior_strength=2": settings(prior_strength=2.0),
    "initial_acceptance=0.4": settings(initial_acceptance=0.4),  # 0.6
    "initial_acceptance=0.8": settings(initial_acceptance=0.8),
    "pool_anchor=1": pool_anchor(1.0),                          # 4
    "pool_anchor=16": pool_anchor(16.0),
    "probe_k=2": settings(probe_k=2),                           # 1
    "probe_interval=1": settings(probe_interval=1),             # 4
    "probe_interval=8": settings(probe_interval=8),
    "probe_max_interval=8": settings(probe_max_interval=8),     # 32
    "probe_max_interval=128": settings(probe_max_interval=128),
    "PROBE_OPTIMISM=0.7": attr(controller_mod.SpecController, "PROBE_OPTIMISM", 0.7),  # 0.9
    "PROBE_OPTIMISM=1.0": attr(controller_mod.SpecController, "PROBE_OPTIMISM", 1.0),
    "correction step=0.005": correction(step=0.005),            # 0.02
    "correction step=0.05": correction(step=0.05),
    "correction clip 0.8-1.25": correction(low=0.8, high=1.25),  # 0.5-2
    "correction forget=0": correction(forget=0.0),             # 0.002
    "correction forget=0.02": correction(forget=0.02),
    "OWN_PREVIOUS_SHARE=0": attr(AcceptanceEstimator, "OWN_PREVIOUS_SHARE", 0.0),  # 0.5
    "OWN_PREVIOUS_SHARE=0.25": attr(AcceptanceEstimator, "OWN_PREVIOUS_SHARE", 0.25),
    "OWN_PREVIOUS_SHARE=0.75": attr(AcceptanceEstimator, "OWN_PREVIOUS_SHARE", 0.75),
    "PULL_CHANGE=0": attr(AcceptanceEstimator, "PULL_CHANGE", 0.0),  # 0.1
    "PULL_CHANGE=0.3": attr(AcceptanceEstimator, "PULL_CHANGE", 0.3),
    "correction BANDS=1": attr(ProfileCorrection, "BANDS", 1),  # 24 token bands
    "correction BATCH_BANDS=1": attr(ProfileCorrection, "BATCH_BANDS", 1),  # 12
    # The start-up measurement (the simulator runs the plugin's run_rounds).
    "ROUNDS=2": attr(profiling.rounds, "ROUNDS", 2),  # 4
    "ROUNDS=8": attr(profiling.rounds, "ROUNDS", 8),
    "MAX_ROUNDS=ROUNDS": attr(profiling.rounds, "MAX_ROUNDS", 4),  # 9
    "ROUNDS_S=5": attr(profiling.rounds, "ROUNDS_S", 5.0),  # 1.5
    "LEAD_ROUNDS=0": attr(profiling.rounds, "LEAD_ROUNDS", 0),  # 2
    "SIZE_WARMUP_ROUNDS=0": attr(profiling.rounds, "SIZE_WARMUP_ROUNDS", 0),  # 1
    "PROMPT_TOKENS=8": prompt_tokens(8),  # 32
    "PROMPT_TOKENS=128": prompt_tokens(128),
    "BUDGET_S=10": budget(10.0),  # 75
    "BUDGET_S=300": budget(300.0),
    # profile: off (prices from parameter counts); its constants.
    "profile off": profile_off(),
    "profile off, PRIOR_TOKEN_COST x0.5": profile_off(PRIOR_TOKEN_COST_CPU=0.125,
                                                      PRIOR_TOKEN_COST_GPU=0.01),
    "profile off, PRIOR_TOKEN_COST x2": profile_off(PRIOR_TOKEN_COST_CPU=0.5,
                                                    PRIOR_TOKEN_COST_GPU=0.04),
    "profile off, PRIOR_DRAFT_FACTOR=0.25": profile_off(PRIOR_DRAFT_FACTOR=0.25),  # 0.5
    "profile off, PRIOR_DRAFT_FACTOR=1": profile_off(PRIOR_DRAFT_FACTOR=1.0),
    "profile off, draft size unknown (UNKNOWN_DRAFT_RATIO)":
        profile_off(draft_ratio=profile_mod.UNKNOWN_DRAFT_RATIO),
}


def ratios(summary) -> dict:
    return {(r["setup"], r["scenario"], r["concurrency"]): r["goodput_vs_ref"]
            for r in summary["rows"]}


def describe(name: str, cells: dict, base: dict | None) -> dict:
    v = np.array(list(cells.values()))
    low = min(cells, key=cells.get)
    row = {"variant": name, "mean": float(v.mean()), "lowest": float(cells[low]),
           "lowest_cell": "/".join(map(str, low)), "under_0.97": int((v < 0.97).sum())}
    if base is not None:
        d = {k: cells[k] - base[k] for k in cells}
        row["mean_change"] = float(np.mean(list(d.values())))
        row["moved"] = {"/".join(map(str, k)): round(x, 3) for k, x in d.items() if abs(x) > 0.01}
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", nargs="*", help="variants to run (default: all)")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    names = args.only or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    t0 = time.time()
    fixed = run_sweep(specs(FIXED), progress=False)
    goodput = run_sweep(specs(("goodput",)), progress=False)
    base = ratios(summarize(aggregate(fixed + goodput)))
    rows = [describe("default", base, None)]
    print(f"default: {rows[0]['mean']:.4f} mean, lowest {rows[0]['lowest']:.3f} "
          f"({rows[0]['lowest_cell']}), {rows[0]['under_0.97']} under 0.97 "
          f"[{time.time() - t0:.0f} s]", flush=True)
    for name in names:
        with contextlib.ExitStack() as stack:
            for p in VARIANTS[name]():
                stack.enter_context(p)
            cells = ratios(summarize(aggregate(fixed + run_sweep(specs(("goodput",)),
                                                                 progress=False))))
        row = describe(name, cells, base)
        rows.append(row)
        print(f"{name}: {row['mean']:.4f} mean ({row['mean_change']:+.4f}), lowest "
              f"{row['lowest']:.3f} ({row['lowest_cell']}), {row['under_0.97']} under 0.97; "
              f"moved > 0.01: {row['moved'] or 'none'} [{time.time() - t0:.0f} s]", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
