"""The simulated engine's policies: plain decoding, static K, vLLM's batch-size
table, the real controller (heuristic, goodput, its own static path), the
oracle and adaptive verification; ``make_policy`` builds one by name."""

from __future__ import annotations

import numpy as np

from vllm_specplug.controller import ControllerSettings, SpecController, StepProfile
from vllm_specplug.tools.sim.analysis import batch_table, table_lookup, typical_context
from vllm_specplug.tools.sim.clock import StepClock
from vllm_specplug.tools.sim.cost import Setup
from vllm_specplug.tools.sim.profile import measure_profile

STATIC_KS = (1, 2, 4, 8)
POLICIES = ("plain",) + tuple(f"static-{k}" for k in STATIC_KS) + (
    "table", "v2-av", "heuristic", "goodput", "goodput-pinned", "oracle")
CONTROLLER_POLICIES = ("heuristic", "goodput")


class Policy:
    speculative = True
    controller: SpecController | None = None

    def decide(self, engine, dec: np.ndarray, base_tokens: int) -> tuple[int, np.ndarray]:
        """K_step and each request's k for the rows ``dec`` of ``engine`` (``sim.engine.Engine``,
        which hands itself in: a policy reads its state, never imports it)."""
        raise NotImplementedError


class Plain(Policy):
    speculative = False

    def decide(self, engine, dec, base_tokens):
        return 0, np.zeros(len(dec), dtype=np.int64)


class Static(Policy):
    def __init__(self, k: int) -> None:
        self.k = k

    def decide(self, engine, dec, base_tokens):
        return self.k, np.full(len(dec), self.k, dtype=np.int64)


class Table(Policy):
    """vLLM's ``num_speculative_tokens_per_batch_size``."""

    def __init__(self, table: list[list[int]], max_k: int) -> None:
        self.table = table
        self.max_k = max_k

    def decide(self, engine, dec, base_tokens):
        k = table_lookup(self.table, max(len(dec), 1), self.max_k)
        return k, np.full(len(dec), k, dtype=np.int64)


class Controller(Policy):
    """The real controller, driven as the scheduler drives it, from a
    profile measured on the engine (``profile``) or measured here.
    ``pinned``: K_step stays at the ceiling and only each request's k
    adapts, as the plugin runs where the drafter drafts every position
    whatever K_step says (vLLM 0.32-0.33's V2 ``draft_model``)."""

    def __init__(self, setup: Setup, policy: str, static_k: int | None = None,
                 profile: StepProfile | None = None, rng: np.random.Generator | None = None,
                 clock: StepClock | None = None, pinned: bool = False) -> None:
        if profile is None:
            profile = measure_profile(setup, rng if rng is not None else np.random.default_rng(0),
                                      clock)
        self.controller = SpecController(
            ControllerSettings(max_k=setup.max_k, policy=policy, static_k=static_k),
            profile=profile)
        self.max_k = setup.max_k
        self.pinned = pinned
        self.violations = 0

    def decide(self, engine, dec, base_tokens):
        ids = [engine.names[s] for s in dec.tolist()]
        d = self.controller.plan(ids, base_tokens=base_tokens,
                                 fixed_k_step=self.max_k if self.pinned else None,
                                 catchup_tokens=engine.catchup_pending,
                                 tokens_left=engine.left[dec],
                                 catchup_if_plain=engine.catchup_if_plain)
        k = np.asarray(d.k, dtype=np.int64)
        k_step = int(d.k_step)
        if len(k) and (k.max() > k_step or k_step > self.max_k or k.min() < 0):
            # The scheduler would clamp; count it, it is a controller bug.
            self.violations += 1
            k_step = min(k_step, self.max_k)
            k = np.clip(k, 0, k_step)
        return k_step, k


