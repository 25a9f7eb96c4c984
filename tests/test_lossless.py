"""Losslessness: every policy's greedy output equals plain decoding.

320 varied requests in one batch per engine: prompt lengths from 1
token to near ``max_model_len``, ``max_tokens`` from 1, stop strings,
logprobs, per-request ceilings, structured output (a regex grammar; vLLM
0.32 on CPU accepts it with speculation but drafts nothing for those
requests, with or without the plugin), with chunked prefill (small token budget),
prefix caching (shared prefixes) and preemption (a small KV cache) all on,
and requests aborted mid-way through vLLM's engine API.
"""

import random

import pytest

from conftest import CEILING, count_preemptions, make_llm, scheduler_of, shutdown
from vllm_specplug.tools.testing import VOCAB_WORDS

MAX_MODEL_LEN = 256
ENGINE = dict(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=96, block_size=32,
              num_gpu_blocks_override=24, enable_prefix_caching=True, max_num_seqs=16)


def words(rng, n):
    return " ".join(f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(n))


def build_requests(n=320, seed=0):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    rng = random.Random(seed)
    shared = words(rng, 70)  # a shared prefix: prefix-cache hits across requests
    reqs = []
    for i in range(n):
        kind = i % 8
        if kind == 0:
            prompt = words(rng, rng.randint(1, 3))
        elif kind == 1:
            prompt = shared + " " + words(rng, rng.randint(1, 20))
        elif kind == 2:  # near max_model_len: generation stops at the length limit
            prompt = words(rng, MAX_MODEL_LEN - rng.randint(3, 12))
        else:
            prompt = words(rng, rng.randint(4, 120))
        max_tokens = 1 if i % 11 == 0 else rng.randint(2, 32)
        kw = dict(temperature=0.0, max_tokens=max_tokens)
        if i % 5 == 0:
            kw["stop"] = [f"w{rng.randrange(VOCAB_WORDS)}", f"w{rng.randrange(VOCAB_WORDS)}"]
        if i % 7 == 0:
            kw["logprobs"] = 2
        if i % 9 == 0:
            kw["extra_args"] = {"specplug_max_k": rng.randint(0, CEILING)}
        if i % 13 == 6:
            # Structured output (xgrammar).  The word-level tokenizer's
            # tokens are "w<i>" with no spaces, so grammars are written over
            # those; JSON is not expressible in this vocabulary.
            kw["structured_outputs"] = StructuredOutputsParams(
                regex="(w1|w2|w3|w4|w5|w6|w7|w8){1,%d}" % max(max_tokens, 1))
        reqs.append((prompt, SamplingParams(**kw)))
    return reqs


def outputs_of(llm, reqs):
    outs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)
    return [[(list(c.token_ids), c.finish_reason) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def requests_and_plain(tiny_models):
    reqs = build_requests()
    plain_reqs = [(p, sp.clone()) for p, sp in reqs]
    for _, sp in plain_reqs:
        sp.extra_args = None
    llm = make_llm(tiny_models["target"], **ENGINE)
    ref = outputs_of(llm, plain_reqs)
    shutdown(llm)
    return reqs, ref


@pytest.mark.parametrize("policy", ["goodput", "static", "heuristic"])
def test_every_policy_is_lossless_under_stress(tiny_models, requests_and_plain, policy):
    reqs, ref = requests_and_plain
    # A draft that is right half the time at best: acceptance varies by
    # request and by position, so every code path (partial acceptance,
    # fallback, probes) runs.
    spec = {"method": "draft_model", "model": tiny_models["target"] if policy != "goodput"
            else tiny_models["draft_bad"], "num_speculative_tokens": CEILING}
    llm = make_llm(tiny_models["target"], speculative=spec, specplug={"policy": policy},
                   **ENGINE)
    try:
        sched = scheduler_of(llm)
        preempted = count_preemptions(sched)
        got = outputs_of(llm, reqs)
        mismatched = [i for i, (g, r) in enumerate(zip(got, ref)) if g != r]
        assert not mismatched, f"{len(mismatched)} requests differ, first {mismatched[:5]}"
        structured = [i for i, (_, sp) in enumerate(reqs) if sp.structured_outputs is not None]
        allowed = {f"w{j}" for j in range(1, 9)}
        for i in structured:  # the grammar held (and output is plain decoding's)
            text = llm.get_tokenizer().convert_ids_to_tokens(got[i][0][0])
            assert set(text) <= allowed | {"</s>"}, (i, text)
        assert preempted, "the KV cache was not small enough to force preemption"
        assert sched.specplug.controller.num_requests() == 0
    finally:
        shutdown(llm)


def test_refused_combinations_get_vllms_own_error(tiny_models):
    # vLLM refuses n > 1 with greedy sampling; with the plugin the error is
    # the same, raised before anything reaches the engine.
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    spec = {"method": "draft_model", "model": tiny_models["target"],
            "num_speculative_tokens": CEILING}
    llm = make_llm(tiny_models["target"], speculative=spec, **ENGINE)
    try:
        with pytest.raises(VLLMValidationError, match="n must be 1"):
            llm.generate(["w1 w2"], SamplingParams(temperature=0.0, n=2, max_tokens=4),
                         use_tqdm=False)
        assert llm.generate(["w1 w2"], SamplingParams(temperature=0.0, max_tokens=4),
                            use_tqdm=False)[0].outputs[0].token_ids
    finally:
        shutdown(llm)


def test_aborted_requests_leave_others_exact_and_no_state(tiny_models, requests_and_plain):
    reqs, ref = requests_and_plain
    spec = {"method": "draft_model", "model": tiny_models["target"],
            "num_speculative_tokens": CEILING}
    llm = make_llm(tiny_models["target"], speculative=spec, **ENGINE)
    try:
        engine = llm.llm_engine
        chosen = list(range(0, 64))
        for i in chosen:
            prompt, sp = reqs[i]
            engine.add_request(str(i), prompt, sp)
        aborted = {str(i) for i in chosen if i % 4 == 1}
        finished = {}
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = [(list(c.token_ids), c.finish_reason)
                                                for c in out.outputs]
            steps += 1
            if steps == 3:
                engine.abort_request(list(aborted))
        for rid, got in finished.items():
            if rid not in aborted:
                assert got == ref[int(rid)], rid
        assert len([r for r in finished if r not in aborted]) == len(chosen) - len(aborted)
        assert scheduler_of(llm).specplug.controller.num_requests() == 0
    finally:
        shutdown(llm)
