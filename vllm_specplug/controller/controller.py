"""The controller: estimator + cost model + policy + re-probing, composed.

This is the one object the vLLM adapter talks to.  It knows request ids,
draft counts and seconds; it knows nothing about vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

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
    forgetting: float = 0.85
    prior_strength: float = 2.0
    initial_acceptance: float = 0.6
    cost_forgetting: float = 0.98
    min_gain: float = 0.02
    probe_k: int = 1
    probe_interval: int = 4
    probe_max_interval: int = 32


@dataclass
class _RequestState:
    ceiling: int
    backoff: int
    fallback_steps: int = 0
    probing: bool = False
    last_probe_ok: bool = False
    in_fallback: bool = False
    steps: int = 0
    granted: int = 0


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
    k_histogram: dict[int, int] = field(default_factory=dict)


class SpecController:
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
        )
        self.cost = StepCostModel(cost_prior, forgetting=settings.cost_forgetting)
        self.goodput = GoodputPolicy(min_gain=settings.min_gain)
        static_k = settings.max_k if settings.static_k is None else settings.static_k
        self.static = StaticPolicy(static_k)
        self.heuristic = HeuristicPolicy(initial_k=settings.max_k, max_k=settings.max_k)
        self._requests: dict[str, _RequestState] = {}
        self.stats = ControllerStats()
        self.last_decision: Decision | None = None

    # -- request lifecycle -------------------------------------------------
    def add_request(self, req_id: str, ceiling: int | None = None) -> None:
        if req_id in self._requests:
            return
        cap = self.settings.max_k if ceiling is None else min(ceiling, self.settings.max_k)
        self._requests[req_id] = _RequestState(ceiling=cap, backoff=self.settings.probe_interval)
        self.estimator.add(req_id)

    def finish_request(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self.estimator.remove(req_id)
        self.heuristic.remove(req_id)

    def num_requests(self) -> int:
        return len(self._requests)

    def num_in_fallback(self) -> int:
        return sum(1 for st in self._requests.values() if st.in_fallback)

    # -- learning ----------------------------------------------------------
    def observe_verification(self, req_id: str, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        st = self._requests.get(req_id)
        if st is None:
            return
        accepted = max(0, min(accepted, drafted))
        self.estimator.observe(req_id, drafted, accepted)
        self.heuristic.observe(req_id, drafted, accepted)
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        if st.probing:
            st.probing = False
            st.last_probe_ok = accepted >= drafted
            if st.last_probe_ok:
                self.stats.probes_succeeded += 1
            else:
                st.backoff = min(st.backoff * 2, self.settings.probe_max_interval)

    def observe_step(self, batch: int, tokens: int, k_step: int, seconds: float) -> None:
        self.cost.observe(batch, tokens, k_step, seconds)

    # -- deciding ----------------------------------------------------------
    def plan(
        self,
        req_ids: list[str],
        base_tokens: int | None = None,
        fixed_k_step: int | None = None,
    ) -> Decision:
        """K for each of ``req_ids`` (decoding requests) in the next step.

        ``base_tokens`` is the number of non-draft tokens the next step is
        expected to schedule (defaults to one per request).  ``fixed_k_step``
        pins K_step for proposers that need it (and for data parallelism).
        """
        batch = len(req_ids)
        if batch == 0:
            return Decision(k_step=fixed_k_step or 0, k=np.zeros(0, dtype=np.int64))
        states = [self._requests.get(r) for r in req_ids]
        for r, st in zip(req_ids, states):
            if st is None:
                self.add_request(r)
        states = [self._requests[r] for r in req_ids]
        ceilings = np.fromiter((st.ceiling for st in states), dtype=np.int64, count=batch)
        policy = self.settings.policy
        if policy == "static":
            decision = self.static.decide(ceilings, fixed_k_step)
        elif policy == "heuristic":
            decision = self.heuristic.decide(req_ids, ceilings, fixed_k_step)
        else:
            rows = np.fromiter(
                (self.estimator.row(r) for r in req_ids), dtype=np.int64, count=batch
            )
            survival = self.estimator.survival(rows)
            decision = self.goodput.decide(
                survival,
                ceilings,
                float(batch if base_tokens is None else base_tokens),
                self.cost,
                fixed_k_step,
            )
            self._apply_probes(states, decision, fixed_k_step)
        self._account(states, decision)
        self.last_decision = decision
        return decision

    def _apply_probes(self, states, decision: Decision, fixed_k_step: int | None) -> None:
        """Force a small probe on requests that sat in fallback long enough.

        A probe only makes sense when acceptance is what keeps a request out:
        if even a draft accepted with probability ``PROBE_OPTIMISM`` would not
        pay for its verification (a compute-bound batch), probing teaches
        nothing useful and only costs time, so none is sent.
        """
        k = decision.k
        probe_k = self.settings.probe_k
        due: list[int] = []
        for i, st in enumerate(states):
            if st.ceiling <= 0:
                st.in_fallback = False
                continue
            if k[i] > 0:
                if st.in_fallback and st.last_probe_ok:
                    self.stats.recoveries += 1
                st.in_fallback = False
                st.fallback_steps = 0
                st.backoff = self.settings.probe_interval
                st.last_probe_ok = False
                continue
            if st.probing:
                # The last probe produced no draft to verify (e.g. n-gram
                # lookup found no match): count it as a failed probe.
                st.probing = False
                st.backoff = min(st.backoff * 2, self.settings.probe_max_interval)
            st.in_fallback = True
            st.fallback_steps += 1
            if st.fallback_steps >= (1 if st.last_probe_ok else st.backoff):
                due.append(i)
        if not due or not self._probe_can_pay(decision, len(states), len(due), fixed_k_step):
            return
        for i in due:
            st = states[i]
            k[i] = min(probe_k, st.ceiling)
            st.probing = True
            st.fallback_steps = 0
            self.stats.probes_sent += 1
        if fixed_k_step is None:
            decision.k_step = max(decision.k_step, int(k.max(initial=0)))

    PROBE_OPTIMISM = 0.9

    def _probe_can_pay(self, decision: Decision, batch: int, n_probes: int,
                       fixed_k_step: int | None) -> bool:
        if not (decision.predicted_tokens > 0 and decision.predicted_seconds > 0):
            return True
        theta = self.cost.theta
        marginal = theta[2]
        if fixed_k_step is None and decision.k_step == 0:
            # Turning the proposer on for the probes: its pass is shared.
            marginal += (theta[3] + theta[4] * batch) / n_probes
        seconds_per_token = decision.predicted_seconds / decision.predicted_tokens
        return self.PROBE_OPTIMISM * seconds_per_token > marginal

    def _account(self, states, decision: Decision) -> None:
        s = self.stats
        s.steps += 1
        s.sum_k_step += decision.k_step
        s.request_steps += len(states)
        total = int(decision.k.sum())
        s.granted_slots += total
        for st, ki in zip(states, decision.k.tolist()):
            st.steps += 1
            st.granted += ki
            if ki == 0 and st.ceiling > 0:
                s.fallback_request_steps += 1
            s.k_histogram[ki] = s.k_histogram.get(ki, 0) + 1
