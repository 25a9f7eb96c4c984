"""The controller: estimator + step-cost profile + policy + re-probing, composed.

This is the one object the vLLM adapter talks to.  It knows request ids,
draft counts and seconds; it knows nothing about vLLM.

Prices come from the step-cost profile measured before serving; live step
times only feed the profile's clipped correction (``ProfileCorrection``).
What is learnt online is acceptance.  Exploration concerns acceptance: a
request in fallback is re-probed with a small draft on a doubling back-off,
and only when the profile says good drafts would pay; and the one price the
correction cannot learn by itself, a plain step at a batch size where the
plan always drafts, which a short run of plain steps measures (both in
``probes.py``, whose ``Probes`` this class inherits).
"""

from __future__ import annotations

import numba
import numpy as np

from vllm_specplug.controller.baselines import HeuristicPolicy, StaticPolicy
from vllm_specplug.controller.confidence import ConfidenceCalibration, StopRule, plan_stop_rule
from vllm_specplug.controller.correction import ProfileCorrection
from vllm_specplug.controller.estimator import AcceptanceEstimator
from vllm_specplug.controller.horizon import Horizon
from vllm_specplug.controller.policy import GoodputPolicy
from vllm_specplug.controller.pricing import Decision, StepPricer
from vllm_specplug.controller.probes import Probes, _probe_verdicts
from vllm_specplug.controller.profile import UNKNOWN_DRAFT_RATIO, StepProfile, prior_profile
from vllm_specplug.controller.settings import ControllerSettings, ControllerStats, _count_plan


@numba.njit(cache=True)
def _verified(rows, drafted, accepted):
    """The verifications of requests that drafted, acceptance clipped to [0, drafted]:
    rows, drafted, accepted, and their totals."""
    n = 0
    for i in range(rows.size):
        n += drafted[i] > 0
    out_rows, out_d, out_a = (np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64),
                              np.empty(n, dtype=np.int64))
    j = total_d = total_a = 0
    for i in range(rows.size):
        if drafted[i] > 0:
            out_rows[j], out_d[j] = rows[i], drafted[i]
            out_a[j] = min(max(accepted[i], 0), drafted[i])
            total_d += out_d[j]
            total_a += out_a[j]
            j += 1
    return out_rows, out_d, out_a, total_d, total_a


