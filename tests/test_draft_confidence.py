"""The draft-confidence stop (``patches/draft_confidence.py``) on real vLLM, CPU.

The worker stops the draft loop where the stop rule says so and reports the
confidences; the scheduler offers only the drafts worth verifying and
calibrates.  Greedy output is compared with plain decoding on every path,
with stops forced at every position and with nothing kept at all.
"""

import numpy as np
import pytest

from conftest import (count_forwards, draft_model, drafted_per_step, drafter_of, greedy, make_llm,
                      plain_token_ids, scheduler_of, shutdown, token_ids)
from vllm_specplug.controller import SpecController
from vllm_specplug.controller.confidence import DraftStopper
from helpers import prompt

CEILING = 4
PROMPTS = [prompt(i) for i in range(4)]


@pytest.fixture(scope="module")
def plain(tiny_models):
    return plain_token_ids(tiny_models["target"], PROMPTS, 64)


@pytest.fixture(scope="module")
def perfect(tiny_models, plain):
    """The target as its own draft: confident, and always right."""
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]),
                   specplug={"draft_confidence": True})
    yield llm
    shutdown(llm)


def test_the_worker_reports_its_confidence_and_the_scheduler_calibrates(perfect, plain):
    outs = perfect.generate(PROMPTS, greedy(64), use_tqdm=False)
    assert token_ids(outs) == plain
    sp = scheduler_of(perfect).specplug
    assert sp.confidence.allowed and sp.confidence.worker_on
    accepted, verified = sp.controller.calibration.observed()
    assert verified.sum() > 20
    # A perfect draft: every verified draft was accepted.
    assert accepted.sum() == pytest.approx(verified.sum())
    assert max(max(drafted_per_step(o)) for o in outs) == CEILING


@pytest.mark.parametrize("stop_at", [1, 2, 3])
def test_stops_forced_at_every_position_keep_output_exact(perfect, plain, monkeypatch, stop_at):
    original = DraftStopper.after_position

    def forced(self, confidence):
        go_on = original(self, confidence)
        return go_on and self.position < stop_at

    monkeypatch.setattr(DraftStopper, "after_position", forced)
    drafter = drafter_of(perfect)
    calls, handle = count_forwards(drafter.model)
    before = drafter.specplug_stats.draft_passes, drafter.specplug_stats.catch_up_passes
    try:
        outs = perfect.generate(PROMPTS, greedy(64), use_tqdm=False)
    finally:
        handle.remove()
    assert token_ids(outs) == plain
    stats = drafter.specplug_stats
    steps = stats.draft_passes - before[0]
    # The loop ended at the forced position: no step ran more draft passes.
    assert calls[0] <= steps * stop_at + stats.catch_up_passes - before[1]
    offered = [d for o in outs for d in drafted_per_step(o)]
    assert max(offered) == stop_at


def test_a_stop_that_keeps_nothing_offers_no_draft(perfect, plain, monkeypatch):
    original = SpecController.stop_rule

    def nothing_pays(self, decision):
        rule = original(self, decision)
        if rule is not None:
            rule.slot_cuts = np.full(1, 2.0)  # no survival reaches it
        return rule

    monkeypatch.setattr(SpecController, "stop_rule", nothing_pays)
    drafter = drafter_of(perfect)
    calls, handle = count_forwards(drafter.model)
    before = drafter.specplug_stats.draft_passes
    try:
        outs = perfect.generate(PROMPTS, greedy(48), use_tqdm=False)
    finally:
        handle.remove()
    assert token_ids(outs) == [p[:48] for p in plain]
    assert all(d == 0 for o in outs for d in drafted_per_step(o))
    # One pass per drafting step (the first), then the loop ended.
    assert calls[0] <= drafter.specplug_stats.draft_passes - before + \
        drafter.specplug_stats.catch_up_passes


def test_a_poor_draft_with_the_stop_is_exact(tiny_models, plain):
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["draft_bad"]),
                   specplug={"draft_confidence": True})
    try:
        outs = llm.generate(PROMPTS, greedy(64), use_tqdm=False)
        assert token_ids(outs) == plain
    finally:
        shutdown(llm)


def test_turned_off_it_sends_no_rule(tiny_models, plain):
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]),
                   specplug={"draft_confidence": False})
    try:
        outs = llm.generate(PROMPTS, greedy(32), use_tqdm=False)
        assert token_ids(outs) == [p[:32] for p in plain]
        sp = scheduler_of(llm).specplug
        assert not sp.confidence.allowed
        assert sp.controller.calibration.observed()[1].sum() == 0
    finally:
        shutdown(llm)


def test_off_the_cpu_runner_the_worker_hooks_nothing(monkeypatch):
    """On a GPU runner (not checked) the worker sends no report, so the
    scheduler never sends a rule: the draft loop is vLLM's."""
    from vllm_specplug import deployment
    from vllm_specplug.patches import draft_confidence

    monkeypatch.setattr(deployment, "_on_cpu", lambda: False)
    monkeypatch.setattr(draft_confidence, "_WARNED", [])
    hooked = []
    monkeypatch.setattr(draft_confidence, "_hook_runner", lambda r, p: hooked.append(r))

    class Runner:
        def propose_draft_token_ids(self, *a):
            pass

        def sample_tokens(self, *a):
            pass

    class Proposer:
        def __init__(self, vllm_config, device, runner=None):
            pass

    monkeypatch.setattr(draft_confidence, "_INIT_SIGNATURE",
                        __import__("inspect").signature(Proposer.__init__))
    init = draft_confidence._wrap_init(Proposer.__init__)
    p = Proposer.__new__(Proposer)
    init(p, None, "cpu", runner=Runner())
    assert hooked == [] and draft_confidence._WARNED == [True]
    monkeypatch.setattr(deployment, "_on_cpu", lambda: True)
    init(p, None, "cpu", runner=Runner())
    assert len(hooked) == 1
