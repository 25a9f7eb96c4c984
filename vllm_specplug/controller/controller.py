"""The controller: estimator + cost model + policy + re-probing, composed.

This is the one object the vLLM adapter talks to.  It knows request ids,
draft counts and seconds; it knows nothing about vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_specplug.controller import compiled
from vllm_specplug.controller.cost_model import CostPrior, StepCostModel
from vllm_specplug.controller.estimator import AcceptanceEstimator
from vllm_specplug.controller.policy import (
    Decision,
    GoodputPolicy,
    HeuristicPolicy,
    StaticPolicy,
)


@dataclass
class ControllerSettings:
    max_k: int
    policy: str = "goodput"
    static_k: int | None = None
    forgetting: float = 0.9
    prior_strength: float = 0.5
    initial_acceptance: float = 0.6
    cost_forgetting: float = 0.99
    min_gain: float = 0.02
    probe_k: int = 1
    probe_interval: int = 4
    probe_max_interval: int = 32
    # The compiled loops of vllm_specplug.controller.compiled when numba is
    # there (same decisions; tests turn them off to check the NumPy paths).
    use_compiled: bool = True


@dataclass
class ControllerStats:
    steps: int = 0
    sum_k_step: int = 0
    request_steps: int = 0
    granted_slots: int = 0
    fallback_request_steps: int = 0
    probes_sent: int = 0
    probes_succeeded: int = 0
    recoveries: int = 0
    plain_anchors: int = 0
    plain_anchors_skipped: int = 0
    drafted: int = 0
    accepted: int = 0
    # k_counts[k]: request-steps that were granted k drafts.
    k_counts: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))

    @property
    def k_histogram(self) -> dict[int, int]:
        return {k: int(n) for k, n in enumerate(self.k_counts.tolist()) if n}


class SpecController:
    """Per-request state is a set of arrays indexed by the estimator's row.

    A decision for a batch of 64 is then a few dozen array operations instead
    of a Python loop over requests: it runs inside ``schedule()`` every step.
    """

    def __init__(self, settings: ControllerSettings, cost_prior: CostPrior | None = None):
        if settings.max_k < 0:
            raise ValueError("max_k must be >= 0")
        self.settings = settings
        width = max(settings.max_k, 1)
        self.estimator = AcceptanceEstimator(
            width,
            forgetting=settings.forgetting,
            prior_strength=settings.prior_strength,
            initial_acceptance=settings.initial_acceptance,
            use_compiled=settings.use_compiled,
        )
        self.cost = StepCostModel(cost_prior, forgetting=settings.cost_forgetting)
        self.goodput = GoodputPolicy(min_gain=settings.min_gain,
                                     use_compiled=settings.use_compiled)
        static_k = settings.max_k if settings.static_k is None else settings.static_k
        self.static = StaticPolicy(static_k)
        self.heuristic = HeuristicPolicy(initial_k=settings.max_k, max_k=settings.max_k)
        self._row_of = self.estimator._rows  # req_id -> row, owned by the estimator
        self._last_ids: list[str] | None = None
        self._any_dirty = False
        self._probe_check: tuple | None = None
        self._catchup_tokens = 0
        self._since_plain = 0
        self._anchor_left = 0
        self._anchor_interval = self.PLAIN_ANCHOR_FIRST
        self._anchors_skipped_in_row = 0
        # Measured seconds of the latest plain decode-only step, per batch size.
        self._plain_measured: dict[int, float] = {}
        self._due_buffer = np.empty(0, dtype=np.int64)
        self._alloc(self.estimator.capacity)
        self.stats = ControllerStats(k_counts=np.zeros(settings.max_k + 1, dtype=np.int64))
        self.last_decision: Decision | None = None

    # Columns of _probe_state: the back-off (steps in fallback before the next
    # probe), steps waited so far, a probe pending, when it was sent, its size
    # (drafts), whether the last probe was accepted, whether in fallback.
    _PROBE_FIELDS = ("_backoff", "_fallback_steps", "_probing", "_probe_at",
                     "_probe_size", "_last_probe_ok", "_in_fallback")

    def _alloc(self, capacity: int) -> None:
        """(Re)allocate the per-row arrays, keeping what they hold."""
        def grow(name, dtype, fill=0):
            old = getattr(self, name, None)
            new = np.full(capacity, fill, dtype=dtype)
            if old is not None:
                new[: old.size] = old
            setattr(self, name, new)

        grow("_ceiling", np.int64)
        # Probe state, one row per request in one integer table, so that
        # _apply_probes reads and writes a batch's state with one gather and
        # one scatter instead of one per field (it runs every step, and each
        # NumPy call costs microseconds).  The named attributes are column
        # views; the flags hold 0/1.
        old = getattr(self, "_probe_state", None)
        state = np.zeros((capacity, len(self._PROBE_FIELDS)), dtype=np.int64)
        state[:, self._PROBE_FIELDS.index("_backoff")] = self.settings.probe_interval
        state[:, self._PROBE_FIELDS.index("_probe_size")] = self.settings.probe_k
        if old is not None:
            state[: old.shape[0]] = old
        self._probe_state = state
        for col, name in enumerate(self._PROBE_FIELDS):
            setattr(self, name, state[:, col])
        # Any probe state differing from a freshly speculating request's.
        grow("_dirty", bool)
        self.heuristic.ensure_capacity(capacity)

    # -- request lifecycle -------------------------------------------------
    def add_request(self, req_id: str, ceiling: int | None = None) -> None:
        if req_id in self._row_of:
            return
        cap = self.settings.max_k if ceiling is None else min(ceiling, self.settings.max_k)
        row = self.estimator.add(req_id)
        if row >= self._ceiling.size:
            self._alloc(self.estimator.capacity)
        self._ceiling[row] = cap
        self._last_ids = None
        self._backoff[row] = self.settings.probe_interval
        self._fallback_steps[row] = 0
        self._probing[row] = False
        self._probe_size[row] = self.settings.probe_k
        self._last_probe_ok[row] = False
        self._in_fallback[row] = False
        self._dirty[row] = False
        self.heuristic.reset(row)

    def set_ceiling(self, req_id: str, ceiling: int) -> None:
        """Change a live request's ceiling (0 turns its speculation off).

        Used by tests to force a request into fallback and back; the next
        plan honours it.
        """
        row = self._row_of.get(req_id)
        if row is None:
            return
        self._ceiling[row] = max(0, min(int(ceiling), self.settings.max_k))
        self._last_ids = None

    def finish_request(self, req_id: str) -> None:
        row = self._row_of.get(req_id)
        if row is None:
            return
        self._in_fallback[row] = False
        self._dirty[row] = False
        self._last_ids = None
        self.estimator.remove(req_id)

    def num_requests(self) -> int:
        return len(self._row_of)

    def num_in_fallback(self) -> int:
        # Freed rows are cleared in finish_request, so all rows can be counted.
        return int(np.count_nonzero(self._in_fallback))


    def _rows(self, req_ids: list[str]) -> np.ndarray:
        # The batch is usually the same list of requests step after step:
        # comparing the lists (same string objects) is far cheaper than
        # looking every id up again.
        if req_ids == self._last_ids:
            return self._last_rows
        get = self._row_of.get
        rows = [get(r) for r in req_ids]
        if None in rows:
            for r in req_ids:
                self.add_request(r)
            rows = [self._row_of[r] for r in req_ids]
        rows = np.array(rows, dtype=np.intp)
        self._last_ids = list(req_ids)
        self._last_rows = rows
        ceilings = self._ceiling[rows]
        self._last_ceilings = ceilings
        self._last_capped = bool(ceilings.min(initial=self.settings.max_k)
                                 < max(self.settings.max_k, 1))
        self._last_n_off = int(np.count_nonzero(ceilings == 0))
        return rows

    # -- learning ----------------------------------------------------------
    def observe_verification(self, req_id: str, drafted: int, accepted: int) -> None:
        self.observe_verifications([req_id], [drafted], [accepted])

    def observe_verifications(self, req_ids, drafted, accepted) -> None:
        """One step's verification outcome for many requests at once.

        ``drafted[i]`` drafts were verified for ``req_ids[i]`` and the first
        ``accepted[i]`` of them were kept.  Unknown (finished) requests and
        entries with nothing drafted are ignored.
        """
        get = self._row_of.get
        rows = [get(r) for r in req_ids]
        if None in rows:
            known = [i for i, r in enumerate(rows) if r is not None]
            rows = [rows[i] for i in known]
            drafted = [drafted[i] for i in known]
            accepted = [accepted[i] for i in known]
        rows = np.array(rows, dtype=np.intp)
        drafted = np.asarray(drafted, dtype=np.int64)
        accepted = np.asarray(accepted, dtype=np.int64)
        keep = drafted > 0
        if np.count_nonzero(keep) < keep.size:
            rows, drafted, accepted = rows[keep], drafted[keep], accepted[keep]
        if rows.size == 0:
            return
        accepted = np.minimum(np.maximum(accepted, 0), drafted)
        self.estimator.observe_rows(rows, drafted, accepted)
        if self.settings.policy == "heuristic":
            self.heuristic.observe(rows, drafted, accepted)
        self.stats.drafted += int(np.add.reduce(drafted))
        self.stats.accepted += int(np.add.reduce(accepted))
        probing = self._probing[rows] != 0
        if np.count_nonzero(probing):
            ok = accepted >= drafted
            probe_rows = rows[probing]
            self._probing[probe_rows] = False
            self._last_probe_ok[probe_rows] = ok[probing]
            self.stats.probes_succeeded += int(np.count_nonzero(ok & probing))
            failed = rows[probing & ~ok]
            self._backoff[failed] = np.minimum(
                self._backoff[failed] * 2, self.settings.probe_max_interval)
            self._probe_size[failed] = self.settings.probe_k
            passed = rows[probing & ok]
            # The next probe tests twice as many positions: a request whose
            # drafts turned good climbs back in a few probes, not one slot
            # at a time.
            self._probe_size[passed] = np.minimum(self._probe_size[passed] * 2,
                                                  self._ceiling[passed])

    def observe_step(self, batch: int, tokens: int, k_step: int, seconds: float,
                     catchup_tokens: int = 0) -> None:
        kept = self.cost.observe(batch, tokens, k_step, seconds, catchup_tokens)
        if kept and k_step == 0 and tokens == batch and not catchup_tokens:
            self._plain_measured[int(batch)] = float(seconds)

    # -- deciding ----------------------------------------------------------
    def plan(
        self,
        req_ids: list[str],
        base_tokens: int | None = None,
        fixed_k_step: int | None = None,
        catchup_tokens: int = 0,
    ) -> Decision:
        """K for each of ``req_ids`` (decoding requests) in the next step.

        ``base_tokens`` is the number of non-draft tokens the next step is
        expected to schedule (defaults to one per request).  ``fixed_k_step``
        pins K_step for proposers that need it (and for data parallelism).
        ``catchup_tokens``: tokens a draft model skipped (zero-cost fallback)
        and must process before it drafts again.  A probe must be worth it
        (see ``_hopeful_depth``); a plan that speculates anyway is not
        charged, since the catch-up is owed whenever it resumes (charged,
        the debt grows with every step in fallback, and a request whose
        drafts turned perfect never resumed).
        """
        batch = len(req_ids)
        if batch == 0:
            return Decision(k_step=fixed_k_step or 0, k=np.zeros(0, dtype=np.int64))
        rows = self._rows(req_ids)
        ceilings = self._last_ceilings
        policy = self.settings.policy
        if policy == "static":
            decision = self.static.decide(ceilings, fixed_k_step)
        elif policy == "heuristic":
            decision = self.heuristic.decide(rows, ceilings, fixed_k_step)
        else:
            decision = self.goodput.decide(
                self.estimator.survival(rows),
                ceilings,
                float(batch if base_tokens is None else base_tokens),
                self.cost,
                fixed_k_step,
                capped=self._last_capped,
                explore=self._may_explore(catchup_tokens),
            )
            self._catchup_tokens = catchup_tokens
            anchor = self._maybe_plain_anchor(decision) if fixed_k_step is None else decision
            if anchor is decision:
                self._apply_probes(rows, ceilings, decision,
                                   float(batch if base_tokens is None else base_tokens),
                                   fixed_k_step)
            else:
                # A plain anchor step: no probe goes out in it (a probe
                # planned and then dropped by the anchor was never verified,
                # timed out and counted as failed, doubling the request's
                # back-off), and the step does not count as fallback.
                decision = anchor
        if catchup_tokens and decision.k_step > 0:
            decision.predicted_seconds += self.cost.catchup_seconds(catchup_tokens, len(req_ids))
        self._account(rows, decision)
        self.last_decision = decision
        return decision

    # Drafting steps the cost model must have fitted before a plan that needs
    # a draft catch-up is judged without optimism (see _may_explore).
    EXPLORE_DRAFTING_STEPS = 4

    def _may_explore(self, catchup_tokens: int) -> bool:
        """Whether the plan may use the cost bound's optimism (untried plans look cheaper).

        Optimism gets an untried plan measured once.  With zero-cost fallback
        a plan that drafts first makes the draft catch up on every token it
        skipped (on the CPU profile, the time of 10-20 plain steps), so once
        the draft's price has been measured such a plan is judged at the
        point estimate; re-entry after a long fallback is the probes' job.
        Before that, a fresh engine must explore: its cost prior can price
        drafts far off (7x too high on the tiny test models), and judged at
        the prior a perfect draft never ran.
        """
        return (not catchup_tokens
                or self.cost.num_drafting_observations < self.EXPLORE_DRAFTING_STEPS)

    def _apply_probes(self, rows: np.ndarray, ceilings: np.ndarray, decision: Decision,
                      base_tokens: float, fixed_k_step: int | None) -> None:
        """Force a small probe on requests that sat in fallback long enough.

        A request that gets no drafts while its ceiling allows some is in
        fallback; after ``backoff`` such steps it gets a probe: ``probe_k``
        drafts, twice as many after each accepted probe.
        The probe's outcome arrives one or two steps later (the drafts are
        proposed at the end of this step and verified in the next; async
        scheduling adds a step), so a probe stays pending until it is
        observed, or until ``PROBE_TIMEOUT`` plans have passed without a
        verification (e.g. n-gram lookup found nothing to propose), which
        counts as a failure.  A failed probe doubles the back-off (up to
        ``probe_max_interval``); a successful one makes the next probe come
        at once, so a request whose text turned easy climbs back within a
        few steps.

        A probe is sent only when it could pay: if these requests' drafts
        were accepted with probability ``PROBE_OPTIMISM`` per position, would
        the policy give them slots at today's costs, including a share of the
        draft catch-up the probe triggers (zero-cost fallback)?  In a compute-bound
        batch, or when the draft pass costs more than good drafts could
        return, the answer is no and nothing is probed.  The probe is no
        deeper than the slots that hopeful plan would grant them, nor than
        the K_step of a plan that drafts.
        """
        k = decision.k
        granted = k
        if decision.decode_only_k is not None:
            # This step's prefill chunk takes it past the cost knee, where
            # every draft costs its compute.  A request the batch's plan
            # without the chunk would draft for is left out by the chunk,
            # not by its drafts: it is not in fallback, and a probe would
            # re-test drafts the policy already wants, at the higher price.
            # (Simulated 8B + EAGLE at c=256, hard text: two steps in three
            # carry a chunk; counted as fallback, runs of them made whole
            # batches due, and probes of 240 requests went out in them.)
            granted = np.where(k > 0, k, decision.decode_only_k)
        if not self._any_dirty and np.count_nonzero(granted) == granted.size:
            return  # everyone speculates and nobody carries probe state
        now = self.stats.steps
        due_idx = self._advance_probe_state(rows, ceilings, granted, now)
        if due_idx.size:
            due_idx = self._defer_probes_past_the_knee(rows, due_idx, base_tokens)
        depth = (self._probe_depth(rows, ceilings, due_idx, base_tokens, fixed_k_step)
                 if due_idx.size else 0)
        if decision.k_step > 0 and fixed_k_step is None:
            # A step that drafts already runs K_step draft positions; a
            # deeper probe would add a draft pass over the whole batch for
            # a few requests' tokens.  (Simulated 8B + EAGLE at c=256: the
            # decode-only steps draft one position for the requests the
            # knee has room for, and probes of two drafts for the four or
            # so left out (0.9 tokens) ran a second EAGLE pass, 0.48 ms, in
            # half of them.)  Once a probe is accepted, the plan itself
            # grants deeper slots where they pay.
            depth = min(depth, decision.k_step)
        if depth > 0:
            due_rows = rows[due_idx]
            # A probe is no deeper than a good request would be granted: in
            # a large batch every extra draft position is a draft pass over
            # the whole batch, and a probe of 8 would pay 7 of them for one
            # request's few tokens.
            probe_k = np.minimum(np.minimum(self._probe_size[due_rows], ceilings[due_idx]),
                                 depth)
            k[due_idx] = probe_k
            self._probing[due_rows] = 1
            self._fallback_steps[due_rows] = 0
            self._probe_at[due_rows] = now
            self.stats.probes_sent += int(due_idx.size)
            if fixed_k_step is None:
                decision.k_step = max(decision.k_step, *probe_k.tolist())
        self._any_dirty = bool(np.count_nonzero(self._dirty))

    def _defer_probes_past_the_knee(self, rows: np.ndarray, due_idx: np.ndarray,
                                    base_tokens: float) -> np.ndarray:
        """The due probes that go out in this step; the others wait for a cheaper one.

        Past the cost model's knee a draft costs its compute; below it,
        almost nothing.  When a prefill chunk pushes this step past the knee
        but a decode-only step of this batch would stay below it, a probe
        waits for such a step, up to twice its back-off.  (Simulated 8B +
        EAGLE at c=256, hard text: two steps in three carry a 512-token
        prefill chunk, and runs of them put 29 probes a step, each paying
        the compute-bound price, into steps where the policy drafted none.)
        """
        knee, _ = self.cost.knee_terms()
        n = float(due_idx.size)
        if not (rows.size + n <= knee < base_tokens + n):
            return due_idx
        due_rows = rows[due_idx]
        late = self._fallback_steps[due_rows] >= 2 * self._backoff[due_rows]
        return due_idx[late]

    def _advance_probe_state(self, rows: np.ndarray, ceilings: np.ndarray, k: np.ndarray,
                             now: int) -> np.ndarray:
        """One step of every request's probe state; returns the batch positions due a probe.

        Compiled (``compiled.advance_probes``) when numba is there; this
        NumPy form is the reference the tests compare it with.
        """
        s = self.settings
        if s.use_compiled and compiled.advance_probes is not None:
            due = self._due_buffer
            if due.size < rows.size:
                due = self._due_buffer = np.empty(2 * rows.size, dtype=np.int64)
            n_due, recoveries = compiled.advance_probes(
                k, ceilings, rows, self._probe_state, self._dirty, now, s.probe_k,
                s.probe_interval, s.probe_max_interval, self.PROBE_TIMEOUT, due)
            self.stats.recoveries += recoveries
            return due[:n_due]
        fallback = k == 0
        if self._last_n_off:
            fallback &= ceilings > 0
        # Rows with probe state to update: in fallback now, or carrying state
        # from an earlier fallback.  Usually none or few, so work on them only.
        touched = fallback | self._dirty[rows]
        # (np.count_nonzero and .nonzero() rather than .any() and
        # np.flatnonzero: a fraction of the per-call overhead.)
        if not np.count_nonzero(touched):
            return touched.nonzero()[0]
        idx = touched.nonzero()[0]  # positions in the batch
        sub = rows[idx]
        fallback = fallback[idx]
        speculating = k[idx] > 0
        state = self._probe_state[sub]
        backoff, steps, probing_col, probe_at, size, last_ok_col, in_fallback = state.T
        probing = probing_col != 0
        last_ok = last_ok_col != 0
        if np.count_nonzero(speculating):
            self.stats.recoveries += int(np.count_nonzero(
                speculating & (in_fallback != 0) & last_ok))
            # Requests that speculate again start over.
            size[speculating] = s.probe_k
            backoff[speculating] = s.probe_interval
            steps[speculating] = 0
            last_ok[speculating] = False
        if np.count_nonzero(probing):
            expired = probing & (now - probe_at >= self.PROBE_TIMEOUT)
            if np.count_nonzero(expired):
                size[expired] = s.probe_k
                backoff[expired] = np.minimum(backoff[expired] * 2, s.probe_max_interval)
                probing[expired] = False
                last_ok[expired] = False
        waiting = fallback & ~probing
        steps += waiting
        in_fallback[:] = fallback
        probing_col[:] = probing
        last_ok_col[:] = last_ok
        self._probe_state[sub] = state
        self._dirty[sub] = fallback | probing | last_ok
        # After an accepted probe the next one is due at once (waiting rows
        # have waited at least the step just counted).
        return idx[waiting & ((steps >= backoff) | last_ok)]

    # A plain step (K_step=0) at least this often while speculating: the
    # first after PLAIN_ANCHOR_FIRST steps, then doubling up to _MAX.
    PLAIN_ANCHOR_FIRST = 8
    PLAIN_ANCHOR_MAX = 64
    # Two plans: the first step after a speculative one still verifies its
    # drafts; the second is a pure plain step (one token per request, no
    # draft pass), the point the fit needs.
    PLAIN_ANCHOR_STEPS = 2
    # An anchor waits (see _anchor_can_wait) when the plan runs at least
    # PLAIN_ANCHOR_SKIP_SPEEDUP times the rate of the plain step last
    # measured at this batch size, once the knee has held through
    # PLAIN_ANCHOR_SKIP_KNEE_HELD searches, PLAIN_ANCHOR_SKIP_MAX times in a row at most.
    PLAIN_ANCHOR_SKIP_SPEEDUP = 2.0
    PLAIN_ANCHOR_SKIP_MAX = 3
    PLAIN_ANCHOR_SKIP_KNEE_HELD = 2

    def _maybe_plain_anchor(self, decision: Decision) -> Decision:
        """Now and then plan a plain step among speculative ones.

        Speculation is judged against plain decoding's step time, which the
        cost model can only extrapolate while every step speculates: steps
        that verify k drafts and run k draft passes vary the two together,
        so the fit cannot tell the step's fixed cost from its per-token cost
        and may put plain decoding far from where it is (on a CPU whose
        forward pass is compute-bound from one token on, it made plain look
        40% slower than measured and kept a losing K).  One plain step in up
        to ``PLAIN_ANCHOR_MAX`` (two plans, see ``PLAIN_ANCHOR_STEPS``)
        measures it, at the price of those steps' speculation gain; where
        speculation wins by far, an anchor waits (``_anchor_can_wait``).
        """
        if decision.k_step == 0:
            self._since_plain = 0
            self._anchor_left = 0
            return decision
        if self._anchor_left == 0:
            self._since_plain += 1
            if self._since_plain < self._anchor_interval:
                return decision
            self._since_plain = 0
            self._anchor_interval = min(self._anchor_interval * 2, self.PLAIN_ANCHOR_MAX)
            if self._anchor_can_wait(decision):
                self._anchors_skipped_in_row += 1
                self.stats.plain_anchors_skipped += 1
                return decision
            self._anchors_skipped_in_row = 0
            self.stats.plain_anchors += 1
            self._anchor_left = self.PLAIN_ANCHOR_STEPS
        self._anchor_left -= 1
        return Decision(k_step=0, k=np.zeros_like(decision.k),
                        predicted_seconds=decision.plain_seconds,
                        predicted_tokens=decision.plain_tokens,
                        plain_seconds=decision.plain_seconds,
                        plain_tokens=decision.plain_tokens)

    def _anchor_can_wait(self, decision: Decision) -> bool:
        """Whether a due plain anchor can be skipped: speculation wins by far.

        The anchor guards against a plain step the fit can only extrapolate,
        and the extrapolation can be far off: on synthetic compute-bound
        steps (``test_controller``) it put plain decoding at 1.9x its true
        time.  So the test is against a *measured* plain step of the same
        batch size (the latest, kept when the cost model kept the sample),
        not the fit's:
        where the plan's predicted rate (its tokens from measured acceptance,
        its seconds from measured speculative steps) is at least
        ``PLAIN_ANCHOR_SKIP_SPEEDUP`` times that step's, no plain estimate
        the anchor could bring would make speculating the wrong choice.
        Memory-bound at a few requests with good drafts (a 70B target with a
        1B draft, simulated) the anchors cost 2-3% of the rate.

        The anchor's plain step is also the smallest step the knee search
        sees: skipped at 64 requests (simulated 8B + EAGLE), the cost model
        put the knee at 362 tokens instead of 256 until the next anchor.  So
        an anchor waits only once the knee (or its absence) has held through
        ``PLAIN_ANCHOR_SKIP_KNEE_HELD`` searches, and at most
        ``PLAIN_ANCHOR_SKIP_MAX`` in a row, so that the measurement is
        renewed (contexts grow, a sample may have been slow) and a skip that
        was wrong is found.
        """
        batch = decision.k.size
        measured = self._plain_measured.get(batch)
        if (measured is None or self._anchors_skipped_in_row >= self.PLAIN_ANCHOR_SKIP_MAX
                or self.cost.knee_searches_unchanged < self.PLAIN_ANCHOR_SKIP_KNEE_HELD
                or not decision.predicted_seconds > 0):
            return False
        rate = decision.predicted_tokens / decision.predicted_seconds
        return rate >= self.PLAIN_ANCHOR_SKIP_SPEEDUP * batch / measured

    # Per-position acceptance a probe is hoping for.
    PROBE_OPTIMISM = 0.9
    # Plans after which a probe with no verification counts as failed: the
    # probe's drafts are verified one step after it is planned, and observed
    # one step later still under async scheduling.
    PROBE_TIMEOUT = 3

    def _probe_depth(self, rows: np.ndarray, ceilings: np.ndarray, due_idx: np.ndarray,
                     base_tokens: float, fixed_k_step: int | None) -> int:
        """How many drafts the policy would give the due requests if their drafts were good.

        0 means no probe can pay.  The answer depends on costs and on the
        batch, which change slowly; it is reused for ``PROBE_CHECK_STEPS``
        plans at the same batch size, so a large batch in fallback does not
        pay for a second plan every step.
        """
        key = (rows.size, fixed_k_step)
        cached = self._probe_check
        if cached is not None and cached[0] == key and self.stats.steps - cached[1] < self.PROBE_CHECK_STEPS:
            return cached[2]
        answer = self._hopeful_depth(rows, ceilings, due_idx, base_tokens, fixed_k_step)
        self._probe_check = (key, self.stats.steps, answer)
        return answer

    PROBE_CHECK_STEPS = 8

    def _hopeful_depth(self, rows, ceilings, due_idx, base_tokens, fixed_k_step) -> int:
        width = self.estimator.max_positions
        hopeful = self.estimator.survival(rows)
        hopeful[due_idx] = (self.PROBE_OPTIMISM ** np.arange(1, width + 1))[None, :] - (
            rows[due_idx] * AcceptanceEstimator.TIE_BREAK)[:, None]
        plan = self.goodput.decide(hopeful, ceilings, base_tokens, self.cost, fixed_k_step,
                                   capped=self._last_capped,
                                   catchup_tokens=self._catchup_tokens)
        return int(plan.k[due_idx].max(initial=0))

    def _account(self, rows: np.ndarray, decision: Decision) -> None:
        s = self.stats
        k = decision.k
        counts = np.bincount(k, minlength=s.k_counts.size)
        s.k_counts += counts[: s.k_counts.size]
        s.steps += 1
        s.sum_k_step += int(decision.k_step)
        s.request_steps += rows.size
        s.granted_slots += int(k.sum())
        s.fallback_request_steps += int(counts[0]) - self._last_n_off
