"""Step time as a function of what a step does, learned online.

A speculative step costs the target's forward pass over every scheduled
token (prefill chunks, one token per decoding request and its drafts) plus
the proposer's work for the next step, which grows with the number of draft
positions ``K_step`` it runs (a draft model runs ``K_step`` passes over the
batch; n-gram lookup costs almost nothing).  We model

    t = c0 + cB * B + cT * T + cK * K_step + cBK * B * K_step  (+ cU * U)

and fit it by exponentially forgotten ridge regression toward a prior.  The
prior has no device constants: it is a *shape* (relative costs, e.g. "a
verified draft token costs a tenth of a decode step", "a draft pass costs
draft_params/target_params of a target pass"), scaled by the first step time
actually measured.  The ridge term keeps directions that the data does not
excite (e.g. ``K_step`` never varied yet) at the prior instead of letting
them drift.

Where the proposer's first pass runs at ``K_step = 0`` too (vLLM runs a draft
model's or EAGLE head's first pass every step, to keep the draft's KV cache
in sync), that pass is part of every step, plain ones included: the feature
is then the passes *beyond* it, ``max(K_step - 1, 0)``, and ``K_step = 1``
costs only the verification of its tokens (``CostPrior.draft_runs_at_k0``).
A model linear in ``K_step`` itself charged ``K_step = 1`` most of a pass it
does not add, fitted from steps at K_step = 0 and at larger K_step, and the
policy fell back in large batches where one draft per request still paid.

U is the number of tokens a draft model catches up on in a step (with
zero-cost fallback it skips K_step=0 steps and processes the skipped tokens
in one prefill-like pass before it drafts again).  A catch-up is one more
draft pass, so such a step is fitted as K_step + 1 passes, plus cU per
caught-up token.  Catch-up steps are rare, so cU is not part of the joint
fit, where one noisy catch-up step could trade its cost against the other
coefficients; it is a running estimate from those steps' excess over the
fitted model, and the rest of the step joins the fit as usual.

On a GPU the target's forward pass is memory-bound at small batches (extra
tokens are nearly free) and compute-bound past the roofline's ridge (each
token costs its FLOPs), so step time is piecewise linear in T with a knee
whose place depends on the model and the device.  A single slope averages
the two regimes: it makes drafts look expensive in decode-only steps and
cheap in steps that carry a prefill chunk.  So the model may add

    + cH * max(T - knee, 0)

with the knee chosen from a fixed grid of candidates by how much it lowers
the fit's (forgetting-weighted) squared error; the candidates' sufficient
statistics are kept beside the main ones, so choosing costs one batched
6x6 solve every ``KNEE_EVERY`` steps.  A knee is adopted only when it cuts
the error by a clear margin (``KNEE_GAIN``); otherwise (a CPU, compute-bound
from the first token) the model stays linear.  An adopted knee is kept while
few steps are left clearly below it, since the policy's plans then sit at or
past it and the evidence that found it is only being forgotten.

Timing is noisy and can be garbage (a stalled clock, a GC pause); a sample
that is not finite or not positive is dropped, and after warm-up a sample
slower than predicted is clipped to a band scaled by the running error
(dropped when it lies far outside it), so one outlier cannot swing K.  The
band is centred on the recent residuals of steps of about the same size: a
fit that misprices a whole range of step sizes (a linear fit carried by
prefill-heavy steps, pricing decode-only steps 35% low) is corrected by
those steps, not rid of them as stalls.
Stalls only ever make a step slower, so a faster step is kept as measured
(except under async scheduling, where a step's timing can be split with its
neighbour's).
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass

import numpy as np

FEATURES = ("intercept", "batch", "tokens", "draft_passes", "batch_x_draft_passes")
# Candidate knees of the step time in tokens (see the module docstring):
# 8 to ~11600, a factor sqrt(2) apart.
KNEES = np.array(sorted({int(round(8 * 2 ** (i / 2))) for i in range(22)}), dtype=float)


@dataclass(frozen=True)
class CostPrior:
    """Relative cost shape; units are 'one decode step of one request'."""

    intercept: float = 1.0
    per_request: float = 0.05
    per_token: float = 0.10
    per_draft_pass: float = 0.0
    per_draft_token: float = 0.0
    per_catchup_token: float = 0.0
    # True where the proposer's first pass runs at K_step = 0 as well
    # (draft model or EAGLE without zero-cost fallback): the draft-pass
    # features then count the passes beyond it (see the module docstring).
    draft_runs_at_k0: bool = False
    # Pseudo-observations behind the prior: small, so data wins quickly.
    strength: float = 0.5

    def vector(self) -> np.ndarray:
        return np.array(
            [
                self.intercept,
                self.per_request,
                self.per_token,
                self.per_draft_pass,
                self.per_draft_token,
            ]
        )

    @classmethod
    def for_platform(
        cls, platform: str, draft_kind: str, draft_size_ratio: float = 0.0,
        draft_runs_at_k0: bool = False,
    ) -> "CostPrior":
        """A starting shape for ``platform`` ('cpu', 'cuda', ...).

        On a CPU the target is compute-bound almost at once: each extra token
        in a forward pass costs a visible fraction of a step (measured here:
        verifying 4 drafts costs about 2x a plain step).  On a GPU small
        batches are memory-bound and extra tokens are nearly free.  A draft
        model's passes cost about its size relative to the target.
        """
        per_token = 0.25 if platform == "cpu" else 0.02
        per_request = 0.05 if platform == "cpu" else 0.005
        if draft_kind == "model":
            ratio = 0.5 * min(max(draft_size_ratio, 0.02), 1.0)
            return cls(
                per_token=per_token,
                per_request=per_request,
                per_draft_pass=ratio,
                per_draft_token=ratio * per_token,
                # A catch-up token is a prefill token for the draft model.
                per_catchup_token=ratio * per_token,
                draft_runs_at_k0=draft_runs_at_k0,
            )
        # n-gram / suffix lookups run on the host and cost little per step.
        return cls(per_token=per_token, per_request=per_request, per_draft_pass=0.005)


def features(batch: float, tokens: float, passes: float) -> np.ndarray:
    """The model's regressors; ``passes`` are draft passes (``StepCostModel.draft_passes``)."""
    return np.array([1.0, batch, tokens, passes, batch * passes])


