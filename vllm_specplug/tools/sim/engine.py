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

from dataclasses import dataclass

import numpy as np

from vllm_specplug.tools.sim.cell import CellSpec, _seed
from vllm_specplug.tools.sim.clock import Realism, StepClock
from vllm_specplug.tools.sim.cost import PassShape, Setup, StepCost
from vllm_specplug.tools.sim.devices import decision_seconds
from vllm_specplug.tools.sim.policies import Controller, Oracle, make_policy
from vllm_specplug.tools.sim.profile import measure_profile
from vllm_specplug.tools.sim.scenarios import RequestSpec, make_scenario
from vllm_specplug.tools.sim.trace import TraceRequest


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
        # And what would be pending after this step if it skipped the draft:
        # a prompt's tokens add nothing (zero_cost.ZeroCostBook._if_plain).
        self.catchup_if_plain = self.catchup_pending + len(dec) if zero_cost else None
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


__all__ = ["Engine", "Metrics"]
