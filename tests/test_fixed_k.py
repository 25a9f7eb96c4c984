"""A request's fixed k (``specplug_k``): the controller grants exactly it.

No vLLM, no clock: a fixed profile where drafting pays (``MODERATE``) and one
where it never does (``CPU_BOUND``), so the adaptive choice would differ from
every fixed k the tests ask for.
"""

import numpy as np
import pytest

from vllm_specplug.controller import ControllerSettings, SpecController

from controller_cases import CPU_BOUND, MODERATE




def controller(profile, max_k=8):
    return SpecController(ControllerSettings(max_k=max_k), profile)


def run(ctrl, ids, steps, accept=1.0, **plan_kw):
    """``steps`` plans, each verified with the first ``accept`` share kept."""
    out = []
    for _ in range(steps):
        d = ctrl.plan(ids, **plan_kw)
        k = np.asarray(d.k, dtype=np.int64)
        ctrl.observe_verifications(ids, k, (k * accept).astype(np.int64))
        out.append(d)
    return out


@pytest.mark.parametrize("profile", [MODERATE, CPU_BOUND])
@pytest.mark.parametrize("fixed", [0, 2, 4, 8])
def test_a_fixed_k_is_granted_every_step_whatever_the_profile(profile, fixed):
    ctrl = controller(profile)
    ids = ["a", "b", "c"]
    for r in ids:
        ctrl.add_request(r, None, fixed)
    for d in run(ctrl, ids, 40, accept=0.0):  # every draft rejected: adaptive would stop
        assert d.k.tolist() == [fixed] * 3
        assert d.k_step == fixed
        assert ctrl.stop_rule(d) is None
    assert ctrl.stats.probes_sent == 0 and ctrl.stats.plain_probes == 0
    assert ctrl.num_in_fallback() == 0


def test_a_fixed_k_is_capped_by_the_ceiling_tokens_left_and_a_pinned_k_step():
    ctrl = controller(MODERATE)
    ctrl.add_request("a", 3, 6)  # clamped to its own ceiling
    ctrl.add_request("b", None, 6)
    assert ctrl.plan(["a", "b"]).k.tolist() == [3, 6]
    assert ctrl.plan(["a", "b"], tokens_left=[10, 4]).k.tolist() == [3, 2]
    d = ctrl.plan(["a", "b"], fixed_k_step=4)
    assert d.k.tolist() == [3, 4] and d.k_step == 4
    ctrl.set_ceiling("b", 8, 1)  # a streaming session's next chunk
    assert ctrl.plan(["a", "b"]).k.tolist() == [3, 1]
    ctrl.set_ceiling("b", 8, None)  # and back to the adaptive choice
    twin = controller(MODERATE)
    twin.add_request("a", 3, 6)
    twin.add_request("b")
    assert ctrl.plan(["a", "b"]).k.tolist() == twin.plan(["a", "b"]).k.tolist()


def test_adaptive_requests_beside_fixed_ones_keep_their_own_plan():
    """In a mixed batch the adaptive requests decide as before; the step
    drafts at least the fixed k, and has no per-position stop rule."""
    fixed_ctrl, alone = controller(CPU_BOUND), controller(CPU_BOUND)
    fixed_ctrl.add_request("f", None, 5)
    for c in (fixed_ctrl, alone):
        c.add_request("x")
    run(alone, ["x"], 30, accept=0.0)
    ds = run(fixed_ctrl, ["f", "x"], 30, accept=0.0)
    assert alone.plan(["x"]).k.tolist() == [0]  # rejected drafts on a CPU: fallback
    assert all(d.k[0] == 5 and d.k_step == 5 for d in ds)
    assert ds[-1].k[1] == 0
    assert all(fixed_ctrl.stop_rule(d) is None for d in ds)
    # A fixed k of 0 leaves the step's shape to the adaptive requests.
    good = controller(MODERATE)
    good.add_request("p", None, 0)
    good.add_request("y")
    d = run(good, ["p", "y"], 10)[-1]
    assert d.k[0] == 0 and d.k[1] > 0 and d.k_step == d.k[1]
    assert good.num_in_fallback() == 0
    assert good.stop_rule(d) is not None
