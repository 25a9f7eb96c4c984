"""Micro-benchmark: the cost of one controller decision.

    .venv/bin/python benchmarks/decision_cost.py [--batch 64] [--k 8]
    git archive REV vllm_specplug/controller | tar -x -C /tmp/base
    .venv/bin/python benchmarks/decision_cost.py --baseline /tmp/base

Times ``SpecController.plan`` (goodput policy) for a batch of requests with
learned acceptance and a calibrated cost model: the work the scheduler adds
to every step, on the critical path.  Also times one step's learning
(``observe_verifications`` for the batch + ``observe_step``).

``--baseline DIR`` loads a second copy of the controller from
``DIR/vllm_specplug/controller`` (another revision) and runs it step by step
alternately with this checkout's, on the same synthetic traffic, so that the
ratio between the two is not the machine's drift.
"""

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def load_controller(root: Path, name: str):
    """Import ``root/vllm_specplug/controller`` as a package called ``name``."""
    pkg = root / "vllm_specplug" / "controller"
    spec = importlib.util.spec_from_file_location(
        name, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # The package imports its submodules as vllm_specplug.controller.*: point
    # those names at this copy while it loads, then restore them.
    saved = {k: v for k, v in sys.modules.items() if k.startswith("vllm_specplug.controller")}
    for k in saved:
        del sys.modules[k]
    sys.modules["vllm_specplug.controller"] = module
    try:
        spec.loader.exec_module(module)
    finally:
        for k in [k for k in sys.modules if k.startswith("vllm_specplug.controller")]:
            del sys.modules[k]
        sys.modules.update(saved)
    return module


class Bench:
    """One controller driven with the same synthetic traffic every run."""

    def __init__(self, controller_module, batch: int, k: int) -> None:
        self.ctrl = controller_module.SpecController(controller_module.ControllerSettings(max_k=k))
        self.ids = [f"req-{i}" for i in range(batch)]
        self.rng = np.random.default_rng(0)
        self.alphas = self.rng.uniform(0.1, 0.95, size=batch)
        self.plan_us, self.learn_us, self.k, self.k_step = [], [], [], []
        for r in self.ids:
            self.ctrl.add_request(r)

    def step(self, record: bool = True) -> None:
        ctrl, ids = self.ctrl, self.ids
        t0 = time.perf_counter()
        d = ctrl.plan(ids)
        t1 = time.perf_counter()
        # Accepted prefix length: geometric in each request's alpha, cut at k.
        accepted = np.minimum(self.rng.geometric(1.0 - self.alphas) - 1, d.k)
        t2 = time.perf_counter()
        ctrl.observe_verifications(ids, d.k, accepted)
        t = len(ids) + int(d.k.sum())
        ctrl.observe_step(len(ids), t, d.k_step, 0.05 + 0.001 * t + 0.002 * d.k_step)
        t3 = time.perf_counter()
        if record:
            self.plan_us.append((t1 - t0) * 1e6)
            self.learn_us.append((t3 - t2) * 1e6)
            self.k.append(d.k.mean())
            self.k_step.append(d.k_step)

    def report(self, label: str) -> None:
        q = lambda xs, f: sorted(xs)[int(f * (len(xs) - 1))]
        print(f"{label}plan (one decision):       median {statistics.median(self.plan_us):6.1f} us, "
              f"p90 {q(self.plan_us, 0.9):6.1f} us")
        print(f"{label}learn (one step's output): median {statistics.median(self.learn_us):6.1f} us, "
              f"p90 {q(self.learn_us, 0.9):6.1f} us")
        print(f"{label}mean K granted per request {np.mean(self.k):.2f}, "
              f"K_step {np.mean(self.k_step):.2f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--baseline", type=Path, default=None,
                   help="a tree holding vllm_specplug/controller of another revision")
    args = p.parse_args()
    from vllm_specplug import controller

    benches = [("", Bench(controller, args.batch, args.k))]
    if args.baseline is not None:
        base = load_controller(args.baseline, "baseline_controller")
        benches = [("this checkout: ", benches[0][1]),
                   ("baseline:      ", Bench(base, args.batch, args.k))]
    for _, b in benches:
        for _ in range(200):  # learn acceptance and costs first
            b.step(record=False)
    for _ in range(args.iters):
        for _, b in benches:
            b.step()
    print(f"batch {args.batch}, K ceiling {args.k}, {args.iters} decisions")
    for label, b in benches:
        b.report(label)
    if args.baseline is not None:
        new, old = benches[0][1], benches[1][1]
        print(f"ratio this/baseline, medians: plan "
              f"{statistics.median(new.plan_us) / statistics.median(old.plan_us):.2f}, "
              f"learn {statistics.median(new.learn_us) / statistics.median(old.learn_us):.2f}")


if __name__ == "__main__":
    main()
