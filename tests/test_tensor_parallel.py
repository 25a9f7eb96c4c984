"""Tensor parallelism (TP=2) on vLLM's CPU build, tiny models.

The adaptive scheduler runs once, in the engine core; its decisions reach
the ranks only through ``SchedulerOutput``.  With TP=2 both ranks hold half
of every layer of the target *and* of the draft, so the zero-cost fallback's
skip / catch-up must happen identically on both, or the collectives of the
next draft pass would hang or the draft KV of one rank would hold holes.

Checked here, with the target as its own (perfect) draft:
- greedy output at TP=2 equals plain decoding at TP=1, token for token;
- drafted tokens climb to the ceiling, as at TP=1;
- forced into fallback and released, every request's acceptance is as if it
  had never left (so each rank's catch-up repaired its own half of the KV);
- both ranks report the same skip / draft / catch-up counters.

This machine has one NUMA node: vLLM's automatic thread binding refuses TP=2,
so each rank is pinned to one core (``VLLM_CPU_OMP_THREADS_BIND="0|1"``).
"""

import os

import pytest

from conftest import (CEILING, acceptance, greedy, make_llm, plain_token_ids,
                      run_with_forced_fallback, scheduler_of, shutdown, token_ids)
from helpers import prompt
from vllm_specplug.tools.testing import worker_draft_stats

TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
PROMPTS = [prompt(i) for i in range(4)]


@pytest.fixture(scope="module")
def plain(tiny_models):
    return dict(zip(PROMPTS, plain_token_ids(tiny_models["target"], PROMPTS, 96)))


@pytest.fixture(scope="module")
def tp2(tiny_models, plain):
    """Target and draft both at TP=2; the engine core (and so the scheduler)
    stays in this process, the two workers are spawned."""
    saved = {k: os.environ.get(k) for k in TP_ENV}
    os.environ.update(TP_ENV)
    try:
        llm = make_llm(tiny_models["target"], tensor_parallel_size=2,
                       distributed_executor_backend="mp",
                       speculative={"method": "draft_model", "model": tiny_models["target"],
                                    "num_speculative_tokens": CEILING})
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield llm
    shutdown(llm)


def rank_stats(llm):
    return sorted(llm.collective_rpc(worker_draft_stats), key=lambda s: s["rank"])


def test_draft_runs_at_the_target_tp(tp2):
    spec = tp2.llm_engine.vllm_config.speculative_config
    assert tp2.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 2
    assert spec.draft_parallel_config.tensor_parallel_size == 2
    sched = scheduler_of(tp2).specplug
    assert sched.enabled and not sched.k_step_pinned and sched.zero_cost.on


def test_greedy_equal_and_drafts_climb(tp2, plain):
    outs = tp2.generate(PROMPTS, greedy(96), use_tqdm=False)
    assert token_ids(outs) == [plain[p] for p in PROMPTS]
    for o in outs:
        drafted = list(o.outputs[0].spec_decode_metrics.per_step_drafted)
        assert max(drafted) == CEILING
        assert sum(drafted[-8:]) / 8 >= CEILING - 0.5, drafted
    stats = rank_stats(tp2)
    assert [s["rank"] for s in stats] == [0, 1]
    assert all(s["zero_cost_fallback"] for s in stats)


def test_fallback_and_catch_up_identical_on_both_ranks(tp2, plain):
    before = rank_stats(tp2)
    outs = run_with_forced_fallback(tp2, PROMPTS, CEILING)  # 24 steps at ceiling 0
    assert token_ids(outs) == [plain[p] for p in PROMPTS]

    after = rank_stats(tp2)
    deltas = [{k: a["stats"][k] - b["stats"][k] for k in a["stats"]}
              for a, b in zip(after, before)]
    print("per-rank zero-cost-fallback counters this run:", deltas)
    assert deltas[0] == deltas[1], "the ranks skipped or caught up differently"
    assert deltas[0]["skipped_passes"] >= 20
    assert deltas[0]["catch_up_tokens"] > 0
    rates = [acceptance(o) for o in outs]
    print("acceptance per request after the forced fallback:", rates)
    assert min(rates) >= 0.97


def test_per_request_ceilings_at_tp2(tp2, plain):
    caps = [0, 1, CEILING, 2]
    params = [greedy(64, extra_args={"specplug_max_k": c}) for c in caps]
    outs = tp2.generate(PROMPTS, params, use_tqdm=False)
    assert token_ids(outs) == [plain[p][:64] for p in PROMPTS]
    for o, cap in zip(outs, caps):
        m = o.outputs[0].spec_decode_metrics
        drafted = list(m.per_step_drafted) if m is not None else []
        assert max(drafted, default=0) <= cap
