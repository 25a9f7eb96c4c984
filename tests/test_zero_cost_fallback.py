"""Zero-cost fallback (``patches/draft_model_skip.py``) on real vLLM, CPU.

At K_step=0 the draft model must not run; when drafting resumes it must
first repair its KV cache (catch-up), so acceptance is as high as if it had
never stopped.  The repair is shown by a perfect draft (the target itself):
with intact draft KV every draft is accepted, with holes in it the draft
disagrees.  Each repair test also runs once with the catch-up switched off,
to show the check can fail.  Greedy output is compared with plain decoding
everywhere.
"""

import pytest

from conftest import (acceptance, count_forwards, draft_model, drafter_of, greedy, make_llm,
                      plain_token_ids, run_with_forced_fallback, scheduler_of, shutdown, token_ids)
from vllm_specplug.patches import draft_model_skip
from helpers import prompt

CEILING = 4


@pytest.fixture(scope="module")
def plain(tiny_models):
    prompts = [prompt(i) for i in range(4)] + [prompt(9, length=200)]
    return dict(zip(prompts, plain_token_ids(tiny_models["target"], prompts, 96)))


@pytest.fixture(scope="module")
def perfect(tiny_models):
    """An engine whose draft is the target: every draft should be accepted."""
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]))
    llm.generate([prompt(0)], greedy(4), use_tqdm=False)  # the drafter's first call
    yield llm
    shutdown(llm)


def test_random_draft_stops_running_in_fallback(tiny_models, plain):
    # The measured profile (a random draft falls back on any price).
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["draft_bad"]),
                   specplug={"profile": "auto"})
    try:
        drafter = drafter_of(llm)
        # The draft does not run at K_step=0: the profile was measured skipping it.
        assert scheduler_of(llm).specplug.profile.meta["zero_cost_fallback"] is True
        calls, _ = count_forwards(drafter.model)
        prompts = [prompt(i) for i in range(4)]
        outs = llm.generate(prompts, greedy(96), use_tqdm=False)
        assert token_ids(outs) == [plain[p] for p in prompts]
        stats = drafter.specplug_stats
        print("random draft:", stats, "forward calls", calls[0])
        # ~97 steps; the controller gives up after a step or two and only
        # probes with back-off, so almost every step skips the draft.
        assert stats.skipped_passes >= 80
        # Every forward is a drafting step's passes or a catch-up pass.
        assert calls[0] <= stats.draft_passes * CEILING + stats.catch_up_passes
        before = calls[0]
        # A request with ceiling 0 alone: the draft model never runs at all.
        out = llm.generate([prompts[0]], greedy(48, extra_args={"specplug_max_k": 0}),
                           use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == plain[prompts[0]][:48]
        assert calls[0] == before
    finally:
        shutdown(llm)


@pytest.mark.parametrize("catch_up", [True, False], ids=["catch-up", "no-catch-up"])
def test_catch_up_repairs_the_draft_kv(perfect, plain, monkeypatch, catch_up):
    drafter = drafter_of(perfect)
    if not catch_up:
        monkeypatch.setattr(draft_model_skip, "_catch_up", lambda *a, **k: None)
    before = draft_model_skip.DraftSkipStats(**vars(drafter.specplug_stats))
    prompts = [prompt(i) for i in range(4)]
    outs = run_with_forced_fallback(perfect, prompts, CEILING)
    assert token_ids(outs) == [plain[p] for p in prompts]
    stats = drafter.specplug_stats
    assert stats.skipped_passes - before.skipped_passes >= 20
    rates = [acceptance(o) for o in outs]
    print(f"catch_up={catch_up}: acceptance per request {rates}, "
          f"catch-up tokens {stats.catch_up_tokens - before.catch_up_tokens}")
    if catch_up:
        assert stats.catch_up_tokens > before.catch_up_tokens
        # As if the requests had never left speculation: a perfect draft.
        assert min(rates) >= 0.97
    else:
        # Without the repair the draft reads holes in its KV and disagrees:
        # the check above can fail.
        assert min(rates) < 0.9


@pytest.mark.parametrize("catch_up", [True, False], ids=["catch-up", "no-catch-up"])
def test_prefix_cached_blocks_from_a_skipping_request_are_repaired(perfect, plain,
                                                                   monkeypatch, catch_up):
    """A request in fallback fills prefix-cache blocks without draft KV; a
    later request with the same prompt gets them from the cache and must not
    draft from the holes."""
    if not catch_up:
        monkeypatch.setattr(draft_model_skip, "_catch_up", lambda *a, **k: None)
    long_prompt = prompt(9, length=200)
    perfect.reset_prefix_cache()
    off = perfect.generate([long_prompt], greedy(8, extra_args={"specplug_max_k": 0}),
                           use_tqdm=False)[0]
    assert list(off.outputs[0].token_ids) == plain[long_prompt][:8]
    assert off.num_cached_tokens == 0
    out = perfect.generate([long_prompt], greedy(96), use_tqdm=False)[0]
    assert out.num_cached_tokens >= 128, "the second request should hit the prefix cache"
    assert list(out.outputs[0].token_ids) == plain[long_prompt]
    rate = acceptance(out)
    print(f"catch_up={catch_up}: acceptance after a cached prefix {rate}")
    if catch_up:
        assert rate >= 0.97
    else:
        assert rate < 0.9


def test_switch_off_keeps_vllms_first_pass(tiny_models, plain):
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["draft_bad"]),
                   specplug={"zero_cost_fallback": False, "profile": "auto"})
    try:
        drafter = drafter_of(llm)
        # vLLM's first pass runs at K_step=0 too, and the profile was
        # measured that way: the pass belongs to the K_step=0 step.
        prof = scheduler_of(llm).specplug.profile
        assert prof.meta.get("zero_cost_fallback") is False
        calls, _ = count_forwards(drafter.model)
        prompts = [prompt(i) for i in range(2)]
        outs = llm.generate(prompts, greedy(48), use_tqdm=False)
        assert token_ids(outs) == [plain[p][:48] for p in prompts]
        assert drafter.specplug_stats.skipped_passes == 0
        assert calls[0] >= 48  # the first pass ran every step
    finally:
        shutdown(llm)


