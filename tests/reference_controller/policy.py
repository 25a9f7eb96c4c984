"""Policies: how many draft slots each request gets in the next step.

Every policy answers the same question with the same inputs: for a batch of
``B`` decoding requests with per-request ceilings, return ``k[r]`` (drafts to
verify for request ``r`` next step) and ``K_step`` (how many draft positions
the proposer runs), with ``k[r] <= K_step <= max_k``.

- ``GoodputPolicy`` (the default): one argmax of expected tokens per second
  over K_step and the number of admitted slots, priced from the step-cost
  profile.
- ``StaticPolicy`` is fixed K, the baseline everyone runs today.
- ``HeuristicPolicy`` is Hugging Face assisted generation's rule: +2 after a
  fully accepted draft, -1 otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from reference_controller.profile import ProfileCorrection, StepProfile
from vllm_specplug.controller.profile import isotonic


@dataclass
class Decision:
    k_step: int
    k: np.ndarray  # per request, same order as the batch
    predicted_seconds: float = float("nan")
    predicted_tokens: float = float("nan")
    plain_seconds: float = float("nan")
    plain_tokens: float = float("nan")

    @property
    def predicted_speedup(self) -> float:
        if not (self.predicted_seconds > 0 and self.plain_seconds > 0):
            return float("nan")
        return (self.predicted_tokens / self.predicted_seconds) / (
            self.plain_tokens / self.plain_seconds
        )


class StepPricer:
    """The profile with its live correction: seconds of a planned step."""

    def __init__(self, profile: StepProfile, correction: ProfileCorrection | None = None) -> None:
        self.profile = profile
        self.correction = correction or ProfileCorrection()

    def seconds(self, tokens: float, batch: int, k_step: int, catchup_tokens: float = 0.0) -> float:
        raw = self.profile.step(tokens, batch, k_step, catchup_tokens)
        return raw * self.correction.ratio(tokens, batch, plain=k_step == 0)

    def observe(self, tokens: float, batch: int, k_step: int, seconds: float,
                catchup_tokens: float = 0.0) -> bool:
        raw = self.profile.step(tokens, batch, k_step, catchup_tokens)
        return self.correction.observe(tokens, batch, raw, seconds, plain=k_step == 0)


class GoodputPolicy:
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
    MIN_SURVIVAL = 1e-3

    def __init__(self, min_gain: float = 0.02) -> None:
        # Speculation must promise at least this relative gain over plain
        # decoding; keeps noise in the estimates from flapping near 1.0x.
        self.min_gain = min_gain
        self._positions: dict[int, np.ndarray] = {}

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
        batch, width = survival.shape
        profile, corr = pricer.profile, pricer.correction
        base = max(float(base_tokens), float(batch))
        # Every plan of this step, plain's included, is priced at the
        # correction of the step's own shape, prefill chunk and all.
        # (Not below zero: the token curves are the measured medians, and a
        # step over more tokens can measure cheaper; see by_n below.)
        prefill_p = max(profile.target(base) - profile.target(batch), 0.0)
        # The draft's pass over the prefill chunk, when a plain step would
        # skip it (zero-cost fallback); otherwise what drafting adds is the
        # step's own cost.
        prefill_f = (max(profile.first(base) - profile.first(batch), 0.0)
                     if profile.skips_draft_at_k0 else 0.0)
        # The plain step with its prefill chunk: at least the plain step without it.
        plain_full = (profile.target(batch) + prefill_p) * corr.ratio(base, batch, plain=True)
        prefill_s = prefill_p * corr.ratio(base, batch, plain=True)
        unseen_s = catch_up_s + prefill_f * corr.ratio(base, batch)  # paid by drafting plans
        per_token = 1.0 / max(horizon, 1.0) if horizon is not None else 0.0
        owed = unseen_s * per_token
        plain = plain_full - prefill_s
        if fixed_k_step == 0 or width == 0 or batch == 0:
            return self._plain(batch, plain, prefill_s, fixed_k_step or 0)

        # The candidate slots, most likely first, with their positions.
        # Slots below MIN_SURVIVAL can never pay for a token of verification.
        pos = self._positions.get(width)
        if pos is None or pos.shape[0] < batch:
            rows = max(64, 1 << (batch - 1).bit_length())
            pos = self._positions[width] = np.tile(np.arange(width), (rows, 1))
        pos = pos[:batch].ravel()
        s = survival.ravel()
        keep = (s >= self.MIN_SURVIVAL) & (pos < np.repeat(ceilings, width))
        vals, at = s[keep], pos[keep]
        order = np.argsort(-vals, kind="stable")
        vals, at = vals[order], at[order]

        if fixed_k_step is None:
            if not vals.size:
                return self._plain(batch, plain, prefill_s, 0)
            # A K_step past the deepest candidate slot adds a pass for nothing.
            js = np.arange(1, int(at.max()) + 2)
        else:
            js = np.array([fixed_k_step])
        # Profiled seconds of a drafting step's decode work by the number n
        # of slots it verifies (0..all), before the K_step-dependent draft
        # passes: the step less its prefill share.
        tokens = base + np.arange(vals.size + 1, dtype=np.float64)
        ratio = corr.ratios_from(int(base), tokens.size, batch)
        # Non-decreasing in n from the step's own size: a plan at this batch
        # is priced from the profile at its own tokens and up, so a measured
        # dip cannot price a slot below nothing, and a smaller shape (a
        # 1-token step measured slower than a 4-token one) never raises this
        # step's prices.
        # Made convex as well, over every slot the batch could verify
        # (batch x width), its steps fitted non-decreasing and floored at
        # its start; captured sizes keep their running maximum.
        curve = profile.verify_and_first(base + np.arange(batch * survival.shape[1] + 1.0))
        if profile.pad_sizes is not None:
            fit = np.maximum.accumulate(curve)
        else:
            fit = np.maximum(curve[0] + np.concatenate([[0.0], np.cumsum(isotonic(np.diff(curve)))]),
                             curve[0])
        by_n = fit[:tokens.size] - prefill_p - prefill_f
        passes = (js - 1) * profile.draft_pass(batch)
        # Per K_step (rows) and slot in order (columns), the plan that admits
        # the slots up to it among those at positions below K_step.
        in_j = at[None, :] < js[:, None]
        n = np.cumsum(in_j, axis=1, dtype=np.int32)
        gain = np.where(in_j, vals, 0.0).cumsum(1)
        seconds = np.maximum((by_n[n] + passes[:, None]) * ratio[n], 1e-12)
        rate = (batch + gain) / (seconds + owed * (batch + gain))
        # Without slots: plain decoding, or the pinned K_step's passes alone.
        if fixed_k_step is not None:
            zero_s = max((by_n[0] + passes[0]) * ratio[0], 1e-12)
            zero = float(batch / zero_s)
        else:
            zero_s = plain
            zero = float(batch / (plain + skip_s * per_token * batch))
        if rate.size:
            i, m = np.unravel_index(int(np.argmax(rate)), rate.shape)
            j, slots, best = int(js[i]), int(n[i, m]), float(rate[i, m])
        else:
            i = m = 0
            j, slots, best = int(js[0]), 0, 0.0
        if best < zero * (1.0 + self.min_gain):
            if fixed_k_step is None:
                return self._plain(batch, plain, prefill_s, 0)
            slots = 0
        if slots == 0:
            return Decision(k_step=j, k=np.zeros(batch, dtype=np.int64),
                            predicted_seconds=float(zero_s + ratio[0] * prefill_p
                                                    + (unseen_s if j > 0 else 0.0)),
                            predicted_tokens=float(batch),
                            plain_seconds=float(plain_full), plain_tokens=float(batch))
        # The first `slots` admitted slots of the sorted list, by request.
        chosen = np.flatnonzero(in_j[i])[:slots]
        rows = np.flatnonzero(keep)[order[chosen]] // width
        k = np.bincount(rows, minlength=batch).astype(np.int64)
        return Decision(k_step=j, k=k,
                        predicted_seconds=float(seconds[i, m] + ratio[slots] * prefill_p
                                                + unseen_s),
                        predicted_tokens=float(batch + gain[i, m]),
                        plain_seconds=float(plain_full), plain_tokens=float(batch))

    @staticmethod
    def _plain(batch: int, plain: float, prefill_s: float, k_step: int) -> Decision:
        return Decision(k_step=k_step, k=np.zeros(batch, dtype=np.int64),
                        predicted_seconds=plain + prefill_s, predicted_tokens=float(batch),
                        plain_seconds=plain + prefill_s, plain_tokens=float(batch))


class StaticPolicy:
    name = "static"

    def __init__(self, k: int) -> None:
        self.k = k

    def decide(self, ceilings: np.ndarray, fixed_k_step: int | None = None) -> Decision:
        k_step = fixed_k_step if fixed_k_step is not None else self.k
        # A pinned K_step below K runs fewer draft positions than K.
        k = np.minimum(ceilings, min(self.k, k_step))
        return Decision(k_step=int(k_step), k=k)


class HeuristicPolicy:
    """Per request: +2 after a fully accepted draft, -1 (not below 1) otherwise.

    State is one integer per estimator row, so the controller can update and
    read a whole batch with array operations.
    """

    name = "heuristic"

    def __init__(self, initial_k: int, max_k: int, capacity: int = 64) -> None:
        self.initial_k = initial_k
        self.max_k = max_k
        self._k = np.full(capacity, initial_k, dtype=np.int64)

    def ensure_capacity(self, capacity: int) -> None:
        if capacity > self._k.size:
            grown = np.full(capacity, self.initial_k, dtype=np.int64)
            grown[: self._k.size] = self._k
            self._k = grown

    def reset(self, row: int) -> None:
        self._k[row] = self.initial_k

    def observe(self, rows: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        seen = drafted > 0
        rows, drafted, accepted = rows[seen], drafted[seen], accepted[seen]
        k = np.where(accepted >= drafted, self._k[rows] + 2, self._k[rows] - 1)
        self._k[rows] = np.clip(k, 1, max(self.max_k, 1))

    def decide(
        self, rows: np.ndarray, ceilings: np.ndarray, fixed_k_step: int | None = None
    ) -> Decision:
        k = np.minimum(self._k[rows], ceilings)
        if fixed_k_step is None:
            return Decision(k_step=int(k.max(initial=0)), k=k)
        return Decision(k_step=fixed_k_step, k=np.minimum(k, fixed_k_step))
