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
0.05, ...)`` (a draft 5% of the target, run at K_step = 0 as on a GPU),
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

K = 8  # num_speculative_tokens: vLLM's K and the plugin's ceiling
PROMPT_LEN = 20
BLOCK = 32
TOKEN = 7  # every synthetic sample; the tiny vocabulary has it


def build_scheduler(model, batch, max_tokens, plugin, async_scheduling):
    """vLLM's scheduler (``plugin=False``) or the plugin's, on one config."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_specplug import AdaptiveSpecScheduler
    from vllm_specplug.controller import SpecController, prior_profile

    max_len = -(-(PROMPT_LEN + max_tokens + 2 * (K + 1)) // BLOCK) * BLOCK
    max_batched = max(8192, batch * (PROMPT_LEN + K + 1))  # prefill in one step
    args = EngineArgs(
        model=model,
        speculative_config={"method": "draft_model", "model": model,
                            "num_speculative_tokens": K},
        max_model_len=max_len,
        max_num_seqs=batch,
        max_num_batched_tokens=max_batched,
        block_size=BLOCK,
        enforce_eager=True,
        dtype="float32",
        # Block hashing needs the engine's hasher; not what is measured here.
        enable_prefix_caching=False,
        additional_config={"specplug": {}},
    )
    vllm_config = args.create_engine_config()
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    num_blocks = batch * (max_len // BLOCK + 1) + 1
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(
            ["layer.0"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16,
                                           dtype=torch.float32))],
    )
    cls = (AdaptiveSpecScheduler if plugin else
           AsyncScheduler if async_scheduling else Scheduler)
    sched = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                structured_output_manager=StructuredOutputManager(vllm_config),
                block_size=BLOCK)
    if plugin:
        sp = sched.specplug
        assert sp.enabled, sp.reason
        # A fixed profile: what an H200-class GPU prior says, no start-up measurement.
        sp.profile = prior_profile("cuda", 0.05, max_batched, batch, draft_runs_at_k0=True)
        sp.controller = SpecController(sp.controller.settings, sp.profile)
    return sched


def make_request(req_id, max_tokens):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(req_id, [TOKEN + (i % 5) for i in range(PROMPT_LEN)], params, None)


class Arm:
    """One scheduler driven the way EngineCore drives it, with a fake model."""

    def __init__(self, name, sched, would_accept):
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        self.name, self.sched = name, sched
        self.would_accept = would_accept  # rid -> accepted-prefix length per verification
        self.verified = dict.fromkeys(would_accept, 0)
        self.is_async = isinstance(sched, AsyncScheduler)
        sp = getattr(sched, "specplug", None)
        self.sp = sp if sp is not None and sp.enabled else None
        self.now = 0.0
        if self.sp is not None:
            # The step time the plugin measures: the profile's price of the step.
            self.sp.clock = lambda: self.now
        self.pending = None
        self.sched_us, self.update_us, self.drafts_us = [], [], []
        self.k, self.tokens = [], []

    def model_output(self, so):
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            if self.sched.requests[rid].is_prefill_chunk:
                sampled.append([])
                continue
            spec = so.scheduled_spec_decode_tokens.get(rid, [])
            a = 0
            if spec:
                n = self.verified[rid]
                self.verified[rid] = n + 1
                a = min(int(self.would_accept[rid][n]), len(spec))
            sampled.append([TOKEN] * (a + 1))
        return ModelRunnerOutput(req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)

    def update(self, so, out):
        """``update_from_output``, timed; the synthetic step time passes first."""
        if self.sp is not None:
            self.now += self.sp.controller.profile.step(
                so.total_num_scheduled_tokens, len(so.num_scheduled_tokens),
                so.num_spec_tokens_to_schedule)
        t0 = time.perf_counter()
        self.sched.update_from_output(so, out)
        return time.perf_counter() - t0

    def step(self, record=True):
        from vllm.v1.outputs import DraftTokenIds

        sched = self.sched
        t0 = time.perf_counter()
        so = sched.schedule()
        t_sched = time.perf_counter() - t0
        t_update = t_drafts = 0.0
        if self.is_async:
            # The worker runs step t+1 while the engine processes step t's output.
            out = self.model_output(so) if so.total_num_scheduled_tokens else None
            if self.pending is not None:
                t_update = self.update(*self.pending)
            self.pending = (so, out) if out is not None else None
        else:
            if so.total_num_scheduled_tokens:
                t_update = self.update(so, self.model_output(so))
            k = so.num_spec_tokens_to_schedule
            if k:
                decoding = [r for r in so.num_scheduled_tokens
                            if r in sched.requests and not sched.requests[r].is_finished()]
                drafts = DraftTokenIds(decoding, [[TOKEN] * k for _ in decoding])
                t0 = time.perf_counter()
                sched.update_draft_token_ids(drafts)
                t_drafts = time.perf_counter() - t0
        if record:
            self.sched_us.append(t_sched * 1e6)
            self.update_us.append(t_update * 1e6)
            self.drafts_us.append(t_drafts * 1e6)
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
        sched = build_scheduler(model, batch, max_tokens, plugin, async_scheduling)
        for rid in ids:
            sched.add_request(make_request(rid, max_tokens))
        arms.append(Arm(name, sched, would))
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
