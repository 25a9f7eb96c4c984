"""Policies: how many draft slots each request gets in the next step.

Every policy answers the same question: for a batch of ``B`` decoding
requests with per-request ceilings, return ``k[r]`` (drafts to verify for
request ``r`` next step) and ``K_step`` (how many draft positions the
proposer runs), with ``k[r] <= K_step <= max_k``.  Each takes what it needs
(``SpecController.plan`` calls each with its own): the goodput policy the
survival estimates and the step's prices, the static one the ceilings, the
heuristic one its per-request state.

- ``GoodputPolicy`` (the default): one argmax of expected tokens per second
  over K_step and the number of admitted slots, priced from the step-cost
  profile.
- ``StaticPolicy`` is fixed K, the baseline everyone runs today.
- ``HeuristicPolicy`` is Hugging Face assisted generation's rule: +2 after a
  fully accepted draft, -1 otherwise.

Here is the goodput policy; its step prices are in ``pricing.py``, its numba
argmax kernels in ``argmax.py``, the two baselines in ``baselines.py``.
"""

from __future__ import annotations

import numpy as np

from vllm_specplug.controller.argmax import (_best_plan, _candidates, _slots_gain,
                                             _with_rows_replaced)
from vllm_specplug.controller.pricing import Decision, StepPricer, StepPrices, _Prices
from vllm_specplug.controller.settings import MIN_GAIN


