"""Micro-benchmark: the cost of one controller decision.

    .venv/bin/python benchmarks/decision_cost.py [--batch 64] [--k 8]

Times ``SpecController.plan`` (goodput policy) for a batch of requests with
learned acceptance and a calibrated cost model: the work the scheduler adds
to every step, on the critical path.  Also times one step's learning
(``observe_verifications`` for the batch + ``observe_step``).
"""

import argparse
import statistics
import time

import numpy as np

from vllm_specplug.controller import ControllerSettings, SpecController


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args()
    ctrl = SpecController(ControllerSettings(max_k=args.k))
    ids = [f"req-{i}" for i in range(args.batch)]
    rng = np.random.default_rng(0)
    alphas = rng.uniform(0.1, 0.95, size=args.batch)
    for r in ids:
        ctrl.add_request(r)

    def draw(decision):
        # Accepted prefix length: geometric in each request's alpha, cut at k.
        fails = rng.geometric(1.0 - alphas) - 1
        return np.minimum(fails, decision.k)

    def learn(decision, accepted):
        ctrl.observe_verifications(ids, decision.k, accepted)
        t = args.batch + int(decision.k.sum())
        ctrl.observe_step(args.batch, t, decision.k_step, 0.05 + 0.001 * t + 0.002 * decision.k_step)

    for _ in range(200):
        d = ctrl.plan(ids)
        learn(d, draw(d))
    plan_us, learn_us, ks, kss = [], [], [], []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        d = ctrl.plan(ids)
        t1 = time.perf_counter()
        accepted = draw(d)
        t2 = time.perf_counter()
        learn(d, accepted)
        t3 = time.perf_counter()
        plan_us.append((t1 - t0) * 1e6)
        ks.append(d.k.mean())
        kss.append(d.k_step)
        learn_us.append((t3 - t2) * 1e6)
    q = lambda xs, f: sorted(xs)[int(f * (len(xs) - 1))]
    print(f"batch {args.batch}, K ceiling {args.k}, {args.iters} decisions")
    print(f"plan (one decision):      median {statistics.median(plan_us):6.1f} us, "
          f"p90 {q(plan_us, 0.9):6.1f} us")
    print(f"learn (one step's output): median {statistics.median(learn_us):6.1f} us, "
          f"p90 {q(learn_us, 0.9):6.1f} us")
    print(f"mean K granted per request {np.mean(ks):.2f}, K_step {np.mean(kss):.2f}")


if __name__ == "__main__":
    main()