class SpecController(Probes):
    """Per-request state is a set of arrays indexed by the estimator's row.

    A decision for a batch of 64 is then a few dozen array operations instead
    of a Python loop over requests: it runs inside ``schedule()`` every step.
    """

    def __init__(self, settings: ControllerSettings, profile: StepProfile | None = None):
        if settings.max_k < 0:
            raise ValueError("max_k must be >= 0")
        self.settings = settings
        width = max(settings.max_k, 1)
        self.estimator = AcceptanceEstimator(
            width,
            forgetting=settings.forgetting,
            prior_strength=settings.prior_strength,
            initial_acceptance=settings.initial_acceptance,
        )
        if profile is None:
            profile = prior_profile("cpu", UNKNOWN_DRAFT_RATIO, 64 * (width + 1), 64)
        self.pricer = StepPricer(profile, ProfileCorrection(), width)
        check = profile.meta.get("start_check")
        if check and settings.profile_correction:
            self.pricer.correction.seed(check["plain_batches"], check["repeats"],
                                        check["plain"], check["drafting"])
        self.goodput = GoodputPolicy(min_gain=settings.min_gain)
        self.horizon = Horizon(width)
        static_k = settings.max_k if settings.static_k is None else settings.static_k
        self.static = StaticPolicy(min(static_k, settings.max_k))
        self.heuristic = HeuristicPolicy(initial_k=settings.max_k, max_k=settings.max_k)
        self._row_of = self.estimator.row_of  # req_id -> row, kept by the estimator
        self._last_ids: list[str] | None = None
        self._alloc(self.estimator.capacity)
        self.stats = ControllerStats(k_counts=np.zeros(settings.max_k + 1, dtype=np.int64))
        self.last_decision: Decision | None = None
        self.calibration = ConfidenceCalibration(width)
        # The survival a probe hopes for (PROBE_OPTIMISM per position).
        self._hope = self.PROBE_OPTIMISM ** np.arange(1.0, width + 1)
        # A plain probe's request band and the plain steps it has left; the
        # correction's observations before the next may start.
        self._plain_probe_band, self._plain_probe_left = -1, 0
        self._plain_probe_after = self.PLAIN_PROBE_STEPS

    @property
    def profile(self) -> StepProfile:
        return self.pricer.profile

    def set_profile(self, profile: StepProfile) -> None:
        """Price from ``profile`` from now on (the live correction is kept)."""
        self.pricer = StepPricer(profile, self.pricer.correction, self.pricer.width)

    def ceiling(self, req_id: str) -> int | None:
        """A live request's ceiling on drafts, or None if it is not tracked."""
        row = self._row_of.get(req_id)
        return None if row is None else int(self._ceiling[row])

    def _alloc(self, capacity: int) -> None:
        """(Re)allocate the per-row arrays, keeping what they hold."""
        s = self.settings
        for name, fill in (("_ceiling", 0), ("_fixed", -1), ("_backoff", s.probe_interval),
                           ("_waited", 0),
                           ("_probe_at", -1), ("_probe_size", s.probe_k), ("_probe_ok", 0),
                           ("_in_fallback", 0), ("_first_left", -1), ("_last_left", -1)):
            old = getattr(self, name, None)
            new = np.full(capacity, fill, dtype=np.int64)
            if old is not None:
                new[: old.size] = old
            setattr(self, name, new)
        self.heuristic.ensure_capacity(capacity)

    # -- request lifecycle -------------------------------------------------
    def add_request(self, req_id: str, ceiling: int | None = None,
                    fixed_k: int | None = None) -> None:
        """Track a request; ``ceiling``: its cap on drafts; ``fixed_k``: drafts
        it asked for exactly (``specplug_k``), or None for the adaptive choice."""
        if req_id in self._row_of:
            return
        s = self.settings
        row = self.estimator.add(req_id)
        if row >= self._ceiling.size:
            self._alloc(self.estimator.capacity)
        self._ceiling[row] = s.max_k if ceiling is None else min(ceiling, s.max_k)
        self._fixed[row] = -1 if fixed_k is None else min(fixed_k, self._ceiling[row])
        self._reset_probe(np.array([row]))
        # A new request's own drafts are untested: its first step in
        # fallback sends a probe, without waiting out a back-off.
        self._waited[row] = s.probe_interval
        self._probe_ok[row] = 0
        self._in_fallback[row] = 0
        self._first_left[row] = self._last_left[row] = -1
        self._last_ids = None
        self.heuristic.reset(row)

    def set_ceiling(self, req_id: str, ceiling: int, fixed_k: int | None = None) -> None:
        """Change a live request's ceiling (0 turns its speculation off) and fixed k."""
        row = self._row_of.get(req_id)
        if row is None:
            return
        self._ceiling[row] = max(0, min(int(ceiling), self.settings.max_k))
        self._fixed[row] = -1 if fixed_k is None else min(max(int(fixed_k), 0), self._ceiling[row])
        self._last_ids = None

    def forget_acceptance(self, req_ids) -> None:
        """Start these requests' acceptance estimates again from the pool's.

        For requests whose drafts no longer come from what was observed (the
        draft's KV went stale under them)."""
        self.estimator.reset(list(req_ids))

    def finish_request(self, req_id: str) -> None:
        row = self._row_of.get(req_id)
        if row is None:
            return
        self._in_fallback[row] = 0
        if self._first_left[row] >= 0:
            self.horizon.finished(int(self._first_left[row] - self._last_left[row]),
                                  int(self._last_left[row]))
        self._last_ids = None
        self.estimator.remove(req_id)

    def num_requests(self) -> int:
        return len(self._row_of)

    def num_in_fallback(self) -> int:
        # Freed rows are cleared in finish_request, so all rows can be counted.
        return int(np.count_nonzero(self._in_fallback))

    def rows(self, req_ids: list[str]) -> np.ndarray:
        """The estimator's rows of the tracked requests among ``req_ids``, in order."""
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
        self._last_ids = list(req_ids)
        self._last_rows = np.array(rows, dtype=np.intp)
        return self._last_rows

    # -- learning ----------------------------------------------------------
    def observe_verification(self, req_id: str, drafted: int, accepted: int) -> None:
        self.observe_verifications([req_id], [drafted], [accepted])

    def observe_verifications(self, req_ids, drafted, accepted) -> None:
        """One step's verification outcome for many requests at once.

        ``drafted[i]`` drafts were verified for ``req_ids[i]`` and the first
        ``accepted[i]`` of them were kept.  Unknown (finished) requests and
        entries with nothing drafted are ignored.
        """
        d, a = np.asarray(drafted), np.asarray(accepted)
        if (isinstance(req_ids, list) and d.dtype.kind in "iu" and a.dtype.kind in "iu"
                and d.shape == a.shape == (len(req_ids),) and req_ids == self._last_ids):
            # The batch just planned (the usual case): its rows are known.
            rows, drafted, accepted, n_drafted, n_accepted = _verified(
                self._last_rows, d.astype(np.int64, copy=False), a.astype(np.int64, copy=False))
        else:
            get = self._row_of.get
            known = [(get(r), d, a) for r, d, a in zip(req_ids, drafted, accepted)
                     if d > 0 and get(r) is not None]
            if not known:
                return
            rows, drafted, accepted, n_drafted, n_accepted = _verified(
                *(np.array(x, dtype=np.int64) for x in zip(*known)))
        if not rows.size:
            return
        self.estimator.observe_rows(rows, drafted, accepted)
        if self.settings.policy == "heuristic":
            self.heuristic.observe(rows, drafted, accepted)
        self.stats.drafted += n_drafted
        self.stats.accepted += n_accepted
        s = self.settings
        self.stats.probes_succeeded += _probe_verdicts(
            rows, drafted, accepted, s.probe_k, s.probe_max_interval, self._ceiling,
            self._backoff, self._probe_at, self._probe_size, self._probe_ok)

    def observe_confidence(self, confidences: list, accepted: list) -> None:
        """Verified drafts with the draft's confidence in each (``ConfidenceCalibration``)."""
        self.calibration.observe(confidences, accepted)

    def observe_step(self, batch: int, tokens: int, k_step: int, seconds: float,
                     catchup_tokens: int = 0) -> bool:
        """A finished step's wall time: it corrects the profile's price of its shape."""
        if not self.settings.profile_correction:
            return False
        return self.pricer.observe(tokens, batch, k_step, seconds, catchup_tokens)

    # -- deciding ----------------------------------------------------------
    def plan(
        self,
        req_ids: list[str],
        base_tokens: int | None = None,
        fixed_k_step: int | None = None,
        catchup_tokens: int = 0,
        tokens_left=None,
        catchup_if_plain: int | None = None,
    ) -> Decision:
        """K for each of ``req_ids`` (decoding requests) in the next step.

        ``base_tokens`` is the number of non-draft tokens the next step is
        expected to schedule (defaults to one per request).  ``fixed_k_step``
        pins K_step for proposers that need it (and for data parallelism).
        ``catchup_tokens``: tokens a draft model skipped (zero-cost fallback)
        and must process before it drafts again.  ``tokens_left``: per
        request, ``max_tokens`` less its output so far.  Drafts planned now
        are verified next step, which yields at most k + 1 tokens, and this
        step yields at least one: a request can use at most ``tokens_left -
        2`` drafts (one capped at 0 is not in fallback).
        ``catchup_if_plain``: the catch-up tokens pending after this step if
        it drafts nothing.  With ``tokens_left``, the catch-up and the draft's
        pass over a prefill chunk are charged to drafting plans, what a plain
        step adds to the catch-up to plain decoding, per token the batch is
        expected to have left (``GoodputPolicy``, ``Horizon``).
        """
        batch = len(req_ids)
        self.horizon.ran(batch)
        if batch == 0:
            return Decision(k_step=fixed_k_step or 0, k=np.zeros(0, dtype=np.int64))
        rows = self.rows(req_ids)
        ceilings = self._ceiling[rows]
        policy = self.settings.policy
        caps = left = output = None
        if tokens_left is not None:
            left = np.asarray(tokens_left, dtype=np.int64)
            caps = np.maximum(left - 2, 0)
            first = self._first_left[rows]
            new = first < 0
            first = np.where(new, left, first)
            self._first_left[rows], self._last_left[rows] = first, left
            output = np.maximum(first - left, 0)
        # The static policy is vLLM's static K, a baseline: it drafts K up to
        # max_tokens as vLLM does.
        if caps is not None and policy != "static":
            ceilings = np.minimum(ceilings, caps)
        # Requests with a fixed k (``specplug_k``) get it, within their caps;
        # the policy plans the others as if those drafted none.
        fixed = self._fixed[rows]
        pinned = fixed >= 0
        forced = np.minimum(fixed, ceilings)
        if pinned.any():
            ceilings = np.where(pinned, 0, ceilings)
        base = float(batch if base_tokens is None else base_tokens)
        survival = prices = None
        if pinned.all():
            decision = Decision(k_step=0, k=np.zeros(batch, dtype=np.int64))
        elif policy == "static":
            decision = self.static.decide(ceilings, fixed_k_step)
        elif policy == "heuristic":
            decision = self.heuristic.decide(rows, ceilings, fixed_k_step)
        else:
            profile = self.pricer.profile
            catch_up = profile.catchup(catchup_tokens) if catchup_tokens else 0.0
            skip = (profile.catchup(catchup_if_plain) - catch_up
                    if catchup_if_plain and catchup_if_plain > catchup_tokens else 0.0)
            # What the draft has not seen buys drafting for the batch's tokens
            # left (past a request's last usable draft, 2): ``Horizon``.
            horizon = None
            if caps is not None and fixed_k_step is None:
                expect = self.horizon.left(output, left)
                horizon = float(np.sum(np.maximum(expect - 2, 0))) + 2.0 * batch
            survival = self.estimator.survival(rows)
            prices = self.goodput.prices(batch, survival.shape[1], base, self.pricer,
                                         fixed_k_step, catch_up, horizon, skip)
            if (horizon is not None and base > batch and prices.unseen_s > 0 and new.all()
                    and self.horizon.crowd() > batch):
                # New prompts alone after larger batches wait for theirs.
                decision = self.goodput.price(None, np.zeros(batch, dtype=np.int64), 0, prices)
            else:
                decision = self.goodput.decide_priced(survival, ceilings, prices)
                plain = self._plain_probe(batch, base, decision, prices)
                decision = plain or self._probe(rows, ceilings, decision, survival, prices)
            decision.basis = (req_ids, rows, ceilings, prices, None)
        if pinned.any():
            decision = self._with_fixed(decision, pinned, forced, fixed_k_step, survival, prices)
            ceilings = np.where(pinned, forced, ceilings)
        decision.survival = self.estimator.survival(rows) if survival is None else survival
        self._account(rows, ceilings, decision)
        self.last_decision = decision
        return decision

    def _with_fixed(self, decision, pinned, forced, fixed_k_step, survival, prices) -> Decision:
        """``decision`` with the fixed-k requests' drafts put in, priced when it was.

        A step where one of them drafts has no per-position stop rule: the
        draft loop runs K_step and every request keeps what it was granted."""
        k = np.where(pinned, forced, decision.k)
        if fixed_k_step is not None:
            k = np.minimum(k, fixed_k_step)
            k_step = fixed_k_step
        else:
            k_step = max(int(decision.k_step), int(k.max(initial=0)))
        if prices is None:
            return Decision(k_step=k_step, k=k)
        priced = self.goodput.price(survival, k, k_step, prices)
        if int(forced[pinned].max(initial=0)) == 0 and decision.basis is not None:
            # The stop reads the argmax's own plan (the fixed requests draft none).
            priced.basis = decision.basis[:4] + (decision,)
        return priced

    def stop_rule(self, decision: Decision) -> StopRule | None:
        """``decision`` (this step's ``plan``) as a per-position stop
        (``plan_stop_rule``), or None where it has none."""
        if decision.basis is None:
            return None
        req_ids, rows, ceilings, pr, planned = decision.basis
        probing = self._probe_at[rows] == self.stats.steps - 1
        return plan_stop_rule(req_ids, rows, ceilings, pr, planned or decision, probing,
                              self.estimator, self.calibration)

    def _account(self, rows: np.ndarray, ceilings: np.ndarray, decision: Decision) -> None:
        s = self.stats
        slots, fallback = _count_plan(decision.k, ceilings, s.k_counts)
        s.steps += 1
        s.sum_k_step += int(decision.k_step)
        s.request_steps += rows.size
        s.granted_slots += int(slots)
        s.fallback_request_steps += int(fallback)