class StepCostModel:
    # Steps dropped at start-up: the engine's first steps, and the first
    # steps that run the draft (see observe).
    SKIP_FIRST = 2
    SKIP_FIRST_DRAFTING = 2

    def __init__(
        self,
        prior: CostPrior | None = None,
        forgetting: float = 0.98,
    ) -> None:
        self.prior = prior or CostPrior()
        self.forgetting = forgetting
        self._rel_scale = 0.5
        self._rel_hist: collections.deque = collections.deque(maxlen=32)
        # Recent relative residuals per token range (see observe).
        self._bucket_rel: dict[int, collections.deque] = {}
        self._resid_var = 0.0
        self._cov: np.ndarray | None = None
        self._reduced_cache: dict[float, tuple] = {}
        self._skipped = 0
        self._skipped_drafting = 0
        # False where step times are not exact (async scheduling; set by the
        # scheduler): then a fast step is clipped like a slow one.
        self.keep_fast_steps = True
        # Draft passes a step at K_step = 0 runs anyway (0 or 1).
        self.pass_offset = 1 if self.prior.draft_runs_at_k0 else 0
        n = len(FEATURES)
        self._theta0 = self.prior.vector()
        self._ridge = self.prior.strength * np.eye(n)
        self._xtx = np.zeros((n, n))
        self._xty = np.zeros(n)
        self._theta = self._theta0.copy()
        self._scaled = False
        self.num_observations = 0
        # Fitted steps that ran the draft (K_step > 0 or a catch-up).
        self.num_drafting_observations = 0
        self.num_rejected = 0
        self._catchup_per_token = self.prior.per_catchup_token
        self.num_catchups = 0
        # The knee (None: linear in tokens) and the slope added past it, and
        # each candidate knee's statistics: sum x*h, sum h*h, sum h*y with
        # h = max(tokens - knee, 0), and sum y*y, all forgotten like _xtx.
        self.knee: float | None = None
        self.knee_slope = 0.0
        self._knee_idx = -1
        # Knee searches in a row that kept the knee (or its absence) where it was.
        self.knee_searches_unchanged = 0
        self._hx = np.zeros((KNEES.size, n))
        self._hh = np.zeros(KNEES.size)
        self._hy = np.zeros(KNEES.size)
        self._yy = 0.0
        self._h_past = np.zeros(KNEES.size)  # forgotten count of steps past each knee
        self._w = 0.0  # forgotten count of all steps

    @property
    def theta(self) -> np.ndarray:
        return self._theta

    @property
    def calibrated(self) -> bool:
        return self._scaled

    def draft_passes(self, k_step: float) -> float:
        """Draft passes a step with ``k_step`` positions adds to a K_step = 0 step."""
        return max(k_step - self.pass_offset, 0)

    def predict(self, batch: float, tokens: float, k_step: float, catchup: float = 0.0) -> float:
        return (float(features(batch, tokens, self.draft_passes(k_step)) @ self._theta)
                + self.knee_seconds(tokens) + self.catchup_seconds(catchup, batch))

    def knee_seconds(self, tokens: float) -> float:
        """The step time added past the knee (0 while the model is linear)."""
        if self.knee is None or tokens <= self.knee:
            return 0.0
        return self.knee_slope * (tokens - self.knee)

    def knee_terms(self) -> tuple[float, float]:
        """(knee, extra seconds per token past it); (inf, 0) while linear."""
        if self.knee is None:
            return math.inf, 0.0
        return self.knee, self.knee_slope

    def knee_seen_from_below(self) -> bool:
        """Whether enough steps lie clearly below the knee to place it.

        Clearly below: at or below the candidate under it, at least
        ``KNEE_SIDE`` of the (forgotten) steps.  Otherwise the data says the
        cost rises somewhere between the candidate below and the knee,
        not where: a knee is kept then (``_choose_knee``), and the policy
        reads that stretch as a roofline (``GoodputPolicy.decide``).
        """
        i = self._knee_idx
        if i <= 0:  # no knee, or none under the lowest candidate to compare with
            return True
        return self._w - self._h_past[i - 1] >= self.KNEE_SIDE * self._w

    def catchup_seconds(self, tokens: float, batch: float = 1.0) -> float:
        """Predicted seconds of a draft catch-up pass over ``tokens`` tokens."""
        if tokens <= 0:
            return 0.0
        a_pass = self.linear_terms(batch)[2]
        return a_pass + self._catchup_per_token * tokens

    def predict_lower(self, batch: float, tokens, k_steps, optimism: float = 0.0,
                      terms: tuple | None = None) -> list:
        """Predicted seconds for many candidate plans at once (lists of floats).

        Linear terms only: the knee (``knee_terms``) depends on the whole
        step's tokens, prefill included, which the policy adds itself.
        With ``optimism > 0`` this is a lower confidence bound: the
        prediction minus ``optimism`` standard errors of the fit.  Plans the
        data has not covered yet (more drafts than ever tried) look a little
        cheaper than the point estimate, so the controller tries them once
        and measures, instead of trusting the prior forever.  Where data is
        plentiful the bound is tight and this changes nothing.

        The bound never goes below halfway from a plain step (``tokens ==
        batch``, no draft pass) to the plan's point estimate: a plan does
        the plain step's work and more, and the policy compares it with a
        plain step at its point estimate.  The floor used to be half the
        plan's own estimate, which lies below a plain step wherever a
        drafting step costs less than twice a plain one.  In CI, on the tiny
        test models (a draft pass about half a plain step), a draft accepted
        3% of the time was run in 131 of 192 request-steps.  A trace of the
        same test here: one new request's prefill, priced at 2.7x what it
        took, raised the residual scale sixteenfold, and the bound of a
        one-draft step fell to that floor, 30% below a plain step.  Plain
        Python over a few candidates (one per K_step) is cheaper than array
        calls.
        """
        # For a fixed batch the five features are linear in (1, tokens,
        # passes): x = P @ (1, tokens, passes).  theta and the covariance
        # reduced through P are cached per batch size (they change only when
        # a step is observed), so a candidate plan costs a few flops.
        # ``terms``: reduced terms to use instead (the policy's roofline
        # reading of them, ``GoodputPolicy.decide``).
        a0, a1, a2, (c00, c01, c02, c11, c12, c22) = terms or self._reduced(batch)
        passes = [self.draft_passes(k) for k in k_steps]
        if optimism <= 0.0 or not self._scaled:
            return [a0 + a1 * t + a2 * k for t, k in zip(tokens, passes)]
        plain = a0 + a1 * batch
        out = []
        for t, k in zip(tokens, passes):
            pred = a0 + a1 * t + a2 * k
            var = c00 + t * (2.0 * c01 + c11 * t) + k * (2.0 * c02 + c22 * k + (2.0 * c12) * t)
            out.append(max(pred - optimism * math.sqrt(max(var, 0.0)), 0.5 * (plain + pred)))
        return out

    def reduced_terms(self, batch: float) -> tuple:
        """(a0, a_tok, a_pass, covariance terms) at this batch size; see predict_lower."""
        return self._reduced(batch)

    def linear_terms(self, batch: float) -> tuple[float, float, float]:
        """Step seconds at this batch size as a0 + a_tok * tokens + a_pass * passes.

        ``passes``: ``draft_passes(K_step)``."""
        a0, a1, a2, _ = self._reduced(batch)
        return a0, a1, a2

    def _reduced(self, batch: float) -> tuple:
        """theta and the covariance reduced to (1, tokens, passes), as floats.

        The reduction is x = P @ (1, tokens, passes) with P's columns
        e0 + B e1, e2 and e3 + B e4; written out in scalars because it is
        redone after every observed step, for every plan, and 5x5 array
        products cost more in call overhead than in arithmetic.
        """
        cached = self._reduced_cache.get(batch)
        if cached is None:
            b = float(batch)
            t0, t1, t2, t3, t4 = self._theta.tolist()
            c = self._covariance().tolist()
            # u . C . v for the reduced directions u, v.
            c00 = c[0][0] + 2.0 * b * c[0][1] + b * b * c[1][1]
            c01 = c[0][2] + b * c[1][2]
            c02 = c[0][3] + b * (c[0][4] + c[1][3]) + b * b * c[1][4]
            c11 = c[2][2]
            c12 = c[2][3] + b * c[2][4]
            c22 = c[3][3] + 2.0 * b * c[3][4] + b * b * c[4][4]
            cached = (t0 + b * t1, t2, t3 + b * t4, (c00, c01, c02, c11, c12, c22))
            self._reduced_cache[batch] = cached
        return cached

    def _covariance(self) -> np.ndarray:
        if self._cov is None:
            try:
                inv = np.linalg.inv(self._xtx + self._ridge)
            except np.linalg.LinAlgError:
                inv = np.zeros((len(FEATURES), len(FEATURES)))
            self._cov = self._resid_var * inv
        return self._cov

    CATCHUP_WEIGHT = 0.3

    def _observe_catchup(self, pred: float, seconds: float, tokens: float) -> None:
        # The step's excess over the fitted step model is the catch-up's cost
        # (clipped: a stall must not make catch-ups look prohibitive).
        excess = min(max(seconds - pred, 0.0), 4.0 * max(pred, 0.0))
        w = 0.5 if self.num_catchups == 0 else self.CATCHUP_WEIGHT
        self._catchup_per_token += w * (excess / tokens - self._catchup_per_token)
        self.num_catchups += 1

    def observe(self, batch: float, tokens: float, k_step: float, seconds: float,
                catchup: float = 0.0) -> bool:
        """Add one measured step; returns False when the sample was dropped."""
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds)) or seconds <= 0:
            self.num_rejected += 1
            return False
        if self._skipped < self.SKIP_FIRST:
            # The first steps of an engine carry one-off costs (lazy
            # initialisation, allocator warm-up) that say nothing about
            # steady state; calibrating on them skews every later decision.
            self._skipped += 1
            return False
        if (k_step > 0 or catchup > 0) and self._skipped_drafting < self.SKIP_FIRST_DRAFTING:
            # Likewise the first steps that run the draft and verify its
            # tokens: new shapes for both models (measured at TP=2 on a CPU:
            # the first such step took 43x a plain step, the second 2x).
            # Kept, the second set the draft pass's price at six times its
            # steady value from a single sample; nothing was drafted after
            # it, so nothing measured the price again, and the probe gate,
            # which asks that price, never let a probe out.
            self._skipped_drafting += 1
            return False
        # A catch-up is one more draft pass (its per-token part is below).
        x = features(batch, tokens, self.draft_passes(k_step) + (1 if catchup > 0 else 0))
        if not self._scaled:
            # Express the prior in seconds using the first real measurement.
            unit = float(x @ self._theta0)
            scale = seconds / unit if unit > 0 else seconds
            self._theta0 = self._theta0 * scale
            self._theta = self._theta0.copy()
            self._catchup_per_token *= scale
            self._scaled = True
        if catchup > 0:
            # Learn the catch-up's price from the step's excess, then fit the
            # rest of the step as usual.
            self._observe_catchup(float(x @ self._theta) + self.knee_seconds(tokens),
                                  seconds, catchup)
            seconds = max(seconds - self._catchup_per_token * catchup, 0.5 * seconds)
        pred = float(x @ self._theta) + self.knee_seconds(tokens)
        if pred > 0:
            # Huber-style: clip the relative residual to a few times its own
            # running scale, so a GC pause or a stalled clock moves the fit
            # by at most a little.
            rel = seconds / pred - 1.0
            # Judged against the recent residuals of steps of about the same
            # size, not against the fit alone.  A stall is a lone slow step;
            # a model that misprices a whole range of step sizes is slow (or
            # fast) on every step there.  Measured on the simulated 8B +
            # EAGLE at c=256: a linear fit carried by the steps with a
            # prefill chunk (768+ tokens) priced the decode-only steps (256
            # tokens, a third of all steps) 35% low, and 92 of 107 of them
            # were dropped as stalls, so nothing ever told the fit (or the
            # knee test) that those steps cost more than it said.
            bias = self._bucket_bias(tokens, rel)
            rel_local = (1.0 + rel) / (1.0 + bias) - 1.0
            bound = 3.0 * max(self._rel_scale, 0.05)
            # The band is the median relative error of recent steps: robust
            # to the outliers it clips (an average of clipped errors let a
            # run of outliers widen the band until they passed unclipped).
            self._rel_hist.append(abs(rel_local))
            self._rel_scale = statistics.median(self._rel_hist)
            # Only a slow step is suspect where steps are timed exactly.  A
            # step much faster than predicted says the prediction is wrong
            # (early on, the prior's shape: on tiny models it overprices
            # drafts several times), and dropping it, while the band was
            # still narrow, kept the fit on the prior until a stall arrived
            # and was kept instead.  Under async scheduling a step is timed
            # from the end of the previous step's update, so a late update
            # splits the time unevenly between two steps and a fast sample
            # can be an artifact: there both sides are suspect.
            if rel_local > bound or (rel_local < -bound and not self.keep_fast_steps):
                self.num_rejected += 1
                if abs(rel_local) > 2.0 * bound:
                    # Far outside the band: a stall or a clock jump, not what
                    # the step cost.  Even clipped, each such sample pushes
                    # the fit the same way (stalls are only ever slow), and
                    # in directions that few steps excite (long drafts while
                    # most steps are plain) it stays pushed.  Dropped; a real
                    # change in cost persists, moves the residuals of its
                    # step sizes (the bias above) and is then fitted.
                    return False
                seconds = pred * (1.0 + bias) * (1.0 + max(-bound, min(rel_local, bound)))
        if self.num_observations == 0:
            # Before any residual is seen, assume a tenth of a step.
            self._resid_var = (0.1 * seconds) ** 2
        else:
            self._resid_var = 0.9 * self._resid_var + 0.1 * (seconds - pred) ** 2
        self._cov = None
        self._reduced_cache.clear()
        lam = self.forgetting
        self._xtx = lam * self._xtx + np.outer(x, x)
        self._xty = lam * self._xty + x * seconds
        h = np.maximum(float(tokens) - KNEES, 0.0)
        self._hx = lam * self._hx + np.outer(h, x)
        self._hh = lam * self._hh + h * h
        self._hy = lam * self._hy + h * seconds
        self._h_past = lam * self._h_past + (h > 0)
        self._w = lam * self._w + 1.0
        self._yy = lam * self._yy + seconds * seconds
        self.num_observations += 1
        self.num_drafting_observations += k_step > 0 or catchup > 0
        if (self.num_observations >= self.KNEE_MIN_OBS
                and self.num_observations % self.KNEE_EVERY == 0):
            self._choose_knee()
        self._refit()
        return True

    BUCKET_HISTORY = 5
    BUCKET_MIN = 3

    def _bucket_bias(self, tokens: float, rel: float) -> float:
        """The median relative residual of recent steps of about this size.

        Steps are grouped by the knee grid (sizes a factor sqrt(2) apart);
        the median of the last few (this one included) is 0 until
        ``BUCKET_MIN`` are in, and a lone stall cannot move it.
        """
        key = int(np.searchsorted(KNEES, tokens))
        hist = self._bucket_rel.get(key)
        if hist is None:
            hist = self._bucket_rel[key] = collections.deque(maxlen=self.BUCKET_HISTORY)
        hist.append(rel)
        if len(hist) < self.BUCKET_MIN:
            return 0.0
        return statistics.median(hist)

    # A knee is looked for once this many steps are in, then every KNEE_EVERY
    # steps, and adopted when it leaves at most KNEE_GAIN of the linear
    # fit's squared error (a spurious knee in noise gains a few percent).
    KNEE_MIN_OBS = 24
    KNEE_EVERY = 16
    KNEE_GAIN = 0.7
    KNEE_SIDE = 0.1
    # Steps past the knee may be few: at small batch only the steps that
    # carry a prefill chunk get there (one in twenty at c=8), and without a
    # knee those few pull the linear fit's token price up for every step.
    KNEE_PAST_SIDE = 0.03
    KNEE_SPREAD = 0.1

    def _system(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """The ridge system with candidate knee ``i`` (-1: linear)."""
        a = self._xtx + self._ridge
        b = self._xty + self._ridge @ self._theta0
        if i < 0:
            return a, b
        n = len(FEATURES)
        a6 = np.empty((n + 1, n + 1))
        a6[:n, :n] = a
        a6[n, :n] = a6[:n, n] = self._hx[i]
        a6[n, n] = self._hh[i] + self.prior.strength
        return a6, np.append(b, self._hy[i])

    def _refit(self) -> None:
        fitted = self._solve_nonnegative(*self._system(self._knee_idx))
        if fitted is None:
            return
        theta, inv = fitted
        n = len(FEATURES)
        if self._knee_idx >= 0:
            self.knee_slope = float(theta[n])
            theta, inv = theta[:n], inv[:n, :n]
        self._theta = theta
        self._cov = self._resid_var * inv

    def _choose_knee(self) -> None:
        """Keep, drop or move the knee by the fits' squared errors."""
        n = len(FEATURES)
        # Unconstrained ridge fits, linear and with each knee, compared by
        # their squared error on the data.  With the prior in both, a knee
        # wins when it explains the data better than the prior's shape can:
        # where a step that verifies more drafts costs more, the prior puts
        # it on the drafts' tokens and passes, and the data on both sides of
        # a knee tells them apart.
        try:
            theta = np.linalg.solve(*self._system(-1))
        except np.linalg.LinAlgError:
            return
        best_err = self._yy - 2.0 * theta @ self._xty + theta @ self._xtx @ theta
        best = -1
        # All candidates at once: (m, 6, 6) systems, one batched solve.
        a = np.zeros((KNEES.size, n + 1, n + 1))
        a[:, :n, :n] = self._xtx + self._ridge
        a[:, n, :n] = a[:, :n, n] = self._hx
        a[:, n, n] = self._hh + self.prior.strength
        b = np.zeros((KNEES.size, n + 1))
        b[:, :n] = self._xty + self._ridge @ self._theta0
        b[:, n] = self._hy
        try:
            thetas = np.linalg.solve(a, b[..., None])[..., 0]
        except np.linalg.LinAlgError:
            return
        # Squared error on the data alone (without the ridge's pseudo-rows).
        data = a.copy()
        data[:, :n, :n] -= self._ridge
        data[:, n, n] -= self.prior.strength
        data_b = b.copy()
        data_b[:, :n] -= self._ridge @ self._theta0
        errs = (self._yy - 2.0 * np.einsum("ij,ij->i", thetas, data_b)
                + np.einsum("ij,ijk,ik->i", thetas, data, thetas))
        # A knee must add cost (convex: past the ridge tokens cost more) and
        # have steps clearly on both sides: past the candidate above it (a
        # few will do: KNEE_PAST_SIDE), and below it either at or below the
        # candidate below it, or at or below the knee itself with sizes that
        # differ (a spread of at least KNEE_SPREAD of the knee), so that the
        # slope below it is measured.
        # A knee at the plain steps' tokens, with every step below it of one
        # size, is the linear model with its token slope split in two, half
        # of it freed from the prior; it would win whenever the prior's
        # token price is off.  (The spread was added for the simulated 8B +
        # EAGLE at c=256: decode-only steps that draft sit at 420-512
        # tokens, so a knee at 512 qualified only while a few steps went
        # undrafted, and the model flipped between 512, 724 and none; the
        # slope below 724 is twice the one below 512, and half the requests
        # went undrafted in steps where their drafts were almost free.)
        side = self.KNEE_SIDE * self._w
        below = self._w - self._h_past
        well_below = np.zeros(KNEES.size)
        well_below[1:] = below[:-1]
        past = np.zeros(KNEES.size)
        past[:-1] = self._h_past[1:]
        below_ok = (well_below >= side) | (
            (below >= side) & (self._spread_below(below) >= self.KNEE_SPREAD * KNEES))
        past_ok = past >= self.KNEE_PAST_SIDE * self._w
        fitted = (thetas[:, n] > 0) & np.isfinite(errs)
        ok = fitted & below_ok & past_ok
        if ok.any():
            i = int(np.argmin(np.where(ok, errs, np.inf)))
            if errs[i] < self.KNEE_GAIN * best_err:
                best = i
        cur = self._knee_idx
        if best < 0 and cur >= 0 and fitted[cur] and not self.knee_seen_from_below():
            # Few steps are left clearly below the knee (at or below the
            # candidate under it): the knee is kept while there is too
            # little data to judge it.  Those steps go when the policy acts
            # on the knee.  Simulated 8B + EAGLE at c=256 (hard text): once
            # every decode-only step drafted one token for every request
            # (512 tokens, on the knee), the evidence below it was only
            # being forgotten, its gain over a linear fit faded, and the
            # knee fell to none for 16-48 steps twice a run.  The linear
            # fit then priced a draft in a step with a prefill chunk like
            # one in a decode-only step, and probes went out there at the
            # compute-bound price.  (Kept as well while it still removed
            # 15% of the error, the CPU profile's transient knees lived on
            # and cost a draft catch-up: cpu-qwen switch c=8, one seed
            # 4.39 -> 4.01 tok/s.)
            best = cur
        self.knee_searches_unchanged = 0 if best != self._knee_idx else (
            self.knee_searches_unchanged + 1)
        if best != self._knee_idx:
            self._knee_idx = best
            self.knee = None if best < 0 else float(KNEES[best])
            self.knee_slope = 0.0
            self._reduced_cache.clear()
            self._cov = None

    def _spread_below(self, below: np.ndarray) -> np.ndarray:
        """Per candidate knee, the (forgotten) std of the tokens of the steps at or below it.

        Derived from statistics the fit keeps anyway: all steps' sums of T
        and T^2 are in ``_xtx``; past a knee T = h + knee, and ``_hx``,
        ``_hh`` and ``_h_past`` hold the sums of h, h^2 and the count there.
        ``below`` is the forgotten count of steps at or below each knee.
        """
        i, t = FEATURES.index("intercept"), FEATURES.index("tokens")
        sum_h = self._hx[:, i]
        past_t = sum_h + KNEES * self._h_past
        past_tt = self._hh + 2.0 * KNEES * sum_h + KNEES ** 2 * self._h_past
        with np.errstate(divide="ignore", invalid="ignore"):
            mean = (self._xtx[i, t] - past_t) / below
            return np.sqrt(np.maximum((self._xtx[t, t] - past_tt) / below - mean ** 2, 0.0))

    @staticmethod
    def _solve_nonnegative(a: np.ndarray, b: np.ndarray):
        """``a @ theta = b`` with every slope (``theta[1:]``) >= 0.

        Costs never fall when a step does more work: a negative slope is
        noise, and would make draft slots look free.  Clamping it to 0 after
        an unconstrained solve is not enough: features that always move
        together (at one batch size the intercept and the batch term, K_step
        and batch x K_step) share what the data says about their sum, and a
        clamp throws the negative part away, so the sum, a plain step's
        predicted cost, comes out too high.  So a negative slope is fixed at
        0 and the others are solved again (an active set; five features, at
        most four rounds).  Returns (theta, inverse used for the covariance)
        or None when the system is singular or not finite.
        """
        n = len(b)
        free = list(range(n))
        for _ in range(n):
            # All slopes free is the usual case: no sub-matrix to gather.
            full = len(free) == n
            sub = a if full else a[np.ix_(free, free)]
            try:
                inv_free = np.linalg.inv(sub)
            except np.linalg.LinAlgError:
                return None
            theta_free = inv_free @ (b if full else b[free])
            values = theta_free.tolist()
            if not all(map(math.isfinite, values)):
                return None
            # The intercept may take any sign.
            negative = {i for i, v in zip(free, values) if v < 0.0 and i != 0}
            if not negative:
                if full:
                    return theta_free, inv_free
                theta = np.zeros(n)
                theta[free] = theta_free
                inv = np.zeros((n, n))
                inv[np.ix_(free, free)] = inv_free
                return theta, inv
            free = [i for i in free if i not in negative]
        return None
