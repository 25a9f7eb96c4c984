"""What the draft's pass over a prompt or a catch-up buys (``controller/horizon.py``):
the tokens left as finished requests' lengths say, and a lone new prompt that
waits for the batch it will decode in."""

import numpy as np

from vllm_specplug.controller import ControllerSettings, SpecController, prior_profile
from vllm_specplug.controller.horizon import Horizon


def test_tokens_left_are_the_cap_until_requests_end_below_theirs():
    h = Horizon(max_k=4)
    output, left = np.array([0, 10]), np.array([64, 54])
    for _ in range(Horizon.LENGTHS):
        h.finished(60, 3)  # ran to its cap
    np.testing.assert_array_equal(h.left(output, left), left)
    for _ in range(Horizon.MIN_LENGTHS - 1):
        h.finished(19, 40)
    np.testing.assert_array_equal(h.left(output, left), left)


def test_tokens_left_are_the_mean_length_reached_past_the_output_so_far():
    h = Horizon(max_k=4)
    for _ in range(Horizon.MIN_LENGTHS):
        h.finished(19, 40)  # ended at 20 tokens, 40 below its cap
    got = h.left(np.array([0, 10, 25]), np.array([64, 54, 39]))
    # 20 tokens from the start, 10 more at 10; longer than every one: its cap.
    np.testing.assert_allclose(got, [20, 10, 39])
    for _ in range(Horizon.MIN_LENGTHS):
        h.finished(60, 3)  # ran to its cap: reaches this request's cap too
    np.testing.assert_allclose(h.left(np.array([0, 25]), np.array([64, 39])),
                               [(20 + 64) / 2, 39])
    # Never more than the cap: at 19 of 21, half reach 20, half 21.
    np.testing.assert_allclose(h.left(np.array([0, 19]), np.array([8, 2])), [8, 1.5])


def test_the_oldest_lengths_give_way():
    h = Horizon(max_k=4)
    for _ in range(Horizon.LENGTHS):
        h.finished(19, 40)
    for _ in range(Horizon.LENGTHS - Horizon.MIN_LENGTHS + 1):
        h.finished(60, 3)
    # Fewer than MIN_LENGTHS of the kept requests ended below their caps.
    np.testing.assert_array_equal(h.left(np.array([0]), np.array([64])), [64])


def _controller(draft_size_ratio=0.05):
    profile = prior_profile("cuda", draft_size_ratio, 8192, 64)
    assert profile.skips_draft_at_k0
    return SpecController(ControllerSettings(max_k=4), profile)


def _prompt_step(ctrl, rid):
    ctrl.add_request(rid)
    return ctrl.plan([rid], base_tokens=300, tokens_left=[64])


def test_a_lone_new_prompt_waits_for_its_batch_where_larger_batches_ran_lately():
    alone = _controller()
    assert _prompt_step(alone, "first").k_step > 0  # drafting pays for one request
    after_batch = _controller()
    ids = [f"r{i}" for i in range(8)]
    for i in range(3):
        after_batch.plan(ids, tokens_left=[40 - i] * 8)
    for rid in ids:
        after_batch.finish_request(rid)
    waited = _prompt_step(after_batch, "new")
    assert waited.k_step == 0 and not waited.k.any()
    assert after_batch.stats.probes_sent == 0
    # The next step knows its batch: alone, it drafts (its catch-up is the prompt).
    assert after_batch.plan(["new"], tokens_left=[63], catchup_tokens=300,
                            catchup_if_plain=301).k_step > 0
    # A decoding request among the new prompts: the step is priced as it is.
    mixed = _controller()
    mixed.plan(ids, tokens_left=[40] * 8)
    for rid in ids[1:]:
        mixed.finish_request(rid)
    mixed.add_request("late")
    assert mixed.plan(["r0", "late"], base_tokens=300, tokens_left=[39, 64]).k_step > 0


def test_a_shorter_expected_length_never_buys_a_dearer_catch_up():
    # Requests ending at 16 tokens of 64: a catch-up is spread over what is
    # left of them, so the plan drafts past it only where it pays over that.
    naive, learnt = _controller(0.2), _controller(0.2)
    for _ in range(Horizon.MIN_LENGTHS):
        learnt.horizon.finished(15, 48)
    differ = 0
    for catchup in (0, 64, 256, 1024, 2048, 4096, 8192):
        ids = [f"c{catchup}-{i}" for i in range(4)]  # new requests, none finished
        kw = dict(tokens_left=[60] * 4, catchup_tokens=catchup, catchup_if_plain=catchup + 4)
        a, b = naive.plan(ids, **kw), learnt.plan(ids, **kw)
        assert b.k.sum() <= a.k.sum(), catchup
        differ += bool(a.k_step > 0 and b.k_step == 0)
    assert differ
