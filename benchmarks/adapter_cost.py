"""Micro-benchmark: the time the scheduler adapter adds to an engine step.

    .venv/bin/python benchmarks/adapter_cost.py [--batches 1,8,64] [--steps 300] [--warmup 50]

Two schedulers on the same synthetic traffic, no model and no engine: vLLM's
own ``Scheduler`` (the class the plugin subclasses) and the plugin's
``AdaptiveSpecScheduler`` (default settings: goodput policy), both built
from one ``VllmConfig`` with speculative decoding by a draft model
(``method=draft_model``, ``num_speculative_tokens=8``; the tiny target of
``vllm_specplug.tools.testing`` stands in as its own draft, only its config
is read).  Per step, ``schedule()`` and ``update_from_output()`` are timed
with ``time.perf_counter`` (``update_draft_token_ids``, which the adapter
also overrides, is timed apart and left out of the sum).  The arms step in
turn, one step each, so machine noise hits both alike; the first
``--warmup`` steps (prefill included) are not recorded.

Traffic: ``batch`` requests of 20 prompt tokens and ``max_tokens`` large
enough that none finishes, so the batch stays full.  Each request draws an
acceptance rate alpha uniformly in [0.1, 0.95] (seeded) and, for its n-th
verification, an accepted-prefix length L_n ~ geometric(1 - alpha) - 1
(seeded per request); a step accepts min(L_n, drafts offered).  Both arms
get the same alphas and the same L_n sequences.  A fake runner answers each
step with a ``ModelRunnerOutput`` of that many accepted drafts plus one, and
(sync mode) the proposer's drafts come back through
``update_draft_token_ids``: ``num_spec_tokens_to_schedule`` per decoding
request, as vLLM's proposer drafts them.

The plugin prices steps with a fixed profile, ``prior_profile("cuda",
0.025, ...)`` (a draft pass 2.5% of a target step, run at K_step = 0 as on a GPU),
installed in place of the one it built, so nothing is measured at start-up;
its step clock is a synthetic one that advances by that profile's price of
each step, so the live correction sees consistent timings.

What the difference (plugin minus vLLM) contains: the controller's decision
(``SpecController.plan``) and learning (``observe_verifications``,
``observe_step``), the adapter's bookkeeping around them (per-request
lists, the plan applied to the ``SchedulerOutput``, metrics), MINUS whatever
vLLM's own code saves because the plugin schedules fewer draft tokens than
vLLM's 8 per request (smaller token counts, fewer spec token lists to build
and to check in ``update_from_output``).  So it is the adapter's net cost on
the scheduler's critical path, not the controller's gross cost
(``decision_cost.py`` measures that alone).  The two arms also run different
token counts per step, so their requests advance at different speeds; the
table shows the mean K per request and the tokens per step of each arm.
"""

import os

# The tiny model says 2048 positions; requests here run longer (no model runs).
os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import statistics
import tempfile
import time

import numpy as np

from vllm_specplug.tools.testing import FakeEngine, make_request

K = 8  # num_speculative_tokens: vLLM's K and the plugin's ceiling
PROMPT_LEN = 20
BLOCK = 32


