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

Constants are changed by patching the class attribute or the settings'
default in this process (cells run serially here).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import numpy as np

import vllm_specplug.controller.controller as controller_mod
import vllm_specplug.tools.sim.engine as engine
from vllm_specplug.controller import ControllerSettings
from vllm_specplug.controller.estimator import AcceptanceEstimator
from vllm_specplug.controller.profile import ProfileCorrection
from vllm_specplug.tools.sim.engine import CellSpec
from vllm_specplug.tools.sim.report import aggregate, run_sweep, summarize

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


def settings(**kw):
    """A variant of ``ControllerSettings``' defaults, as the simulator builds them."""
    def patch():
        engine.ControllerSettings = functools.partial(ControllerSettings, **kw)
    return patch


def attr(obj, name, value):
    def patch():
        setattr(obj, name, value)
    return patch


def correction(**kw):
    def patch():
        controller_mod.ProfileCorrection = functools.partial(ProfileCorrection, **kw)
    return patch


def pool_anchor(trials: float):
    def patch():
        init = AcceptanceEstimator.__init__

        def patched(self, *a, **k):
            init(self, *a, **k)
            self._global_prior_trials = trials
            self._profile = None
            self._surv_profile = self.global_profile()
        AcceptanceEstimator.__init__ = patched
    return patch


# name -> (the constant and value, patch).  Defaults in the comments.
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
    originals = (engine.ControllerSettings, controller_mod.ProfileCorrection,
                 AcceptanceEstimator.__init__,
                 {k: getattr(AcceptanceEstimator, k) for k in
                  ("PROFILE_TOLERANCE", "POOL_EVERY", "POOL_MIN_ROWS")},
                 controller_mod.SpecController.PROBE_OPTIMISM)
    for name in names:
        VARIANTS[name]()
        try:
            cells = ratios(summarize(aggregate(fixed + run_sweep(specs(("goodput",)),
                                                                 progress=False))))
        finally:
            (engine.ControllerSettings, controller_mod.ProfileCorrection,
             AcceptanceEstimator.__init__) = originals[:3]
            for k, v in originals[3].items():
                setattr(AcceptanceEstimator, k, v)
            controller_mod.SpecController.PROBE_OPTIMISM = originals[4]
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