class Oracle(Policy):
    """Best plan per step given the *true* acceptance probabilities and
    the true (noise-free) cost model.

    For every K_step the slots are taken in order of true survival and every
    prefix is evaluated, each priced as the step that both verifies it and
    runs its K_step draft positions (the steady state of the one-step lag).
    Steps differ (prefill chunks, contexts), so the best *per-step ratio* is
    not the best long-run throughput: a slow prefill-heavy step would take
    any draft that beats its own low ratio.  The oracle therefore maximises
    expected tokens - lambda * seconds (Dinkelbach's method), with lambda its
    own *decode* throughput so far, reckoned in noise-free seconds: tokens
    over step time minus the time the step's prefill chunks added.  In a
    closed loop every output token brings the same prefill work whatever the
    policy, so the long-run rate is maximal exactly when tokens per decode
    second is.  In expectation, not on every draw, and blind to the clock's
    cold steps and stalls: an upper bound in spirit, not per realisation.
    """

    # The K_step values it chooses from (None: 0 to the ceiling).
    k_steps: tuple[int, ...] | None = None

    def decide(self, engine, dec, base_tokens):
        n = len(dec)
        cost, width = engine.cost, engine.setup.max_k
        full = self.k_steps is not None
        if n == 0:
            return (width if full else 0), np.zeros(0, dtype=np.int64)
        surv = engine.acc.survival(dec)
        ctx = engine.ctx[dec].astype(float)
        t0, kv0, pairs0, emit0 = engine.step_base
        shape = engine.step_shape
        ctx_sum = float(ctx.sum())
        decode_s = engine.true_seconds - engine.true_prefill_seconds
        lam = engine.total_tokens / decode_s if decode_s > 0 else None

        def score(tokens, secs):
            return tokens / secs if lam is None else tokens - lam * secs

        plain = float(cost.target_pass(t0, kv0, pairs0, shape=shape)
                      + cost.draft_time(0, t0, n, kv0, pairs0, ctx_sum, shape))
        best = (-np.inf if full else score(emit0, plain), 0, 0, None)
        pos = np.tile(np.arange(width), n)
        rows = np.repeat(np.arange(n), width)
        s_flat = surv.ravel()
        ctx_flat = ctx[rows] + pos + 1
        for c in (self.k_steps if full else range(1, width + 1)):
            m = pos < c
            order = np.argsort(-s_flat[m], kind="stable")
            gain = np.concatenate(([0.0], np.cumsum(s_flat[m][order])))
            extra_pairs = np.concatenate(([0.0], np.cumsum(ctx_flat[m][order])))
            toks = t0 + np.arange(len(gain))
            pairs = pairs0 + extra_pairs
            secs = cost.target_pass(toks, kv0, pairs, shape=shape) + cost.draft_time(
                c, toks, n, kv0, pairs, ctx_sum, shape) + engine.catchup_cost
            val = score(emit0 + gain, secs)
            i = int(np.argmax(val))
            if val[i] > best[0]:
                best = (float(val[i]), c, i, (m, order))
        _, c, count, sel = best
        if count == 0:
            return c, np.zeros(n, dtype=np.int64)
        m, order = sel
        chosen = rows[m][order[:count]]
        k = np.bincount(chosen, minlength=n).astype(np.int64)
        return (c if full else int(k.max())), k


class AdaptiveVerification(Oracle):
    """vLLM's V2 adaptive verification (``enable_adaptive_verification``), at its best.

    The drafter drafts the full K every step (vLLM's K, not trimmed); each
    request then verifies the drafts its confidence and vLLM's start-up cost
    curves say pay.  Here the confidence is perfectly calibrated (the true
    acceptance probability of every position) and the cost curves exact (the
    engine's own prices): the oracle's choice of verified drafts with K_step
    fixed at K.  An upper bound of what vLLM's feature can do on these prices.
    """

    def __init__(self, max_k: int) -> None:
        self.k_steps = (max_k,)


def make_policy(name: str, setup: Setup, rng: np.random.Generator | None = None,
                clock: StepClock | None = None) -> Policy:
    """``rng`` and ``clock``: the controller's profile measurement (its noise
    and the engine clock it warms)."""
    if name == "plain":
        return Plain()
    if name.startswith("static-"):
        return Static(int(name.split("-", 1)[1]))
    if name.startswith("ctrl-static-"):  # the controller's own static path
        return Controller(setup, "static", int(name.rsplit("-", 1)[1]), rng=rng, clock=clock)
    if name == "table":
        return Table(batch_table(setup, typical_context(setup), [setup.max_concurrency]),
                     setup.max_k)
    if name in CONTROLLER_POLICIES:
        return Controller(setup, name, rng=rng, clock=clock)
    if name == "goodput-pinned":
        return Controller(setup, "goodput", rng=rng, clock=clock, pinned=True)
    if name == "oracle":
        return Oracle()
    if name == "v2-av":
        return AdaptiveVerification(setup.max_k)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}, ctrl-static-K")
