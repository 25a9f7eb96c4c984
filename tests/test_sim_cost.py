"""The simulator's cost model (``vllm_specplug.tools.sim.cost``, ``clock``,
``profile``): no vLLM, no engine, seconds.

- the measured pass table is reproduced exactly and interpolated
  monotonically; the roofline alternative turns from memory-bound to
  compute-bound;
- the step clock's cold shapes, stalls and noise; the profile measured as
  the plugin measures it;
- static K loses to plain decoding above a crossover batch size.

The engine, the policies' sweep and the traces: ``test_sim.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_specplug.tools.sim.analysis import (
    batch_table,
    crossover_batch,
    table_lookup,
    typical_context,
)
from vllm_specplug.tools.sim.cost import make_setup
from vllm_specplug.tools.sim.devices import MODELS
from vllm_specplug.tools.sim.cell import CellSpec
from vllm_specplug.tools.sim.run import run_cell

GPU_SETUPS = ("70b-1b", "8b-eagle")
FAST = dict(warmup=0.5, measure=0.5)  # half a generation of warm-up, half measured


# -- cost model ------------------------------------------------------------------
def test_measured_table_is_reproduced_exactly_at_its_points():
    from vllm_specplug.tools.sim import measured

    meta, tables = measured.load("h200-2026-12-04.jsonl")
    assert meta["env"]["device"] == "NVIDIA H200" and set(tables) == {
        "llama-3.1-8b", "llama-3-70b-tp2", "llama-3.2-1b-tp2", "eagle3-8b"}
    n = 0
    for t in tables.values():
        for (b, q, L), v in t.points.items():
            if b == 1 and (L == 0 or q > 9):  # a prefill chunk: one request, no decode
                got = t.pass_seconds(float(q), float(q), 0, 0.0, np.array([float(q)]),
                                     np.array([float(L)]))
            else:
                got = t.decode(b, q, L)
            assert float(got) == pytest.approx(v, rel=1e-12), (t.model, b, q, L)
            n += 1
    assert n == 4 * 190


def test_measured_interpolation_is_monotone_where_the_table_is():
    from vllm_specplug.tools.sim import measured

    _, tables = measured.load("h200-2026-12-04.jsonl")
    checked = 0
    for t in tables.values():
        for L in (1024.0, 640.0, 2048.0):
            # along B, at every measured q and half-way between two of them
            qs = list(t.q) + [float(np.sqrt(t.q[j] * t.q[j + 1])) for j in range(len(t.q) - 1)]
            for q in qs:
                ends = t.decode(t.B, q, L)
                for i in range(len(t.B) - 1):
                    lo, hi = ends[i], ends[i + 1]
                    xs = np.geomspace(t.B[i], t.B[i + 1], 9)
                    ys = t.decode(xs, q, L)
                    d = np.diff(ys)
                    if hi >= lo:
                        assert (d >= -1e-15).all(), (t.model, L, q, t.B[i])
                        checked += 1
                    else:
                        assert (d <= 1e-15).all(), (t.model, L, q, t.B[i])
            # along q, at every measured B
            for b in t.B:
                ends = t.decode(b, t.q, L)
                for j in range(len(t.q) - 1):
                    ys = t.decode(b, np.geomspace(t.q[j], t.q[j + 1], 9), L)
                    d = np.diff(ys)
                    assert ((d >= -1e-15).all() if ends[j + 1] >= ends[j]
                            else (d <= 1e-15).all()), (t.model, L, b, t.q[j])
                    checked += 1
    assert checked > 1000
    # Where the table is monotone, so is the price between its points: the
    # 8B target at L = 1024 rises with B at every q and with q at every B.
    t = tables["llama-3.1-8b"]
    assert (np.diff(t.grid, axis=0) > 0).sum() == t.grid[1:].size - 1  # one tie: B 32->40 at q=4
    x = t.decode(np.geomspace(1, 512, 200), 3.0, 1024.0)
    assert (np.diff(x) >= 0).all()
    # Past the measured batch sizes the price keeps rising (linear in B).
    big = t.decode(np.array([512.0, 1024.0, 2048.0]), 1.0, 1024.0)
    assert big[0] < big[1] < big[2]


def test_measured_prices_what_the_h200_table_shows():
    # The measured H200 passes at their own context (L = 1024): nearly flat
    # in the batch while the weights dominate, verifying drafts nearly free
    # at one request, per-token cost falling until a few hundred tokens a
    # pass and flat after.  (The roofline's sharper ridge is tested below.)
    for setup in GPU_SETUPS:
        cost = make_setup(setup).cost()
        assert cost.tables is not None

        def t(batch, cost=cost):
            return cost.decode_step(batch, 0, 1024.0, speculative=False)

        for b in (2, 4, 8):
            assert t(2 * b) / t(b) < 1.05
        # (the 8B measured: 5.83 ms at q = 5 against 5.46 at q = 1; the 70B
        # rank's q = 1 point is above its q = 5 one)
        assert cost.decode_step(1, 4, 1024.0, speculative=False) / t(1) < 1.08
        assert cost.decode_step(256, 4, 1024.0, speculative=False) / t(256) > 2.0
        per_token = [t(b) / b for b in (1, 8, 64, 256, 512)]
        assert all(per_token[i] > per_token[i + 1] for i in range(len(per_token) - 1))
        assert per_token[-1] / per_token[-2] > 0.8
    # Host time and the all-reduces sit on top of the table's passes.
    from vllm_specplug.tools.sim.devices import HOST_STEP_S
    s = make_setup("8b-eagle")
    cost = s.cost()
    pass_only = float(cost.tables[id(s.target)].decode(1, 1, 1024))
    assert cost.decode_step(1, 0, 1024, speculative=False) == pytest.approx(
        pass_only + HOST_STEP_S)


@pytest.mark.parametrize("setup", GPU_SETUPS)
def test_roofline_memory_bound_then_compute_bound(setup):
    cost = make_setup(setup, gpu="h200-roofline").cost()
    assert cost.tables is None
    ctx = 64.0  # short contexts: the weights dominate the bytes moved

    def t(batch, k=0):
        return cost.decode_step(batch, k, ctx, speculative=False)

    # Small batches: reading the weights dominates; doubling the batch is
    # almost free, so the cost per token halves.
    for b in (1, 2, 4, 8):
        assert t(2 * b) / t(b) < 1.05
    # Large batches: compute-bound; doubling the batch doubles the time and
    # the cost per token stops falling.
    assert t(4096) / t(2048) > 1.9
    per_token = [t(b) / b for b in (1, 8, 64, 512, 2048, 4096)]
    assert all(a > b for a, b in zip(per_token, per_token[1:4]))
    assert per_token[-1] / per_token[-2] > 0.95
    # The turn sits where the tokens per pass reach the ridge point
    # (bandwidth x peak ratio, ~180 tokens for bf16 on H200).
    assert t(128) / t(1) < 1.5 < t(1024) / t(1)
    # Verifying 4 drafts is nearly free at batch 1, not at batch 512.
    assert cost.decode_step(1, 4, ctx, speculative=False) / t(1) < 1.05
    assert cost.decode_step(512, 4, ctx, speculative=False) / t(512) > 2.5


def test_cpu_profile_is_compute_bound_from_one_token():
    cost = make_setup("cpu-qwen").cost()
    plain = cost.decode_step(1, 0, 64, speculative=False)
    verify4 = cost.decode_step(1, 4, 64, speculative=False)
    # Unlike a GPU at batch 1, every extra token costs a visible fraction of
    # a step (measured here with a 185M target: about 2x for 4 drafts; see
    # the calibration test for how close the profile comes to it).
    assert verify4 / plain > 1.5


def test_model_shapes_match_published_sizes():
    # Parameter counts of the published checkpoints, within 2%.
    for key, billions in (("llama-3-70b", 70.6), ("llama-3.1-8b", 8.03),
                          ("llama-3.2-1b", 1.24), ("qwen2.5-1.5b", 1.54),
                          ("qwen2.5-0.5b", 0.49)):
        assert MODELS[key].params / 1e9 == pytest.approx(billions, rel=0.02)
    assert MODELS["llama-3-70b"].kv_bytes_per_token == 320 * 1024


def test_zero_cost_fallback_removes_the_draft_pass_at_k0():
    today = make_setup("70b-1b").cost()
    zero = make_setup("70b-1b", draft_at_k0=False).cost()
    plain = today.decode_step(64, 0, 640, speculative=False)
    assert today.decode_step(64, 0, 640) > plain * 1.01
    assert zero.decode_step(64, 0, 640) == pytest.approx(plain)


def test_zero_cost_fallback_pays_the_catch_up_when_drafting_resumes():
    # The plugin's zero-cost fallback skips the draft at K_step=0 and, before
    # it drafts again, runs it over every token it skipped.
    from vllm_specplug.tools.sim.cell import setup_for
    from vllm_specplug.tools.sim.engine import Engine
    from vllm_specplug.tools.sim.policies import Policy

    class SixPlainThenRunTheDraft(Policy):
        # K_step 1 from the seventh step, keeping no drafts: every drafting
        # step then has the same shape, and only the first catches up.
        calls = 0

        def decide(self, engine, dec, base_tokens):
            self.calls += 1
            return (0 if self.calls <= 6 else 1), np.zeros(len(dec), dtype=np.int64)

    spec = CellSpec("cpu-qwen", "easy", "static-1", 2, draft_at_k0=False, noise=0.0,
                    prefill=False, realism=False)
    engine = Engine(spec, setup_for(spec))
    engine.policy = SixPlainThenRunTheDraft()
    times = []
    for _ in range(8):
        before = engine.clock
        engine.step(measure=False)
        times.append(engine.clock - before)
    plain, resume, drafting = times[5], times[6], times[7]
    assert drafting > plain  # a drafting step runs the draft
    # ... and the first one catches up on 2 requests x 6 skipped tokens.
    catch_up = engine.cost.draft_pass(12.0, float(engine.ctx.sum()), 12.0 * engine.ctx.mean())
    assert resume - drafting == pytest.approx(float(catch_up), rel=0.2)


def test_gpu_passes_run_padded_to_vllms_capture_sizes():
    from vllm_specplug.tools.sim.cost import vllm_capture_sizes

    plain = vllm_capture_sizes(1, 512, 8192)
    assert plain[:5] == (1, 2, 4, 8, 16) and plain[-1] == 512
    assert set(range(8, 256, 8)) | set(range(256, 513, 16)) | {1, 2, 4} == set(plain)
    # A speculative engine also captures its uniform decode sizes n (1 + K).
    spec = vllm_capture_sizes(9, 512, 8192)
    assert set(plain) < set(spec) and {9, 18, 36, 72, 504} <= set(spec)
    s = make_setup("70b-1b", gpu="h200-roofline")
    cost = s.cost()

    def t(tokens):
        return cost.decode_step(tokens, 0, 64, speculative=False)

    # Past the ridge a step costs its padded size: flat within 257..272,
    # a jump at 273; past 512 unpadded and continuous.
    assert t(257) == pytest.approx(t(272), rel=1e-3) and t(273) > t(272) * 1.03
    assert t(514) > t(513) > t(512)
    # Measured prices: the weight GEMMs run over the padded tokens too (a
    # pass of one prompt chunk: no decode attention to vary with the batch).
    from vllm_specplug.tools.sim.cost import PassShape
    m = make_setup("70b-1b").cost()

    def chunk(tokens):
        return float(m.target_pass(tokens, 0.0, 0.0, False,
                                   PassShape(0, 0.0, np.array([float(tokens)]), np.zeros(1))))

    assert chunk(257) == pytest.approx(chunk(272)) and chunk(273) > chunk(272) * 1.03
    assert chunk(514) > chunk(513) > chunk(512)
    # and a decode step of 257 requests costs at least the GEMMs of 272 tokens
    assert m.decode_step(257, 0, 64, speculative=False) > chunk(257) - m.target_fixed \
        - float(m.allreduce(s.target, 272)) - 1e-9
    assert make_setup("cpu-qwen").capture_sizes() is None  # eager


def test_the_clock_has_cold_shapes_stalls_and_unbiased_noise():
    from vllm_specplug.tools.sim.clock import Realism, StepClock

    clock = StepClock(Realism(noise=0.0, stall_prob=0.0), np.random.default_rng(0))
    times = [clock.seconds(1.0, 100, False) for _ in range(4)]
    assert times[:2] == [3.0, 3.0] and times[2:] == [1.0, 1.0]  # two cold steps
    assert clock.seconds(1.0, 100, True) == 3.0  # drafting is another shape
    assert clock.seconds(1.0, 127, False) == 1.0  # same power-of-two band
    assert clock.seconds(1.0, 128, False) == 3.0
    noisy = StepClock(Realism(noise=0.05, cold_steps=0), np.random.default_rng(1))
    x = np.array([noisy.seconds(1.0, 8, False) for _ in range(20000)])
    stalls = np.mean(x > 3.0)
    assert 0.003 < stalls < 0.008  # 0.5% of steps stall 5x
    assert np.mean(x[x < 3.0]) == pytest.approx(1.0, abs=0.003)  # mean-one noise
    ideal = Realism.for_setup(0.05, realistic=False)
    assert ideal.cold_steps == 0 and ideal.stall_prob == 0.0 and ideal.noise == 0.05


def test_the_profile_is_measured_like_the_plugin_and_warms_its_shapes():
    from vllm_specplug.profiling import ROUNDS
    from vllm_specplug.tools.sim.clock import Realism, StepClock
    from vllm_specplug.tools.sim.cost import StepCost
    from vllm_specplug.tools.sim.profile import measure_profile

    s = make_setup("70b-1b")
    cost = StepCost(s)
    # On a clean clock the measurement recovers the cost model.
    clean = StepClock(Realism(noise=0.0, cold_steps=0, stall_prob=0.0),
                      np.random.default_rng(0))
    p = measure_profile(s, np.random.default_rng(0), clean)
    assert list(p.batch) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert {1, 9, 512, 4608} <= set(p.tokens.tolist())
    # The plugin's own procedure (profiling.run_rounds): six shapes a batch size.
    assert p.meta["rounds_min"] == ROUNDS and p.meta["shapes"] == 6 * p.batch.size
    assert p.meta["fit"] == "isotonic (draft pass, catch-up)"
    assert p.meta["raw"]["tokens"] == p.tokens.tolist()
    # On the measured passes the 70B rank's B = 1 step is dearer than its
    # B = 2 step (24.3 vs 22.7 ms in the table): the profile keeps each
    # batch's plain step as measured (a plan reads the token curve from its
    # own size up), and follows the model.
    one, two = cost.decode_step(1, 0, 64), cost.decode_step(2, 0, 64)
    assert one > two
    assert float(p.target(1)) == pytest.approx(one, rel=0.01)
    assert float(p.target(2)) == pytest.approx(two, rel=0.01)
    assert float(p.target(4)) == pytest.approx(cost.decode_step(4, 0, 64), rel=0.01)
    assert float(p.first(9)) < 1e-3 * float(p.target(9))  # vLLM runs the draft at K=0
    later = float(cost.draft_pass(8, 8 * 64, 8 * 64))
    assert p.draft_pass(8) == pytest.approx(later, rel=0.05)
    # On the engine's clock the measurement's shapes are warm afterwards.
    clock = StepClock(Realism(noise=0.0, stall_prob=0.0), np.random.default_rng(0))
    measure_profile(s, np.random.default_rng(0), clock)
    assert clock.seconds(1.0, 9 * 64, True) == 1.0 and clock.seconds(1.0, 64, False) == 1.0
    assert clock.cold_steps_run == 0  # the measurement's own steps are not counted here




# -- crossover --------------------------------------------------------------------
@pytest.mark.parametrize("setup", GPU_SETUPS)
def test_static_k_loses_to_plain_above_a_crossover(setup):
    s = make_setup(setup)
    for alpha in (s.acceptance.easy, s.acceptance.hard):
        c4 = crossover_batch(s, 4, alpha)
        assert c4 is not None and 1 < c4 <= 1024
        # Longer drafts turn unprofitable earlier.
        c8 = crossover_batch(s, 8, alpha)
        assert c8 is not None and c8 <= c4
    # And in the engine (prefill, contexts, noise): K=4 on hard traffic wins
    # at one request, loses at 256.
    low = {p: run_cell(CellSpec(setup, "hard", p, 1, **FAST))["goodput"]
           for p in ("plain", "static-4")}
    high = {p: run_cell(CellSpec(setup, "hard", p, 256, **FAST))["goodput"]
            for p in ("plain", "static-4")}
    assert low["static-4"] > low["plain"]
    assert high["static-4"] < high["plain"]


def test_vllm_batch_table_semantics():
    table = [[1, 1, 5], [4, 7, 3], [16, 31, 1]]
    # gaps take the previous entry's K, batches above the last range its K,
    # and K is capped at num_speculative_tokens
    assert [table_lookup(table, b, 8) for b in (1, 2, 4, 8, 16, 64)] == [5, 5, 3, 3, 1, 1]
    assert table_lookup(table, 1, 4) == 4
    s = make_setup("70b-1b", gpu="h200-roofline")
    tuned = batch_table(s, typical_context(s), [512])
    ks = [k for _, _, k in tuned]
    assert ks[0] >= 4 and ks[-1] <= 1 and ks == sorted(ks, reverse=True)
    # On the measured passes the table falls the same way from 8 requests
    # on; below that the 70B rank's measured passes differ by less than
    # their noise (B = 1 at 24.3 ms, B = 2 at 22.7 ms), and the best K
    # between 5 and 7 follows it.
    s = make_setup("70b-1b")
    ks = [k for _, _, k in batch_table(s, typical_context(s), [512])]
    assert min(ks[:4]) >= 5 and ks[-1] <= 1 and ks[3:] == sorted(ks[3:], reverse=True)
