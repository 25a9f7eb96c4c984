"""The discrete-step engine: N requests, one policy, simulated time.

Each step, like vLLM's scheduler with the plugin:

1. admit requests into free slots (closed loop: a finished request is
   replaced at once; or Poisson arrivals into at most ``concurrency`` slots);
   a new request prefills in chunks within the step's token budget, which
   the drafts to verify count against;
2. schedule each decoding request's token plus the drafts planned for it in
   the previous step, and the prefill chunks;
3. ask the policy for the next step's plan: ``K_step`` (the proposer's
   draft positions, run at the end of *this* step) and ``k_r`` (drafts kept
   for each request, verified in the *next* step), for the requests that
   decode next step (those decoding now and those whose prefill completes
   now).  The real ``SpecController.plan`` gets ``base_tokens`` = decode +
   prefill tokens, as the scheduler passes it;
4. draw how many of each request's verified drafts are accepted from the
   scenario's acceptance process;
5. advance the clock by the step-cost model's time for that step (the
   target over every scheduled token, then the proposer's ``K_step``
   passes) on the engine's ``StepClock`` (cold first steps of new shapes,
   rare stalls, lognormal noise), and emit ``accepted + 1`` tokens per
   request (never more than it still needs);
6. feed the controller exactly what the scheduler feeds it:
   ``observe_verifications`` for the requests that verified drafts,
   ``observe_step(scheduled requests, scheduled tokens incl. drafts, K_step,
   seconds, catch-up tokens)``; ``finish_request`` for finished requests.

The controller starts from a ``StepProfile`` measured on the same engine
before serving (``sim.profile.measure_profile``), which warms the shapes it
times.

``run_cell(CellSpec)`` is a pure function of its spec (setup, scenario,
policy, concurrency, seed, options): same spec, same result dict, in any
process, so a sweep can be mapped in parallel.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, replace

import numpy as np

from vllm_specplug.controller import ControllerSettings, SpecController, StepProfile
from vllm_specplug.tools.sim.clock import Realism, StepClock
from vllm_specplug.tools.sim.analysis import batch_table, table_lookup, typical_context
from vllm_specplug.tools.sim.cost import PassShape, Setup, StepCost, make_setup
from vllm_specplug.tools.sim.devices import decision_seconds
from vllm_specplug.tools.sim.profile import measure_profile
from vllm_specplug.tools.sim.scenarios import RequestSpec, make_scenario
from vllm_specplug.tools.sim.trace import Trace, TraceRequest

STATIC_KS = (1, 2, 4, 8)
POLICIES = ("plain",) + tuple(f"static-{k}" for k in STATIC_KS) + (
    "table", "v2-av", "heuristic", "goodput", "goodput-pinned", "oracle")
CONTROLLER_POLICIES = ("heuristic", "goodput")


@dataclass(frozen=True)
class CellSpec:
    setup: str
    scenario: str
    policy: str
    concurrency: int
    seed: int = 0
    gpu: str = "h200"
    draft_at_k0: bool = True
    warmup: float = 0.5  # request generations (x concurrency completions) not measured
    measure: float = 1.0  # request generations measured
    min_window: int = 3  # completions measured, at least
    max_steps: int = 20000
    noise: float | None = None  # None: the setup's default
    arrival_rate: float | None = None  # requests/s; None: closed loop
    tp: int | None = None
    prefill: bool = True  # False: prompts arrive already cached (decode-only steps)
    realism: bool = True  # False: no cold first steps and no stalls (noise only)
    cold_steps: int = 2  # slow first steps of each new step shape (see clock.Realism)

    def key(self) -> str:
        return (f"{self.setup}/{self.gpu}/{'today' if self.draft_at_k0 else 'zero'}/"
                f"{'' if self.prefill else 'decode-only/'}"
                f"{'' if self.realism else 'ideal/'}"
                f"{'' if self.cold_steps == 2 else f'cold{self.cold_steps}/'}"
                f"{self.scenario}/{self.policy}/c{self.concurrency}/s{self.seed}")


def _seed(spec: CellSpec, purpose: str) -> np.random.Generator:
    """Independent streams per purpose; the workload and acceptance streams
    do not depend on the policy, so every policy sees the same requests."""
    words = [spec.setup, spec.gpu, spec.scenario, str(spec.concurrency), purpose]
    h = hashlib.sha256("/".join(words).encode()).digest()
    return np.random.default_rng([spec.seed, int.from_bytes(h[:8], "little")])


# -- policies -------------------------------------------------------------------
class Policy:
    speculative = True
    controller: SpecController | None = None

    def decide(self, engine: "Engine", dec: np.ndarray, base_tokens: int) -> tuple[int, np.ndarray]:
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


# -- the engine -----------------------------------------------------------------
@dataclass
class Metrics:
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    decode_request_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    sum_k_step: int = 0
    planned_request_steps: int = 0
    fallback_request_steps: int = 0
    finished: int = 0
    prefill_tokens: int = 0


class Engine:
    def __init__(self, spec: CellSpec, setup: Setup, source=None, record: bool = False) -> None:
        self.spec = spec
        self.setup = setup
        self.cost = StepCost(setup)
        cap = spec.concurrency
        self.cap = cap
        scenario = make_scenario(spec.scenario)
        warm = 0 if spec.arrival_rate or source is not None else cap
        self.src, self.acc = scenario.make(setup, cap, lambda p: _seed(spec, p), warm, source)
        self.arrival_rng = _seed(spec, "arrivals")
        self.noise = setup.noise if spec.noise is None else spec.noise
        self.timer = StepClock(Realism.for_setup(self.noise, spec.realism, spec.cold_steps),
                               _seed(spec, "noise"), _seed(spec, "stalls"))
        self.policy = make_policy(spec.policy, setup, _seed(spec, "profile"), self.timer)
        if isinstance(self.policy, Oracle):
            # The oracle runs on an engine warmed as the plugin's start-up
            # warms it (it plans blind to cold shapes).
            measure_profile(setup, _seed(spec, "profile"), self.timer)
        self.active = np.zeros(cap, dtype=bool)
        # Drafts planned for each slot in the previous step, verified in this one.
        self.pending = np.zeros(cap, dtype=np.int64)
        self.prompt = np.zeros(cap, dtype=np.int64)
        self.prefilled = np.zeros(cap, dtype=np.int64)
        self.ctx = np.zeros(cap, dtype=np.int64)
        self.left = np.zeros(cap, dtype=np.int64)
        # Zero-cost fallback: tokens of each request the draft model skipped
        # (K_step=0 steps) and must catch up on before it drafts again.
        self.draft_gap = np.zeros(cap, dtype=np.int64)
        self.catchup_pending = 0
        self.catchup_if_plain: int | None = None
        self._catchup_slots, self._catchup_cost = np.zeros(0, dtype=np.int64), 0.0
        self.order = np.zeros(cap, dtype=np.int64)  # admission order (FIFO prefill)
        self.arrived = np.zeros(cap)  # arrival time (open loop: before any queueing)
        self.warm_started = np.zeros(cap, dtype=bool)
        self.latencies: list[float] = []  # of requests finished in the measured window
        self.names = [""] * cap
        self.next_id = 0
        self.clock = 0.0
        self.total_tokens = 0
        self.total_seconds = 0.0
        # Noise-free seconds so far, and what prefill chunks added to them
        # (the oracle's own decode throughput is reckoned from these).
        self.true_seconds = 0.0
        self.true_prefill_seconds = 0.0
        self.step_index = 0
        self.completions: list[tuple[int, float, int]] = []  # (step, clock, tokens so far)
        self.window = (0.0, 0, 0)
        self.queue: list[float] = []  # arrival times waiting for a slot
        self.next_arrival = 0.0
        self.exhausted = False
        self.step_base = (0.0, 0.0, 0.0, 0.0)
        self.step_shape = PassShape(0, 0.0)
        self.m = Metrics()
        self.finish_times: dict[str, float] = {}
        self.record = record
        self.trace_requests: dict[str, TraceRequest] = {}
        if spec.arrival_rate:
            self.next_arrival = float(self.arrival_rng.exponential(1.0 / spec.arrival_rate))
        else:
            for s in range(cap):
                self._admit(s)

    # -- requests -------------------------------------------------------------
    def _admit(self, slot: int, arrived: float | None = None) -> bool:
        spec: RequestSpec | None = self.src.next()
        if spec is None:
            self.exhausted = True
            return False
        name = f"r{self.next_id}"
        self.next_id += 1
        self.names[slot] = name
        self.order[slot] = self.next_id
        self.active[slot] = True
        self.arrived[slot] = self.clock if arrived is None else arrived
        self.prompt[slot] = spec.prompt
        self.warm_started[slot] = spec.generated > 0
        if spec.generated > 0 or not self.spec.prefill:
            self.prefilled[slot] = spec.prompt
            self.ctx[slot] = spec.prompt + spec.generated
        else:
            self.prefilled[slot] = 0
            self.ctx[slot] = 0
        self.left[slot] = spec.output
        self.draft_gap[slot] = 0
        self.pending[slot] = 0
        self.acc.start(slot, spec)
        if self.policy.controller is not None:
            self.policy.controller.add_request(name)
        if self.record:
            self.trace_requests[name] = TraceRequest(name, spec.prompt, spec.output,
                                                     spec.generated)
        return True

    def src_warm(self, slot: int) -> bool:
        """Whether the request in ``slot`` started mid-flight (no latency)."""
        return bool(self.warm_started[slot])

    def _finish(self, slot: int) -> None:
        name = self.names[slot]
        self.active[slot] = False
        self.pending[slot] = 0
        self.finish_times[name] = self.clock
        if self.policy.controller is not None:
            self.policy.controller.finish_request(name)

    def _arrivals(self) -> None:
        rate = self.spec.arrival_rate
        while self.next_arrival <= self.clock:
            self.queue.append(self.next_arrival)
            self.next_arrival += float(self.arrival_rng.exponential(1.0 / rate))
        free = np.flatnonzero(~self.active)
        for s in free.tolist():
            if not self.queue or self.exhausted:
                break
            self._admit(s, self.queue.pop(0))
        if not self.active.any() and not self.exhausted:
            self.clock = max(self.clock, self.next_arrival)  # idle until the next one
            self._arrivals()

    # -- one step ---------------------------------------------------------------
    def step(self, measure: bool) -> bool:
        if self.spec.arrival_rate:
            self._arrivals()
        if not self.active.any():
            return False
        setup, cost = self.setup, self.cost
        prefilling = self.active & (self.prefilled < self.prompt)
        dec = np.flatnonzero(self.active & ~prefilling)
        verify = self.pending[dec]  # drafts planned last step, verified now
        pre = np.flatnonzero(prefilling)
        budget = max(setup.workload.max_batched_tokens - len(dec) - int(verify.sum()), 0)
        chunks = np.zeros(len(pre), dtype=np.int64)
        if len(pre):
            pre = pre[np.argsort(self.order[pre], kind="stable")]
            need = self.prompt[pre] - self.prefilled[pre]
            room = budget - np.concatenate(([0], np.cumsum(need)[:-1]))
            chunks = np.clip(np.minimum(need, room), 0, None)
            keep = chunks > 0
            pre, chunks = pre[keep], chunks[keep]
        if len(dec) == 0 and len(pre) == 0:
            return False
        pctx = self.prefilled[pre].astype(float)
        completing = (self.prefilled[pre] + chunks) >= self.prompt[pre]
        # The requests that decode next step: the plan is for them.
        planned = np.concatenate((dec, pre[completing]))
        # What a step costs before any draft is added (for the oracle).
        ctx_dec = self.ctx[dec].astype(float)
        t0 = float(len(dec) + chunks.sum())
        kv0 = float(ctx_dec.sum() + pctx.sum())
        pairs0 = float(ctx_dec.sum() + len(dec) + (chunks * pctx + chunks * (chunks + 1) / 2).sum())
        emit0 = float(len(dec) + completing.sum())
        self.step_base = (t0, kv0, pairs0, emit0)
        self.step_shape = PassShape(len(dec), float(ctx_dec.sum()),
                                    chunks.astype(float) if len(pre) else None,
                                    pctx if len(pre) else None)
        base_tokens = int(t0)
        scheduled = np.concatenate((dec, pre))
        zero_cost = self.policy.speculative and not setup.draft_at_k0
        # Told to the controller in the scheduler's unit: the tokens the
        # catch-up runs the draft over (the simulator has no blocks to round to).
        self.catchup_pending = int(self.draft_gap[scheduled].sum()) if zero_cost else 0
        # And what would be pending after this step if it skipped the draft.
        self.catchup_if_plain = (self.catchup_pending + len(dec) + int(chunks.sum())
                                 + int(completing.sum())) if zero_cost else None
        # Priced on first use (the oracle, or a step that drafts): most
        # steps in fallback do neither.
        self._catchup_slots, self._catchup_cost = scheduled, None

        k_step, k = self.policy.decide(self, planned, base_tokens)
        accepted = self.acc.draw(dec, verify)
        spec = self.policy.speculative
        tokens_scheduled = base_tokens + int(verify.sum())
        draft_ctx = float(self.ctx[planned].sum())
        seconds = cost.step(ctx_dec, verify, k_step, pctx, chunks.astype(float),
                            speculative=spec, draft_batch=len(planned), draft_ctx=draft_ctx)
        catchup = 0
        if zero_cost and k_step > 0:
            # The draft runs over what it skipped before it drafts (as the
            # plugin's zero-cost fallback does), then drafts.
            catchup = self.catchup_pending
            seconds += self.catchup_cost
            self.draft_gap[scheduled] = 0
        if isinstance(self.policy, Controller):
            # The controller's plan and learning run on the scheduler's
            # critical path (devices.DECISION_US; an assumption of the host).
            seconds += decision_seconds(len(planned))
        true_seconds = seconds
        seconds = self.timer.seconds(true_seconds, tokens_scheduled, spec and k_step > 0)
        self.clock += seconds
        self.total_seconds += seconds
        self.true_seconds += true_seconds
        if len(pre) and isinstance(self.policy, Oracle):
            without = cost.step(ctx_dec, verify, k_step, speculative=spec,
                                draft_batch=len(planned), draft_ctx=draft_ctx)
            self.true_prefill_seconds += max(true_seconds - self.catchup_cost_if(catchup)
                                             - without, 0.0)

        emitted = np.minimum(accepted + 1, self.left[dec])
        self.ctx[dec] += accepted + 1
        self.left[dec] -= emitted
        self.prefilled[pre] += chunks
        self.ctx[pre] += chunks
        done_pre = pre[completing]
        self.left[done_pre] -= 1
        self.ctx[done_pre] += 1
        tokens = int(emitted.sum()) + len(done_pre)
        self.total_tokens += tokens
        if zero_cost and k_step == 0:
            # The draft skipped this step: it owes the tokens that entered
            # the context.
            self.draft_gap[dec] += accepted + 1
            self.draft_gap[pre] += chunks + completing
        self.pending[scheduled] = 0
        self.pending[planned] = np.minimum(k, k_step) if spec else 0

        ctrl = self.policy.controller
        if ctrl is not None:
            drafted = verify > 0
            if drafted.any():
                names = self.names
                ctrl.observe_verifications([names[s] for s in dec[drafted].tolist()],
                                           verify[drafted].tolist(),
                                           accepted[drafted].tolist())
            ctrl.observe_step(len(scheduled), tokens_scheduled, k_step, seconds, catchup)
        if self.record:
            for s, kk, a in zip(dec.tolist(), verify.tolist(), accepted.tolist()):
                if kk > 0:
                    self.trace_requests[self.names[s]].records.append((kk, a))

        if measure:
            m = self.m
            m.steps += 1
            m.seconds += seconds
            m.tokens += tokens
            m.decode_request_steps += len(dec)
            m.drafted += int(verify.sum())
            m.accepted += int(accepted.sum())
            m.sum_k_step += k_step
            m.prefill_tokens += int(chunks.sum())
            if spec:
                m.planned_request_steps += len(planned)
                m.fallback_request_steps += int((k == 0).sum())

        self.acc.advance(dec, accepted + 1)
        self.step_index += 1
        for s in np.flatnonzero(self.active & (self.left <= 0)).tolist():
            self.completions.append((self.step_index - 1, self.clock, self.total_tokens))
            self._finish(s)
            if measure:
                self.m.finished += 1
                if not self.src_warm(s):
                    self.latencies.append(self.clock - self.arrived[s])
            if not self.spec.arrival_rate:
                self._admit(s)
        return True

    def catchup_cost_if(self, catchup: int) -> float:
        return self.catchup_cost if catchup else 0.0

    @property
    def catchup_cost(self) -> float:
        """Seconds of this step's draft catch-up, were it to draft (0 when none is pending)."""
        if self._catchup_cost is None:
            self._catchup_cost = (self._catchup_seconds(self._catchup_slots)
                                  if self.draft_gap[self._catchup_slots].any() else 0.0)
        return self._catchup_cost

    def _catchup_seconds(self, slots: np.ndarray) -> float:
        """One draft pass over the skipped tokens of ``slots``, after their cached context."""
        gap = self.draft_gap[slots].astype(float)
        done = self.ctx[slots].astype(float) - gap  # what the draft has cached
        pairs = float((gap * done + gap * (gap + 1) / 2).sum())
        return float(self.cost.draft_pass(float(gap.sum()), float(done.sum()), pairs,
                                          PassShape(0, 0.0, gap, done)))

    def window_counts(self) -> tuple[int, int]:
        c = self.spec.concurrency
        # At least two completions of warm-up: the loop starts mid-flight, so
        # at one request the first completion can come a dozen steps in, and
        # a window opened there held the controller's cold start (its first
        # ~40 steps, measured on its own by benchmarks/cold_start.py).
        return (max(2, round(self.spec.warmup * c)),
                max(self.spec.min_window, round(self.spec.measure * c)))

    def run(self) -> Metrics:
        """Run until the measured window is complete.

        The window is counted in request completions, not steps: it opens at
        the ``W``-th completion (``warmup`` generations of ``concurrency``
        requests, at least two) and closes at the ``W + M``-th (``measure`` generations,
        at least ``min_window``).  At low concurrency a window cut at arbitrary steps
        would hold a whole prefill or none (on the CPU a prefill costs tens
        of decode steps); between completions it holds whole request
        lifetimes, and at one request every policy measures exactly the same
        requests (difficulty lives in the text, see ``scenarios``)."""
        w, m = self.window_counts()
        for _ in range(self.spec.max_steps):
            if not self.step(measure=len(self.completions) >= w):
                break
            if len(self.completions) >= w + m:
                break
        ev = self.completions
        if len(ev) >= w + 1:
            end = min(w + m, len(ev)) - 1
            (_, t_a, n_a), (_, t_b, n_b) = ev[w - 1], ev[end]
            self.window = (t_b - t_a, n_b - n_a, end - (w - 1))
        else:  # too few completions within max_steps: the measured steps
            self.window = (self.m.seconds, self.m.tokens, 0)
        return self.m

    def run_to_completion(self, max_steps: int = 1_000_000) -> None:
        """Finite workloads: step until every request is done."""
        for _ in range(max_steps):
            if not self.step(measure=True):
                return