class GoodputPolicy(StepPrices):
    """Draft slots where they raise expected tokens per second; one argmax.

    A slot is (request r, draft position p); its value is the survival
    probability s[r, p], the chance that drafts 1..p are all accepted, so a
    request given j slots yields 1 + s[r, 0] + ... + s[r, j-1] tokens.  For
    every K_step j and every n, the plan that admits the n most likely slots
    at positions below j is priced from the profile as the step that carries
    it: the target over the step's tokens plus the n drafts, and j draft
    positions.  (vLLM verifies the drafts planned now in the next step, and
    that step drafts for the one after it: in steady state each step both
    verifies a plan and runs its draft positions, which is what is priced.)
    The plan with the most tokens per second wins; plain decoding (j = 0)
    unless it beats plain by ``min_gain``.  Low acceptance and a
    compute-bound batch both end there: no slot pays.

    Rates count decode work only: a prefill chunk in the step costs the same
    whatever is drafted, so its time (the profiled plain step's with the
    chunk minus the plain step's without it, at each plan's own correction)
    is left out of every plan's seconds, while the drafts are still priced
    at the step's real size.

    With the zero-cost fallback a step that drafts nothing skips the draft
    too, so what the draft has not seen is paid for once, by the step that
    drafts past it: the catch-up (the draft re-run over what it skipped,
    from the first stale KV block) when drafting resumes, and, in a step
    that prefills, the draft's pass over the prefill chunk.  Drafting now or
    drafting later, that work buys drafting for the rest of the batch's
    tokens, so it is spread over them (``horizon`` tokens: ``SpecController.plan``)
    and every drafting plan is charged its share for each token it yields.
    A plain step is charged in the same way what it adds to the pending
    catch-up (the skipped tokens back to their KV block's start, which the
    draft had seen, and any prompt it prefills).  Leaving drafting and
    coming back thus costs a catch-up, and the argmax switches only when
    the other side is better by at least that share: the hysteresis of
    rent-or-buy, so estimates that wobble around break-even do not buy a
    catch-up each time.  A step that carries a new prompt drafts when
    drafting pays for the batch; resuming after a long fallback has to win
    its catch-up back before the requests end, and the charge never rises
    without bound.
    """

    name = "goodput"

    def __init__(self, min_gain: float = MIN_GAIN) -> None:
        # Speculation must promise at least this relative gain over plain
        # decoding: a bias toward plain decoding of estimates near 1.0x (it
        # moves break-even, it remembers nothing; the catch-up charge is what
        # keeps a choice near break-even under the zero-cost fallback).
        self.min_gain = min_gain
        self._cached_shape: tuple | None = None
        # The last decide_priced's survival, ceilings and candidates (decide_hoping).
        self._last_candidates: tuple | None = None

    def decide(
        self,
        survival: np.ndarray,
        ceilings: np.ndarray,
        base_tokens: float,
        pricer: StepPricer,
        fixed_k_step: int | None = None,
        catch_up_s: float = 0.0,
        horizon: float | None = None,
        skip_s: float = 0.0,
    ) -> Decision:
        """Best plan for ``survival`` (rows non-increasing along positions).

        ``base_tokens`` is what the step schedules besides drafts (one per
        decoding request plus prefill chunks).  ``fixed_k_step`` pins K_step
        (proposers that need a fixed K; lockstep data parallelism): then the
        argmax is over the slots only.  ``catch_up_s``: a pending catch-up,
        paid by a plan that drafts; with ``horizon`` (tokens), it and the
        draft's pass over a prefill chunk are charged per token yielded
        instead of to this step alone, and plain decoding is charged
        ``skip_s``, what skipping the draft in this step adds to the pending
        catch-up, the same way (without a horizon, nothing is charged).
        """
        prices = self.prices(*survival.shape, base_tokens, pricer, fixed_k_step, catch_up_s,
                             horizon, skip_s)
        return self.decide_priced(survival, np.asarray(ceilings), prices)

    def decide_priced(self, survival: np.ndarray, ceilings: np.ndarray, pr: _Prices) -> Decision:
        """``decide`` for the step ``pr`` prices (``prices``)."""
        if pr.by_n is None:
            self._last_candidates = None
            return self._plain(pr.batch, pr.plain, pr.prefill_s, pr.fixed_k_step or 0)
        # The candidate slots, most likely first, with their requests and
        # positions (a slot that is never accepted is no candidate).
        candidates = _candidates(survival, ceilings)
        self._last_candidates = (survival, ceilings, candidates)
        return self._best(candidates, pr)

    def decide_hoping(self, survival: np.ndarray, ceilings: np.ndarray, due: np.ndarray,
                      hope: np.ndarray, pr: _Prices) -> Decision:
        """``decide_priced`` with the survival rows of the requests ``due`` (a mask
        over the batch) replaced by ``hope``, after ``decide_priced(survival,
        ceilings, pr)``: the candidates are those of that decision, changed."""
        last = self._last_candidates
        if pr.by_n is None or last is None or last[0] is not survival or last[1] is not ceilings:
            hopeful = survival.copy()
            hopeful[due] = hope
            return self.decide_priced(hopeful, ceilings, pr)
        vals, rows, at, _ = last[2]
        return self._best(_with_rows_replaced(vals, rows, at, due, hope, ceilings), pr)

    def _best(self, candidates: tuple, pr: _Prices) -> Decision:
        """The argmax over ``candidates`` (``_candidates``) at the prices ``pr``."""
        batch, fixed_k_step = pr.batch, pr.fixed_k_step
        vals, rows, at, deepest = candidates
        if fixed_k_step is None:
            if not vals.size:
                return self._plain(batch, pr.plain, pr.prefill_s, 0)
            # A K_step past the deepest candidate slot adds a pass for nothing.
            j_first, j_last = 1, deepest + 1
        else:
            j_first = j_last = fixed_k_step
        by_n, ratio = pr.by_n, pr.ratios(vals.size + 1)
        k = np.zeros(batch, dtype=np.int64)
        j, slots, best, seconds, gain = _best_plan(vals, rows, at, by_n, ratio, batch, j_first,
                                                   j_last, pr.draft_pass, pr.owed, k)
        # Without slots: plain decoding, or the pinned K_step's passes alone.
        if fixed_k_step is not None:
            zero_s = max((by_n[0] + (j_first - 1) * pr.draft_pass) * ratio[j_first, 0], 1e-12)
            zero = float(batch / zero_s)
        else:
            zero_s = pr.plain
            zero = float(batch / pr.plain_charged)
        if best < zero * (1.0 + self.min_gain):
            if fixed_k_step is None:
                return self._plain(batch, pr.plain, pr.prefill_s, 0)
            slots = 0
        if slots == 0:
            return Decision(k_step=j, k=np.zeros(batch, dtype=np.int64),
                            predicted_seconds=float(zero_s + ratio[j, 0] * pr.prefill_p
                                                    + (pr.unseen_s if j > 0 else 0.0)),
                            predicted_tokens=float(batch),
                            plain_seconds=float(pr.plain_full), plain_tokens=float(batch))
        return Decision(k_step=j, k=k,
                        predicted_seconds=float(seconds + ratio[j, slots] * pr.prefill_p
                                                + pr.unseen_s),
                        predicted_tokens=float(batch + gain),
                        plain_seconds=float(pr.plain_full), plain_tokens=float(batch))

    def price(self, survival: np.ndarray, k: np.ndarray, k_step: int, pr: _Prices) -> Decision:
        """The plan ``k`` (drafts per request) at ``k_step``, priced as ``decide_priced``
        prices the plans it compares: for a plan changed after the argmax (a probe)."""
        batch = pr.batch
        n = int(k.sum())
        if n == 0 or pr.by_n is None:
            return self._plain(batch, pr.plain, pr.prefill_s, k_step)
        ratio = float(pr.ratios(n + 1)[k_step, n])
        seconds = max((pr.by_n[n] + (k_step - 1) * pr.draft_pass) * ratio, 1e-12)
        gain = _slots_gain(survival, k)
        return Decision(k_step=k_step, k=k,
                        predicted_seconds=float(seconds + ratio * pr.prefill_p + pr.unseen_s),
                        predicted_tokens=float(batch + gain),
                        plain_seconds=float(pr.plain_full), plain_tokens=float(batch))

    @staticmethod
    def _plain(batch: int, plain: float, prefill_s: float, k_step: int) -> Decision:
        return Decision(k_step=k_step, k=np.zeros(batch, dtype=np.int64),
                        predicted_seconds=plain + prefill_s, predicted_tokens=float(batch),
                        plain_seconds=plain + prefill_s, plain_tokens=float(batch))
