"""Micro-benchmark: the cost of one controller decision.

    .venv/bin/python benchmarks/decision_cost.py [--batch 64] [--k 8] [--platform cuda]

Times ``SpecController.plan`` (goodput policy, probes included) for a batch
of requests with learnt acceptance, priced from a step-cost profile: the
work the scheduler adds to every step, on the critical path.  Also times
one step's learning (``observe_verifications`` for the batch +
``observe_step``).

The profile is ``prior_profile`` for ``--platform`` (``cuda`` by default, a
draft 2.5% of the target: a draft pass at 2.5% of a target step).  Acceptance rates are drawn once, uniformly in
[0.1, 0.95]; a step takes the profile's price with 10% lognormal noise.  At
batch 64 the requests with good drafts get slots and the others fall back
and are probed, so a decision usually runs the argmax twice (the plan, and
the probes' hopeful plan); on ``cpu`` nearly every request falls back.
The first steps of a process compile the controller's numba kernels (2-3 s,
then cached on disk); the warm-up steps keep that out of the timings.
"""

import argparse
import statistics
import time

import numpy as np

from vllm_specplug.controller import ControllerSettings, SpecController, prior_profile


class Bench:
    """One controller driven with the same synthetic traffic every run."""

    def __init__(self, batch: int, k: int, platform: str) -> None:
        profile = prior_profile(platform, 0.025, batch * (k + 1), batch)
        self.ctrl = SpecController(ControllerSettings(max_k=k), profile)
        self.ids = [f"req-{i}" for i in range(batch)]
        self.rng = np.random.default_rng(0)
        self.alphas = self.rng.uniform(0.1, 0.95, size=batch)
        self.previous = np.zeros(batch, dtype=np.int64)
        self.plan_us, self.learn_us, self.k, self.k_step = [], [], [], []
        for r in self.ids:
            self.ctrl.add_request(r)

    def step(self, record: bool = True) -> None:
        ctrl, ids, previous = self.ctrl, self.ids, self.previous
        t0 = time.perf_counter()
        d = ctrl.plan(ids)
        t1 = time.perf_counter()
        # The drafts verified now were planned a step ago (vLLM's pipeline).
        # Accepted prefix length: geometric in each request's alpha, cut at k.
        accepted = np.minimum(self.rng.geometric(1.0 - self.alphas) - 1, previous)
        tokens = len(ids) + int(previous.sum())
        seconds = ctrl.profile.step(tokens, len(ids), d.k_step) * self.rng.lognormal(0.0, 0.1)
        t2 = time.perf_counter()
        ctrl.observe_verifications(ids, previous, accepted)
        ctrl.observe_step(len(ids), tokens, d.k_step, seconds)
        t3 = time.perf_counter()
        self.previous = d.k.copy()
        if record:
            self.plan_us.append((t1 - t0) * 1e6)
            self.learn_us.append((t3 - t2) * 1e6)
            self.k.append(d.k.mean())
            self.k_step.append(d.k_step)

    def report(self) -> None:
        def q(xs, f):
            return sorted(xs)[int(f * (len(xs) - 1))]

        print(f"plan (one decision):       median {statistics.median(self.plan_us):6.1f} us, "
              f"p90 {q(self.plan_us, 0.9):6.1f} us")
        print(f"learn (one step's output): median {statistics.median(self.learn_us):6.1f} us, "
              f"p90 {q(self.learn_us, 0.9):6.1f} us")
        s = self.ctrl.stats
        print(f"mean K granted per request {np.mean(self.k):.2f}, "
              f"K_step {np.mean(self.k_step):.2f}, probes {s.probes_sent}, "
              f"in fallback at the end {self.ctrl.num_in_fallback()}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--platform", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args()
    bench = Bench(args.batch, args.k, args.platform)
    for _ in range(200):  # learn acceptance first
        bench.step(record=False)
    for _ in range(args.iters):
        bench.step()
    print(f"batch {args.batch}, K ceiling {args.k}, {args.platform} prior profile, "
          f"{args.iters} decisions")
    bench.report()


if __name__ == "__main__":
    main()
