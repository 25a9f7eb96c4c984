"""A plan's verify prices: non-decreasing and convex in the drafts verified,
so one noisy profile point cannot price one place in every step."""

import numpy as np

from vllm_specplug.controller import GoodputPolicy, StepPricer, StepProfile
from vllm_specplug.controller.profile import convex_rise

# The Qwen pair's start-up profile as the grid's adaptive arm measured it:
# one verified token 0.197 s, two 0.266 s, nine 0.201 s (a point a repeat
# does not reproduce: vLLM's static K's served steps show no such jump).
NOISY = StepProfile(tokens=[1, 2, 4, 9, 18, 36], target_s=[0.197, 0.266, 0.205, 0.201, 0.26, 0.40],
                    first_s=[0.0] * 6, batch=[1, 4], pass_s=[0.05, 0.06],
                    meta={"source": "test", "platform": "cpu"})
LINEAR = StepProfile(tokens=[1, 64], target_s=[0.1, 0.1 + 63 * 0.01], first_s=[0.02, 0.02],
                     batch=[1, 4], pass_s=[0.05, 0.06], meta={"source": "test", "platform": "cpu"})


def by_n(profile, batch=1, width=8):
    return GoodputPolicy().prices(batch, width, float(batch), StepPricer(profile)).by_n


def test_a_noisy_point_is_spread_not_charged_to_one_place():
    prices = by_n(NOISY)
    slot = np.diff(prices)
    assert np.all(slot >= 0) and np.all(np.diff(slot) >= -1e-12)  # rising, convex
    # The running maximum charged the first draft 0.069 s, a third of a step,
    # and the next seven nothing; spread, no place costs more than 2% of a step.
    assert np.diff(np.maximum.accumulate(NOISY.verify_and_first(1.0 + np.arange(9))))[0] > 0.06
    assert slot.max() < 0.02 * 0.197
    assert prices[0] == NOISY.target(1)


def test_a_convex_rising_curve_is_priced_as_measured():
    tokens = 1.0 + np.arange(4 * 8 + 1)
    np.testing.assert_allclose(by_n(LINEAR, batch=1), LINEAR.verify_and_first(tokens[:9]))
    np.testing.assert_allclose(convex_rise([1.0, 2.0, 4.0, 7.0]), [1.0, 2.0, 4.0, 7.0])
    # A dip comes first in a convex fit and is floored at the step's own price.
    np.testing.assert_allclose(convex_rise([0.13, 0.125, 0.12, 0.14]), [0.13, 0.13, 0.13, 0.14])
