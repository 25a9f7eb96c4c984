"""The controller: estimator + step-cost profile + policy + re-probing, composed.

This is the one object the vLLM adapter talks to.  It knows request ids,
draft counts and seconds; it knows nothing about vLLM.

Prices come from the step-cost profile measured before serving; live step
times only feed the profile's clipped correction (``ProfileCorrection``).
What is learnt online is acceptance.  Exploration therefore concerns
acceptance alone: a request in fallback is re-probed with a small draft on a
doubling back-off, and only when the profile says good drafts would pay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_specplug.controller.confidence import ConfidenceCalibration, StopRule
from vllm_specplug.controller.estimator import (FORGETTING, INITIAL_ACCEPTANCE, PRIOR_STRENGTH,
                                                AcceptanceEstimator)
from vllm_specplug.controller.policy import (
    Decision,
    GoodputPolicy,
    HeuristicPolicy,
    StaticPolicy,
    StepPricer,
)
from vllm_specplug.controller.profile import (UNKNOWN_DRAFT_RATIO, ProfileCorrection,
                                              StepProfile, prior_profile)


@dataclass
class ControllerSettings:
    max_k: int
    policy: str = "goodput"
    static_k: int | None = None
    forgetting: float = FORGETTING
    prior_strength: float = PRIOR_STRENGTH
    initial_acceptance: float = INITIAL_ACCEPTANCE
    min_gain: float = 0.02
    probe_k: int = 1
    probe_interval: int = 4
    probe_max_interval: int = 32
    # False: live step times do not correct the profile's prices.
    profile_correction: bool = True


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

    # Per-position acceptance a probe is hoping for.
    PROBE_OPTIMISM = 0.9
    # Plans after which a probe with no verification counts as failed: the
    # probe's drafts are verified one step after it is planned, and observed
    # one step later still under async scheduling.
    PROBE_TIMEOUT = 3

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
        self.pricer = StepPricer(profile, ProfileCorrection())
        self.goodput = GoodputPolicy(min_gain=settings.min_gain)
        static_k = settings.max_k if settings.static_k is None else settings.static_k
        self.static = StaticPolicy(min(static_k, settings.max_k))
        self.heuristic = HeuristicPolicy(initial_k=settings.max_k, max_k=settings.max_k)
        self._row_of = self.estimator.row_of  # req_id -> row, kept by the estimator
        self._last_ids: list[str] | None = None
        self._alloc(self.estimator.capacity)
        self.stats = ControllerStats(k_counts=np.zeros(settings.max_k + 1, dtype=np.int64))
        self.last_decision: Decision | None = None
        self.calibration = ConfidenceCalibration(width)
        # The last plan's rows, ceilings and prices (``stop_rule``).
        self._last_plan: tuple | None = None

    @property
    def profile(self) -> StepProfile:
        return self.pricer.profile

    def set_profile(self, profile: StepProfile) -> None:
        """Price from ``profile`` from now on (the live correction is kept)."""
        self.pricer = StepPricer(profile, self.pricer.correction)

    def ceiling(self, req_id: str) -> int | None:
        """A live request's ceiling on drafts, or None if it is not tracked."""
        row = self._row_of.get(req_id)
        return None if row is None else int(self._ceiling[row])

    def _alloc(self, capacity: int) -> None:
        """(Re)allocate the per-row arrays, keeping what they hold."""
        s = self.settings
        for name, fill in (("_ceiling", 0), ("_backoff", s.probe_interval), ("_waited", 0),
                           ("_probe_at", -1), ("_probe_size", s.probe_k), ("_probe_ok", 0),
                           ("_in_fallback", 0)):
            old = getattr(self, name, None)
            new = np.full(capacity, fill, dtype=np.int64)
            if old is not None:
                new[: old.size] = old
            setattr(self, name, new)
        self.heuristic.ensure_capacity(capacity)

    # -- request lifecycle -------------------------------------------------
    def add_request(self, req_id: str, ceiling: int | None = None) -> None:
        if req_id in self._row_of:
            return
        s = self.settings
        row = self.estimator.add(req_id)
        if row >= self._ceiling.size:
            self._alloc(self.estimator.capacity)
        self._ceiling[row] = s.max_k if ceiling is None else min(ceiling, s.max_k)
        self._reset_probe(np.array([row]))
        # A new request's own drafts are untested: its first step in
        # fallback sends a probe, without waiting out a back-off.
        self._waited[row] = s.probe_interval
        self._probe_ok[row] = 0
        self._in_fallback[row] = 0
        self._last_ids = None
        self.heuristic.reset(row)

    def set_ceiling(self, req_id: str, ceiling: int) -> None:
        """Change a live request's ceiling (0 turns its speculation off)."""
        row = self._row_of.get(req_id)
        if row is None:
            return
        self._ceiling[row] = max(0, min(int(ceiling), self.settings.max_k))
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
            seen = d > 0
            rows = self._last_rows[seen]
            drafted, accepted = d[seen].astype(np.int64), a[seen].astype(np.int64)
        else:
            get = self._row_of.get
            known = [(get(r), d, a) for r, d, a in zip(req_ids, drafted, accepted)
                     if d > 0 and get(r) is not None]
            if not known:
                return
            rows, drafted, accepted = (np.array(x, dtype=np.int64) for x in zip(*known))
        if not rows.size:
            return
        accepted = np.minimum(np.maximum(accepted, 0), drafted)
        self.estimator.observe_rows(rows, drafted, accepted)
        if self.settings.policy == "heuristic":
            self.heuristic.observe(rows, drafted, accepted)
        self.stats.drafted += int(drafted.sum())
        self.stats.accepted += int(accepted.sum())
        probing = self._probe_at[rows] >= 0
        if probing.any():
            ok = accepted >= drafted
            self.stats.probes_succeeded += int(np.count_nonzero(ok & probing))
            self._probe_done(rows[probing], ok[probing])

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
        it drafts nothing.  With ``tokens_left``, the catch-up and the
        draft's pass over a prefill chunk are spread over the tokens the
        batch has left and charged per token to plans that draft, and what a
        plain step adds to the catch-up is charged to plain decoding the
        same way (``GoodputPolicy``); without it nothing is charged.  The
        catch-up and the pass are in the predicted seconds of a plan that
        drafts.
        """
        batch = len(req_ids)
        if batch == 0:
            return Decision(k_step=fixed_k_step or 0, k=np.zeros(0, dtype=np.int64))
        rows = self.rows(req_ids)
        ceilings = self._ceiling[rows]
        policy = self.settings.policy
        caps = (None if tokens_left is None else
                np.maximum(np.asarray(tokens_left, dtype=np.int64) - 2, 0))
        # The static policy is vLLM's static K, a baseline: it drafts K up to
        # max_tokens as vLLM does.
        if caps is not None and policy != "static":
            ceilings = np.minimum(ceilings, caps)
        base = float(batch if base_tokens is None else base_tokens)
        if policy == "static":
            decision = self.static.decide(ceilings, fixed_k_step)
        elif policy == "heuristic":
            decision = self.heuristic.decide(rows, ceilings, fixed_k_step)
        else:
            profile = self.pricer.profile
            catch_up = profile.catchup(catchup_tokens) if catchup_tokens else 0.0
            skip = (profile.catchup(catchup_if_plain) - catch_up
                    if catchup_if_plain and catchup_if_plain > catchup_tokens else 0.0)
            # What the draft has not seen buys drafting for the batch's tokens
            # left (those of a request past its last usable draft count as 2).
            horizon = (float(np.sum(caps)) + 2.0 * batch
                       if caps is not None and fixed_k_step is None else None)
            survival = self.estimator.survival(rows)
            prices = self.goodput.prices(batch, survival.shape[1], base, self.pricer,
                                         fixed_k_step, catch_up, horizon, skip)
            decision = self.goodput.decide_priced(survival, ceilings, prices)
            decision = self._probe(rows, ceilings, decision, survival, prices)
            self._last_plan = (req_ids, rows, ceilings, prices, decision)
        self._account(rows, ceilings, decision)
        self.last_decision = decision
        return decision

    def stop_rule(self) -> StopRule | None:
        """The last plan as a per-position stop (``DraftStopper``), or None.

        Only for a goodput plan that drafts and does not pin K_step: the
        draft loop may then run up to each request's ceiling and stops where
        the plan's own argmax, one position at a time, says the next position
        does not pay.  A request the plan left in fallback keeps none, and a
        probe keeps its size; the others may keep up to their ceilings.
        """
        last, self._last_plan = self._last_plan, None
        if last is None:
            return None
        req_ids, rows, ceilings, pr, decision = last
        if decision.k_step <= 0 or pr.fixed_k_step is not None or pr.by_n is None:
            return None
        k = decision.k
        probing = self._probe_at[rows] == self.stats.steps - 1
        caps = np.where((k == 0) | probing, k, ceilings)
        n = int(k.sum())
        ratio = pr.ratios(min(n + 2, pr.by_n.size))
        nxt = min(n + 1, pr.by_n.size - 1, ratio.size - 1)
        slot_s = max(float(pr.by_n[nxt] * ratio[nxt] - pr.by_n[n] * ratio[n]), 0.0)
        rate = decision.predicted_tokens / max(decision.predicted_seconds, 1e-12)
        return StopRule(list(req_ids), self.estimator.conditional(rows), caps.astype(np.int64),
                        self.calibration.lift, self.calibration.edges,
                        slot_cut=rate * slot_s, pass_cut=rate * pr.draft_pass * ratio[n])

    # -- probes ------------------------------------------------------------
    def _reset_probe(self, rows: np.ndarray) -> None:
        s = self.settings
        self._backoff[rows] = s.probe_interval
        self._waited[rows] = 0
        self._probe_at[rows] = -1
        self._probe_size[rows] = s.probe_k

    def _probe_done(self, rows: np.ndarray, ok: np.ndarray) -> None:
        """A probe's verdict: a failure doubles the back-off, a success the next probe's size."""
        s = self.settings
        self._probe_at[rows] = -1
        self._probe_ok[rows] = ok
        failed, passed = rows[~ok], rows[ok]
        self._backoff[failed] = np.minimum(self._backoff[failed] * 2, s.probe_max_interval)
        self._probe_size[failed] = s.probe_k
        self._probe_size[passed] = np.minimum(self._probe_size[passed] * 2,
                                              np.maximum(self._ceiling[passed], 1))

    def _probe(self, rows, ceilings, decision, survival, prices) -> Decision:
        """Send a small probe to requests that sat in fallback long enough.

        A request granted nothing while its ceiling allows drafts is in
        fallback; after ``backoff`` such steps (at once after an accepted
        probe, and on a new request's first step in fallback) it is due.  A
        probe goes out only when it could pay: the same argmax, with the due
        requests' drafts assumed good (``PROBE_OPTIMISM`` per position) and
        the same catch-up charges, must grant them slots; the probe is no
        deeper than that plan would grant, nor than the K_step of a plan
        that drafts.  Its verdict arrives a step later; one that never comes
        (``PROBE_TIMEOUT`` plans) counts as a failure.  Returns the plan to
        send: ``decision``, or the plan with the probes, priced.
        """
        k = decision.k.copy()
        now = self.stats.steps
        fallback = (k == 0) & (ceilings > 0)
        back = rows[(k > 0) & (self._in_fallback[rows] != 0)]
        if back.size:
            self.stats.recoveries += int(np.count_nonzero(self._probe_ok[back]))
            self._reset_probe(back)
            self._probe_ok[back] = 0
        self._in_fallback[rows] = fallback
        if not fallback.any():
            return decision
        probing = self._probe_at[rows] >= 0
        expired = probing & (now - self._probe_at[rows] >= self.PROBE_TIMEOUT)
        if expired.any():
            self._probe_done(rows[expired], np.zeros(int(expired.sum()), dtype=bool))
            probing &= ~expired
        waiting = fallback & ~probing
        self._waited[rows[waiting]] += 1
        due = waiting & ((self._waited[rows] >= self._backoff[rows]) | (self._probe_ok[rows] != 0))
        due_idx = np.flatnonzero(due)
        if not due_idx.size:
            return decision
        hopeful = survival.copy()
        hopeful[due_idx] = self.PROBE_OPTIMISM ** np.arange(1, hopeful.shape[1] + 1)
        plan = self.goodput.decide_priced(hopeful, ceilings, prices)
        depth = int(plan.k[due_idx].max(initial=0))
        pinned = prices.fixed_k_step is not None
        if decision.k_step > 0 and not pinned:
            depth = min(depth, decision.k_step)
        if depth <= 0:
            return decision
        due_rows = rows[due_idx]
        probe_k = np.minimum(np.minimum(self._probe_size[due_rows], ceilings[due_idx]), depth)
        k[due_idx] = probe_k
        self._probe_at[due_rows] = now
        self._waited[due_rows] = 0
        self.stats.probes_sent += int(due_idx.size)
        k_step = decision.k_step if pinned else max(decision.k_step, int(probe_k.max()))
        # The plan as sent, probes and all, is what is priced.
        return self.goodput.price(survival, k, k_step, prices)

    def _account(self, rows: np.ndarray, ceilings: np.ndarray, decision: Decision) -> None:
        s = self.stats
        k = decision.k
        counts = np.bincount(k, minlength=s.k_counts.size)
        s.k_counts += counts[: s.k_counts.size]
        s.steps += 1
        s.sum_k_step += int(decision.k_step)
        s.request_steps += rows.size
        s.granted_slots += int(k.sum())
        s.fallback_request_steps += int(np.count_nonzero((k == 0) & (ceilings > 0)))


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
    for rid in ids:
        ctrl.finish_request(rid)