def warm_up(settings: ControllerSettings, profile: StepProfile) -> None:
    """Run every compiled kernel once on a throwaway controller.

    The policy's and estimator's numba kernels compile on first use (about
    a second cold, a fraction with numba's cache): a server calls this at
    start-up so that its first requests do not wait for it."""
    ctrl = SpecController(settings, profile)
    ids = ["warm-0", "warm-1"]
    for rid in ids:
        ctrl.add_request(rid)
    for _ in range(3):
        d = ctrl.plan(ids)
        k = np.asarray(d.k, dtype=np.int64)
        ctrl.observe_verifications(ids, k, k // 2)
        ctrl.observe_step(len(ids), len(ids) + int(k.sum()), int(d.k_step), 1.0)
    # A probe's kernels run only when a probe is due.
    policy, survival = ctrl.goodput, ctrl.estimator.survival(ctrl.rows(ids))
    ceilings = np.full(len(ids), max(settings.max_k, 1), dtype=np.int64)
    prices = policy.prices(len(ids), survival.shape[1], float(len(ids)), ctrl.pricer)
    policy.decide_priced(survival, ceilings, prices)
    policy.decide_hoping(survival, ceilings, np.array([True, False]), ctrl._hope, prices)
    policy.price(survival, np.ones(len(ids), dtype=np.int64), 1, prices)
    for rid in ids:
        ctrl.finish_request(rid)