def setup_for(spec: CellSpec) -> Setup:
    return make_setup(spec.setup, gpu=spec.gpu, draft_at_k0=spec.draft_at_k0, tp=spec.tp,
                      noise=spec.noise)


def _result(spec: CellSpec, engine: Engine) -> dict:
    m = engine.m
    ctrl = engine.policy.controller
    out = {
        "key": spec.key(),
        **{k: v for k, v in asdict(spec).items()},
        "goodput": engine.window[1] / engine.window[0] if engine.window[0] > 0 else 0.0,
        "window_seconds": engine.window[0],
        "window_completions": engine.window[2],
        "mean_latency_s": float(np.mean(engine.latencies)) if engine.latencies else None,
        "steps_measured": m.steps,
        "seconds": m.seconds,
        "tokens": m.tokens,
        "mean_k_step": m.sum_k_step / max(m.steps, 1),
        "mean_k": m.drafted / max(m.decode_request_steps, 1),
        "acceptance": m.accepted / m.drafted if m.drafted else None,
        "fallback_frac": (m.fallback_request_steps / max(m.planned_request_steps, 1)
                          if engine.policy.speculative else None),
        "finished": m.finished,
        "mean_decode_batch": m.decode_request_steps / max(m.steps, 1),
        "prefill_share": m.prefill_tokens / max(
            m.prefill_tokens + m.decode_request_steps + m.drafted, 1),
    }
    if ctrl is not None:
        st = ctrl.stats
        corr = ctrl.pricer.correction
        out["controller"] = {
            "probes_sent": st.probes_sent, "probes_succeeded": st.probes_succeeded,
            "recoveries": st.recoveries,
            "invariant_violations": engine.policy.violations,
            # The profile's correction: its common level ("common") and the
            # step shapes the steps used, "<tokens>x<requests>" (each band's
            # first value) -> ratio of measured to profiled time.
            "correction": corr.learnt(),
        }
    out["clock"] = {"cold_steps": engine.timer.cold_steps_run, "stalls": engine.timer.stalls}
    return out


def run_cell(spec: CellSpec) -> dict:
    """One (setup, scenario, policy, concurrency, seed) cell -> result dict."""
    engine = Engine(spec, setup_for(spec))
    engine.run()
    return _result(spec, engine)


def record_trace(spec: CellSpec) -> tuple[dict, Trace]:
    """Run a cell and return its result and the acceptance trace it saw."""
    engine = Engine(spec, setup_for(spec), record=True)
    engine.run()
    header = {"version": 1, "source": f"vllm_specplug.tools.sim {spec.key()}",
              "max_k": engine.setup.max_k}
    return _result(spec, engine), Trace(list(engine.trace_requests.values()), header)


def with_policy(spec: CellSpec, policy: str) -> CellSpec:
    return replace(spec, policy=policy)


__all__ = ["CellSpec", "Engine", "POLICIES", "STATIC_KS", "run_cell", "record_trace",
           "make_policy", "setup_for", "with_policy"]