def test_a_failing_catch_up_turns_the_fallback_off_and_output_stays_exact(
        tiny_models, plain, monkeypatch):
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]))
    try:
        drafter = drafter_of(llm)

        def broken(*args, **kwargs):
            raise RuntimeError("catch-up broke")

        monkeypatch.setattr(draft_model_skip, "_catch_up_passes", broken)
        prompts = [prompt(i) for i in range(2)]
        outs = run_with_forced_fallback(llm, prompts, CEILING)
        assert token_ids(outs) == [plain[p] for p in prompts]
        stats = drafter.specplug_stats
        assert stats.failures == 1 and stats.skipped_passes >= 20
        assert drafter.__dict__["_specplug_skip"] is False
        # The worker said so in the step's output, and the scheduler believes it:
        # no catch-up is priced or owed any more.
        sp = scheduler_of(llm).specplug
        assert sp.zero_cost.on is False and not sp.zero_cost.stale_from
        assert sp.controller.profile.meta.get("zero_cost_fallback") is False
        # From then on vLLM's own path: a second forced fallback skips nothing.
        skipped = stats.skipped_passes
        outs = run_with_forced_fallback(llm, prompts, CEILING)
        assert token_ids(outs) == [plain[p] for p in prompts]
        assert stats.skipped_passes == skipped and stats.failures == 1
    finally:
        shutdown(llm)


def test_a_rank_gives_up_when_another_rank_failed(tiny_models, plain, monkeypatch):
    """Under tensor parallelism a rank whose own step is fine still gives up
    when another rank failed to prepare it (their draft passes must match):
    here the other rank is simulated failing from the second skipped step on."""
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]))
    try:
        drafter = drafter_of(llm)

        def other_rank_fails(failed, group):
            return failed or drafter.__dict__["specplug_stats"].skipped_passes >= 1

        monkeypatch.setattr(draft_model_skip, "_any_rank_failed", other_rank_fails)
        prompts = [prompt(i) for i in range(2)]
        outs = run_with_forced_fallback(llm, prompts, CEILING)
        assert token_ids(outs) == [plain[p] for p in prompts]
        stats = drafter.specplug_stats
        assert stats.failures == 1 and stats.skipped_passes == 1
        assert stats.catch_up_passes == 0
        assert drafter.__dict__["_specplug_skip"] is False
        assert scheduler_of(llm).specplug.zero_cost.on is False
    finally:
        shutdown(llm)


def _agree(rank, path, failures, out):
    import torch.distributed as dist

    from vllm_specplug.patches.draft_model_skip import _any_rank_failed

    dist.init_process_group("gloo", init_method=f"file://{path}", world_size=2, rank=rank)
    try:
        answers = [_any_rank_failed(f[rank], dist.group.WORLD) for f in failures]
    finally:
        dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as fh:
        fh.write(" ".join(str(int(a)) for a in answers))


def test_ranks_agree_on_a_failure_through_their_cpu_group(tmp_path):
    """The agreement itself, between two processes over gloo (as vLLM's TP CPU group)."""
    import torch.multiprocessing as mp

    failures = [(False, False), (False, True), (True, False), (True, True)]
    mp.start_processes(_agree, args=(str(tmp_path / "pg"), failures, str(tmp_path / "out")),
                       nprocs=2, start_method="spawn", join=True)
    for rank in (0, 1):
        assert (tmp_path / f"out.{rank}").read_text() == "0 1 1 1"


def test_a_plain_step_is_charged_no_prompts_pass():
    """What a plain step adds to the catch-up (``ZeroCostBook.owed``), which the
    plan charges plain decoding: a decoding request the draft is current on
    owes its block back, a stale one its new token, a request whose prompt is
    in the step nothing (its prompt's pass is owed only if it ever drafts).
    Charged the prompt, plain cancelled the drafting plan's pass over it."""
    from types import SimpleNamespace

    from vllm_specplug.zero_cost import ZeroCostBook

    def req(rid, computed, prompt_tokens):
        return SimpleNamespace(request_id=rid, num_computed_tokens=computed,
                               num_prompt_tokens=prompt_tokens)

    book = ZeroCostBook(on=True, block_size=16)
    requests = {"new": req("new", 100, 100),       # its whole prompt this step
                "fresh": req("fresh", 101, 100),   # decoding, the draft current
                "chunk": req("chunk", 64, 100)}    # a fresh prompt's second chunk
    assert book.owed(requests, {"new": 100}) == (0, 0)
    assert book.owed(requests, {"chunk": 32}) == (0, 0)
    assert book.owed(requests, {"fresh": 1}) == (0, 101 - 96)
    book.stale_from.update(fresh=40, chunk=0)  # skipped before
    # Stale: a plain step adds its new token; a stale prompt owes what it owed.
    assert book.owed(requests, {"fresh": 1}) == (100 - 32, 101 - 32)
    assert book.owed(requests, {"chunk": 32}) == (32, 32)
    assert book.owed(requests, {"new": 100, "fresh": 1, "chunk": 32}) == (100, 101)
    assert ZeroCostBook(on=False, block_size=16).owed(requests, {"new": 100}) == (0, None)
