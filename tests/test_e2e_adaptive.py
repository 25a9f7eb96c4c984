"""The adaptive scheduler end to end on real vLLM (CPU) with tiny models.

Every test compares greedy output with plain decoding token for token, and
reads per-step drafted/accepted counts from vLLM's own per-request
spec-decode metrics (``detailed``).
"""

import logging

import numpy as np
import pytest

from conftest import (CEILING, count_preemptions, draft_model, drafted_per_step, greedy, make_llm,
                      plain_token_ids, scheduler_of, shutdown, token_ids)
from helpers import prompt

PROMPTS = [prompt(i) for i in range(6)]
LONG = 96


@pytest.fixture(scope="module")
def plain(tiny_models):
    return {"prompts": plain_token_ids(tiny_models["target"], PROMPTS, LONG)}


def test_good_draft_climbs_to_ceiling_and_ceiling_zero_never_drafts(tiny_models, plain):
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]))
    try:
        sched = scheduler_of(llm)
        assert type(sched).__name__ == "AdaptiveSpecScheduler"
        # One request at a time: the memory-light regime where drafts pay.
        outs = [llm.generate([p], greedy(LONG), use_tqdm=False)[0] for p in PROMPTS[:2]]
        for o in outs:
            steps = drafted_per_step(o)
            assert max(steps) == CEILING
            late = steps[len(steps) // 2:]
            assert np.mean(late) >= CEILING - 1, steps
        print("good draft, drafted per step:", [drafted_per_step(o) for o in outs])
        # Now the whole batch, a third of it with a per-request ceiling of 0.
        params = [greedy(LONG, extra_args={"specplug_max_k": 0}) if i % 3 == 0 else greedy(LONG)
                  for i in range(len(PROMPTS))]
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert token_ids(outs) == plain["prompts"]
        for i, o in enumerate(outs):
            m = o.outputs[0].spec_decode_metrics
            if i % 3 == 0:
                assert m is None or m.num_draft_tokens == 0
            else:
                # (No drafts at all is within the ceiling: a batch of six
                # may well not pay for them on this CPU.)
                assert m is None or max(m.per_step_drafted, default=0) <= CEILING
        assert sched.specplug.controller.num_requests() == 0, "state leaked"
        # A per-request ceiling of 1 caps drafts at 1.
        o = llm.generate([PROMPTS[1]], greedy(LONG, extra_args={"specplug_max_k": 1}),
                         use_tqdm=False)[0]
        assert max(drafted_per_step(o)) == 1
        assert list(o.outputs[0].token_ids) == plain["prompts"][1]
    finally:
        shutdown(llm)


def test_bad_request_args_are_rejected_not_fatal(tiny_models):
    # vLLM's front end turns our ValueError into its validation error
    # (HTTP 400 on the server).
    from vllm.exceptions import VLLMValidationError

    rejected = (ValueError, VLLMValidationError)
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]))
    try:
        for bad in (-1, "2", 2.5, True, float("nan"), 10**9):
            with pytest.raises(rejected, match="specplug_max_k"):
                llm.generate([PROMPTS[0]], greedy(4, extra_args={"specplug_max_k": bad}),
                             use_tqdm=False)
        with pytest.raises(rejected, match="unknown per-request key"):
            llm.generate([PROMPTS[0]], greedy(4, extra_args={"specplug_mak_k": 1}),
                         use_tqdm=False)
        # The engine still serves.
        assert len(llm.generate([PROMPTS[0]], greedy(4), use_tqdm=False)[0].outputs[0].token_ids) == 4
    finally:
        shutdown(llm)


def test_bad_draft_falls_back_and_reprobes(tiny_models, plain):
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["draft_bad"]))
    try:
        outs = llm.generate(PROMPTS, greedy(LONG), use_tqdm=False)
        assert token_ids(outs) == plain["prompts"]
        stats = scheduler_of(llm).specplug.controller.stats
        print("bad draft:", stats)
        for o in outs:
            steps = drafted_per_step(o)
            # Verify steps are the probes: few, short, and spread out.
            assert len(steps) < LONG // 4, steps
        assert stats.probes_sent >= len(PROMPTS)
        assert stats.fallback_request_steps / stats.request_steps > 0.7
        assert stats.accepted / max(stats.drafted, 1) < 0.2
    finally:
        shutdown(llm)


def test_controller_fault_falls_back_to_vllm_and_output_stays_exact(tiny_models, plain, caplog):
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]))
    try:
        sched = scheduler_of(llm)

        def broken(*args, **kwargs):
            raise RuntimeError("injected controller fault")

        sched.specplug.controller.plan = broken
        sched.specplug.controller.observe_verifications = broken
        with caplog.at_level(logging.ERROR, logger="vllm.specplug"):
            outs = llm.generate(PROMPTS, greedy(LONG), use_tqdm=False)
        assert token_ids(outs) == plain["prompts"]
        assert sched.specplug.faults > 10
        errors = [r for r in caplog.records if "controller failed" in r.getMessage()]
        assert len(errors) == 1
        # vLLM's own behaviour (static K) served the requests meanwhile.
        assert max(max(drafted_per_step(o)) for o in outs) == CEILING
    finally:
        shutdown(llm)


def test_preemption_with_small_kv_cache_keeps_output_exact(tiny_models, plain):
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]),
                   num_gpu_blocks_override=12, block_size=32, max_num_seqs=8,
                   max_model_len=256)
    try:
        sched = scheduler_of(llm)
        preemptions = count_preemptions(sched)
        outs = llm.generate(PROMPTS, greedy(LONG), use_tqdm=False)
        assert preemptions, "the KV cache was not small enough to force preemption"
        assert token_ids(outs) == plain["prompts"]
        assert sched.specplug.controller.num_requests() == 0
    finally:
        shutdown(llm)
