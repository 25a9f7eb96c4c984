"""A fresh controller on the CPU profile, in runs shaped like `bench --quick`.

    .venv/bin/python benchmarks/cold_start.py [--seeds 6] [--runs 4]

The real `--quick` benchmark runs 2 requests x 32 tokens per policy run on the
Qwen pair and keeps each policy's controller between its runs, so its first
run measures a *fresh* controller.  This script replays that shape in the
simulator's `cpu-qwen` profile (step times calibrated on this machine: plain
0.31 s, K=1 0.76 s, K=8 3.9 s; zero-cost fallback on), with the real
`SpecController` started from a step-cost profile measured on the same
simulated clock (`vllm_specplug.tools.sim.profile`), for an easy (draft acceptance
0.95) and a hard (0.3) request stream, and prints goodput over plain
decoding per run, averaged over seeds.  Step times run on the simulator's
`StepClock`: noise, rare stalls, and slow first steps of shapes the profile
measurement did not warm.  Plain decoding is timed on the same requests with
the same acceptance draws (tokens a step emits are charged at plain's
noise-free step time).  Unlike the simulator's engine, a step here verifies
the drafts it plans (no one-step lag).
"""

from __future__ import annotations

import argparse

import numpy as np

from vllm_specplug.tools.sim.clock import Realism, StepClock
from vllm_specplug.tools.sim.cost import make_setup
from vllm_specplug.tools.sim.policies import Controller


def run(alpha: float, runs: int, seed: int, requests: int = 2, tokens: int = 32,
        prompt: int = 64, noise: float = 0.1) -> tuple[list[float], dict]:
    setup = make_setup("cpu-qwen", draft_at_k0=False)
    cost = setup.cost()
    rng = np.random.default_rng(seed)
    clock = StepClock(Realism.for_setup(noise), rng)
    ctl = Controller(setup, "goodput", rng=rng, clock=clock).controller
    ratios, n = [], 0
    for _ in range(runs):
        t_spec = t_plain = 0.0
        for _ in range(requests):
            name = f"r{n}"
            n += 1
            ctl.add_request(name)
            sec = clock.seconds(cost.step(np.zeros(0), np.zeros(0, dtype=int), 0, np.zeros(1),
                                          np.array([float(prompt)])), prompt, False)
            ctl.observe_step(1, prompt, 0, sec)
            t_spec += sec
            t_plain += sec
            left, ctx = tokens - 1, prompt + 1
            while left > 0:
                d = ctl.plan([name])
                k, k_step = int(d.k[0]), int(d.k_step)
                accepted = 0
                while accepted < k and rng.random() < alpha:
                    accepted += 1
                sec = clock.seconds(cost.step(np.array([float(ctx)]), np.array([k]), k_step),
                                    1 + k, k_step > 0)
                if k:
                    ctl.observe_verification(name, k, accepted)
                ctl.observe_step(1, 1 + k, k_step, sec)
                t_spec += sec
                plain_step = cost.step(np.array([float(ctx)]), np.array([0]), 0,
                                       speculative=False)
                t_plain += plain_step * min(accepted + 1, left)
                left -= accepted + 1
                ctx += accepted + 1
            ctl.finish_request(name)
        ratios.append(t_plain / t_spec)
    return ratios, ctl.stats.k_histogram


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--runs", type=int, default=4)
    a = p.parse_args()
    print("| drafts | " + " | ".join(f"run {i + 1}" for i in range(a.runs)) + " |")
    print("|---|" + "---|" * a.runs)
    for label, alpha in (("easy (0.95)", 0.95), ("hard (0.3)", 0.3)):
        per_run = np.mean([run(alpha, a.runs, s)[0] for s in range(a.seeds)], axis=0)
        print(f"| {label} | " + " | ".join(f"{v:.3f}x" for v in per_run) + " |")


if __name__ == "__main__":
    main()