def build_scheduler(model, batch, max_tokens, plugin, async_scheduling):
    """vLLM's scheduler (``plugin=False``) or the plugin's, on one config; the
    plugin's controller prices with a fixed profile, returned with it."""
    from vllm_specplug.controller import SpecController, prior_profile
    from vllm_specplug.tools.testing import build_scheduler as build

    max_len = -(-(PROMPT_LEN + max_tokens + 2 * (K + 1)) // BLOCK) * BLOCK
    max_batched = max(8192, batch * (PROMPT_LEN + K + 1))  # prefill in one step
    sched = build(model, K, plugin=plugin, async_scheduling=async_scheduling,
                  max_model_len=max_len, max_num_seqs=batch, max_num_batched_tokens=max_batched,
                  num_blocks=batch * (max_len // BLOCK + 1) + 1, block_size=BLOCK)
    if not plugin:
        return sched, None
    sp = sched.specplug
    assert sp.enabled, sp.reason
    # A fixed profile: what an H200-class GPU prior says, no start-up measurement.
    sp.profile = prior_profile("cuda", 0.025, max_batched, batch, draft_runs_at_k0=True)
    sp.controller = SpecController(sp.controller.settings, sp.profile)
    return sched, sp.profile


class Arm(FakeEngine):
    """One scheduler on the synthetic traffic, its step times recorded."""

    def __init__(self, name, sched, profile, accepts):
        super().__init__(sched, accepts, profile)
        self.name = name
        self.sched_us, self.update_us, self.drafts_us = [], [], []
        self.k, self.tokens = [], []

    def step(self, record=True):
        so = super().step()
        if record:
            self.sched_us.append(self.seconds["schedule"] * 1e6)
            self.update_us.append(self.seconds["update"] * 1e6)
            self.drafts_us.append(self.seconds["drafts"] * 1e6)
            self.tokens.append(so.total_num_scheduled_tokens)
            if self.sp is not None:
                planned = self.sp.planned
                self.k.append(sum(planned.values()) / len(planned) if planned else 0.0)
            else:
                self.k.append(so.num_spec_tokens_to_schedule)

    def sums(self):
        return [a + b for a, b in zip(self.sched_us, self.update_us)]


def q(xs, f):
    return sorted(xs)[int(f * (len(xs) - 1))]


def run_batch(model, batch, steps, warmup, async_scheduling, seed):
    max_tokens = (warmup + steps + 5) * (K + 1)  # no request finishes
    rng = np.random.default_rng(seed)
    alphas = rng.uniform(0.1, 0.95, size=batch)
    ids = [f"req-{i}" for i in range(batch)]
    would = {rid: np.random.default_rng([seed, i]).geometric(1.0 - alphas[i],
                                                             size=warmup + steps + 5) - 1
             for i, rid in enumerate(ids)}
    arms = []
    for name, plugin in (("vllm", False), ("plugin", True)):
        sched, profile = build_scheduler(model, batch, max_tokens, plugin, async_scheduling)
        for rid in ids:
            sched.add_request(make_request(rid, max_tokens, prompt_len=PROMPT_LEN))
        # The n-th verification of a request accepts (at most) its n-th draw.
        accepts = {rid: (lambda offered, it=iter(would[rid]): next(it)) for rid in ids}
        arms.append(Arm(name, sched, profile, accepts))
    for i in range(warmup + steps):
        for arm in arms:
            arm.step(record=i >= warmup)
        if (i + 1) % 100 == 0:
            print(f"  batch {batch}: step {i + 1}/{warmup + steps}", flush=True)
    for arm in arms:
        assert len(arm.sched.running) == batch, "the batch did not stay full"
    sp = arms[1].sp
    assert sp.faults == 0, f"{sp.faults} controller faults"
    return arms


def print_table(results):
    head = (f"{'batch':>5} {'arm':>7} | {'schedule us':>13} | {'update us':>13} | "
            f"{'sum us':>13} | {'drafts us':>9} | {'mean K':>6} | {'tokens/step':>11}")
    print(head)
    print(f"{'':>5} {'':>7} | {'median   p90':>13} | {'median   p90':>13} | "
          f"{'median   p90':>13} | {'median':>9} | {'':>6} | {'':>11}")
    print("-" * len(head))
    med = statistics.median
    for batch, (v, p) in results:
        for arm in (v, p):
            print(f"{batch:>5} {arm.name:>7} | {med(arm.sched_us):6.0f} {q(arm.sched_us, .9):6.0f} | "
                  f"{med(arm.update_us):6.0f} {q(arm.update_us, .9):6.0f} | "
                  f"{med(arm.sums()):6.0f} {q(arm.sums(), .9):6.0f} | "
                  f"{med(arm.drafts_us):9.0f} | {np.mean(arm.k):6.2f} | "
                  f"{np.mean(arm.tokens):11.1f}")
        paired = [b - a for a, b in zip(v.sums(), p.sums())]
        print(f"{batch:>5} {'added':>7} | {med(p.sched_us) - med(v.sched_us):+13.0f} | "
              f"{med(p.update_us) - med(v.update_us):+13.0f} | "
              f"{med(p.sums()) - med(v.sums()):+13.0f} | "
              f"{med(p.drafts_us) - med(v.drafts_us):+9.0f} | "
              f"paired per-step sum: median {med(paired):+.0f}, p90 {q(paired, .9):+.0f}")
    print("added = plugin median minus vLLM median; paired = median over steps of "
          "(plugin sum - vLLM sum), the arms stepping in turn.  'drafts' "
          "(update_draft_token_ids, sync only) is not in the sum.")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,8,64",
                   help="concurrent decoding requests, comma-separated (256 works, slowly)")
    p.add_argument("--steps", type=int, default=300, help="recorded steps per batch size")
    p.add_argument("--warmup", type=int, default=50, help="steps not recorded, prefill included")
    p.add_argument("--async-scheduling", action="store_true",
                   help="vLLM's AsyncScheduler and the engine's pipelined order "
                        "(vLLM's default on GPUs for draft_model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--models", default=None,
                   help="folder for the tiny models (made there if missing; default: a temp dir)")
    args = p.parse_args()
    from vllm_specplug.tools.testing import make_tiny_models

    folder = args.models or tempfile.mkdtemp(prefix="specplug-adapter-cost-")
    model = make_tiny_models(folder)["target"]
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    mode = "async" if args.async_scheduling else "sync"
    print(f"draft_model, K={K}, {mode} scheduling, {args.steps} steps after {args.warmup} "
          f"warm-up, batches {batches}", flush=True)
    results = []
    for batch in batches:
        t0 = time.perf_counter()
        print(f"batch {batch}: building schedulers ...", flush=True)
        arms = run_batch(model, batch, args.steps, args.warmup, args.async_scheduling,
                         args.seed)
        s = arms[1].sp.controller.stats
        print(f"batch {batch}: done in {time.perf_counter() - t0:.1f} s; plugin drafted "
              f"{s.drafted}, accepted {s.accepted}, probes {s.probes_sent}, in fallback at "
              f"the end {arms[1].sp.controller.num_in_fallback()}", flush=True)
        results.append((batch, arms))
    print()
    print_table(results)


if __name__ == "__main__":
    main()
