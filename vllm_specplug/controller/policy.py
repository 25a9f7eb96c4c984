"""Policies: how many draft slots each request gets in the next step.

Every policy answers the same question with the same inputs: for a batch of
``B`` decoding requests with per-request ceilings, return ``k[r]`` (drafts to
verify for request ``r`` next step) and ``K_step`` (how many draft positions
the proposer runs), with ``k[r] <= K_step <= max_k``.

- ``GoodputPolicy`` (the default) maximises predicted accepted tokens per
  second using the acceptance estimator and the step-cost model.
- ``StaticPolicy`` is fixed K, the baseline everyone runs today.
- ``HeuristicPolicy`` is Hugging Face assisted generation's rule: +2 after a
  fully accepted draft, -1 otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from vllm_specplug.controller import compiled
from vllm_specplug.controller.cost_model import StepCostModel
from vllm_specplug.controller.estimator import AcceptanceEstimator


@dataclass
class Decision:
    k_step: int
    k: np.ndarray  # per request, same order as the batch
    predicted_seconds: float = float("nan")
    predicted_tokens: float = float("nan")
    plain_seconds: float = float("nan")
    plain_tokens: float = float("nan")
    # Per request, the slots of the batch's plan in a step without prefill;
    # set only where this step's prefill chunk takes it past the cost knee
    # (GoodputPolicy._decode_only_plan).
    decode_only_k: np.ndarray | None = None

    @property
    def predicted_speedup(self) -> float:
        if not (self.predicted_seconds > 0 and self.plain_seconds > 0):
            return float("nan")
        return (self.predicted_tokens / self.predicted_seconds) / (
            self.plain_tokens / self.plain_seconds
        )


class GoodputPolicy:
    """Give draft slots where they raise accepted tokens per second.

    For each K_step j (draft positions the proposer runs, shared by the whole
    batch) the best plan is closed-form: a slot (request r, position p <= j)
    is worth it when its survival probability s[r, p] (the chance that
    drafts 1..p are all accepted) is at least lambda * c_T, where c_T is the
    cost of verifying one token and lambda the value of time in tokens per
    second.  The j with the largest net gain, expected accepted drafts minus
    lambda times the extra step time (verification and j draft passes), is
    the plan; none is plain decoding, whether the drafts are bad or the
    batch is compute-bound.  (Where the proposer's first pass runs at
    K_step = 0 as well, j positions cost j - 1 passes more than plain:
    ``StepCostModel.draft_passes``.)  lambda is found by Dinkelbach's iteration:
    start from plain decoding's rate, take the best plan's rate, repeat; it
    converges to the best achievable rate in a few rounds.

    When the cost model has found a knee (a GPU's roofline ridge: past it a
    token costs ``knee_slope`` more), the bar is two-tiered: a slot worth the
    higher price is always taken, and below the knee, which the step's
    prefill tokens bring closer, the most likely of the slots worth the lower
    price fill the room that is left (``_knee_plans``).  Where few steps lie
    clearly below the knee (``StepCostModel.knee_seen_from_below``), the fit's
    slope below it only joins the plain step to the knee, and the stretch is
    read as a roofline instead: free up to where the slope past the knee
    reaches the fitted cost at the knee.

    Rates count decode work only: prefill tokens in the same step cost the
    same time whatever is drafted, so they do not lower the bar for drafts.
    A step whose prefill takes it past the knee values time at the rate of
    the batch's steps without prefill (``_decode_only_plan``), not at its own.
    Step times for the final choice of j are lower confidence bounds of the
    cost model (``optimism`` standard errors), so a K_step the data has not
    covered is tried and measured rather than trusted to the prior forever.
    """

    name = "goodput"
    ROUNDS = 1
    # A draft catch-up is paid once and buys speculation for as long as the
    # drafts stay good; a plan is charged this many steps' share of it.  It
    # replaces the draft passes the skipped steps did not run, so over the
    # gap it costs less than vLLM's always-on first pass did.
    CATCHUP_AMORTIZATION_STEPS = 8

    def __init__(self, min_gain: float = 0.02, optimism: float = 1.0,
                 use_compiled: bool = True) -> None:
        # Speculation must promise at least this relative gain over plain
        # decoding; keeps noise in the estimates from flapping near 1.0x.
        self.min_gain = min_gain
        # Standard errors of cost optimism for plans the data has not covered.
        self.optimism = optimism
        self._cache: dict = {}  # width -> scratch table (see _buffer)
        self._ones = np.ones(0)
        self._positions_cache: dict = {}
        self._catchup_share = 0.0
        self._optimism = optimism
        self._knee = (math.inf, 0.0)
        self._threshold = None
        # The compiled loop (vllm_specplug.controller.compiled) when numba is
        # there; tests switch it off to check the NumPy path against it.
        self.use_compiled = use_compiled

    def decide(
        self,
        survival: np.ndarray,
        ceilings: np.ndarray,
        base_tokens: float,
        cost: StepCostModel,
        fixed_k_step: int | None = None,
        capped: bool | None = None,
        catchup_tokens: float = 0.0,
        explore: bool = True,
    ) -> Decision:
        """Best plan for ``survival`` (rows non-increasing along positions).

        ``base_tokens`` is what the step schedules besides drafts (one per
        decoding request plus prefill chunks).  ``capped`` says whether any
        ceiling is below the table's width (computed when None).
        ``explore=False`` judges every plan at the cost model's point
        estimate, without the optimism that gets untried plans measured.
        """
        batch, width = survival.shape
        a0, a_tok, a_pass, cov = cost.reduced_terms(batch)
        knee, knee_slope = cost.knee_terms()
        if knee_slope > 0 and a_tok > 0 and batch < knee and not cost.knee_seen_from_below():
            # The steps measured near the knee sit on it and at the plain
            # step, with almost nothing between: the fit has a slope below
            # the knee that only joins those two, and says nothing of where
            # in between the step turns compute-bound.  A roofline is flat
            # and then rises at its compute slope, so read that stretch as
            # one: no price up to a knee placed where the slope past it
            # reaches the fitted cost at the knee.  Priced at the joining
            # slope, every slot up to the knee looked worth it: in the
            # simulated 8B + EAGLE at c=256 (hard text) the policy drafted
            # for all 256 requests (512 tokens, 12.7 ms) where the true
            # step turns at about 420 tokens and the oracle drafts for
            # 171-176 (10.7 ms).  Past the fitted knee nothing changes.
            slope_past = a_tok + knee_slope
            knee -= a_tok * (knee - batch) / slope_past
            knee_slope = slope_past
            a0, a_tok = a0 + a_tok * batch, 0.0
        decode_only = None
        decode_rate = 0.0
        if knee_slope > 0 and batch < knee < base_tokens:
            # A step whose prefill chunk takes it past the knee pays the
            # higher price for every draft; see _decode_only_plan.
            decode_only = self._decode_only_plan(survival, ceilings, cost, fixed_k_step, capped,
                                                 catchup_tokens)
            if decode_only.predicted_seconds > 0:
                decode_rate = decode_only.predicted_tokens / decode_only.predicted_seconds
        self._optimism = self.optimism if explore else 0.0
        if capped is None:
            capped = bool(ceilings.min(initial=width) < width)
        s = survival
        if capped:
            s = np.where(self._positions(width) < ceilings[:, None], s, 0.0)
        terms = (a0, a_tok, a_pass, cov)
        self._catchup_share = (cost.catchup_seconds(catchup_tokens, batch)
                               / self.CATCHUP_AMORTIZATION_STEPS if catchup_tokens > 0 else 0.0)
        # Past the cost model's knee (if any) a token costs knee_slope more;
        # room: tokens this step can still add before it (negative when the
        # step's prefill is already past it).
        room = knee - base_tokens if knee_slope > 0 else math.inf
        prefill_s = a_tok * max(base_tokens - batch, 0.0)
        t_plain = a0 + a_tok * batch  # a decode-only plain step
        if knee_slope > 0:
            # Split the plain step's knee term between decode and prefill.
            decode_knee = knee_slope * max(batch - knee, 0.0)
            t_plain += decode_knee
            prefill_s += knee_slope * max(-room, 0.0) - decode_knee
        self._knee = (room, knee_slope)
        lam = max(batch / t_plain if t_plain > 0 else 0.0, decode_rate)
        if self.use_compiled and compiled.best_plan is not None:
            k = np.empty(batch, dtype=np.int64)
            j, tokens, n, seconds = compiled.best_plan(
                np.ascontiguousarray(s, dtype=np.float64),
                -1 if fixed_k_step is None else int(fixed_k_step), self.ROUNDS, lam,
                a0, a_tok, a_pass, t_plain, self._catchup_share,
                self._optimism if cost.calibrated else 0.0, *cov,
                room if room < math.inf else 1e300, knee_slope, cost.pass_offset, k)
            return self._finish(j, tokens, n, seconds, k, batch, t_plain, prefill_s,
                                fixed_k_step, decode_only)
        # take[r, p] = 1.0 where slot (r, p) is granted; s * take beside it.
        buf = self._buffer(batch, width)
        for _ in range(self.ROUNDS):
            j, tokens, n, seconds = self._best_j(s, buf, fixed_k_step, lam, terms, batch,
                                                 t_plain, cost, optimistic=False)
            rate = tokens / seconds if seconds > 0 else 0.0
            if rate <= lam * (1.0 + 1e-6):
                break
            lam = rate
        j, tokens, n, seconds = self._best_j(s, buf, fixed_k_step, lam, terms, batch, t_plain,
                                             cost, optimistic=True)
        if n > 0 and self._threshold is not None:
            # The knee bound: the plan takes the slots down to this survival.
            top = s[:, :j]
            k = np.count_nonzero((top >= self._threshold) & (top > 0.0), axis=1).astype(np.int64)
        elif n > 0:
            # The last _best_j left the chosen slots (at this lam) in buf.
            k = (buf[0, :, :j] @ self._ones[:j]).astype(np.int64)
        else:
            k = None
        return self._finish(j, tokens, n, seconds, k, batch, t_plain, prefill_s, fixed_k_step,
                            decode_only)

    def _decode_only_plan(self, survival, ceilings, cost, fixed_k_step, capped,
                          catchup_tokens) -> Decision:
        """This batch's plan in a step without prefill, at point estimates.

        Its predicted tokens per second are the value of time in a step
        that carries a prefill chunk past the knee, and its slots tell the
        controller's probes which requests are left out only by the chunk
        (``Decision.decode_only_k``).  In a closed loop (a new request for
        each one finished) a request's prefill chunk arrives once per
        request whatever is drafted, so the steps that carry one come a
        fixed number of times per request, and the rate is highest when
        each such step maximises its tokens minus ``lambda_D`` times its
        seconds, where ``lambda_D`` is the rate of the steps without
        prefill.  (Per request of L tokens, with the decode-only steps'
        tokens g_D in t_D and the prefill step's g_P in t_P: time per token
        is (1 - g_P / L) t_D / g_D + t_P / L.)  The
        step's own rate is lower, since its drafts all cost the price past
        the knee, and as the bar it took drafts the decode-only steps would
        have beaten: in the simulated 70B + 1B at c=64, where two steps in
        five carry a chunk, those steps drafted at K_step 3-5 where the
        oracle drafts 1.
        """
        return self.decide(survival, ceilings, float(survival.shape[0]), cost, fixed_k_step,
                           capped=capped, catchup_tokens=catchup_tokens, explore=False)

    def _finish(self, j, tokens, n, seconds, k, batch, t_plain, prefill_s, fixed_k_step,
                decode_only=None):
        """The Decision for the best plan found: plain decoding unless it pays enough."""
        plain_rate = batch / t_plain if t_plain > 0 else 0.0
        if (fixed_k_step is None and j > 0 and seconds > 0
                and tokens / seconds < plain_rate * (1.0 + self.min_gain)):
            j, tokens, n, seconds = 0, float(batch), 0, t_plain
        if n == 0 and fixed_k_step is None:
            j = 0
        if n == 0:
            k = np.zeros(batch, dtype=np.int64)
            if fixed_k_step is None:
                seconds, tokens = t_plain, float(batch)
        return Decision(
            k_step=int(j),
            k=k,
            predicted_seconds=float(seconds + prefill_s),
            predicted_tokens=float(tokens),
            plain_seconds=float(t_plain + prefill_s),
            plain_tokens=float(batch),
            decode_only_k=None if decode_only is None else decode_only.k,
        )

    def _best_j(self, s, buf, fixed_k_step, lam, terms, batch, t_plain, cost, optimistic):
        """(j, expected tokens, slots, decode seconds) of the best plan at ``lam``.

        ``terms``: the reduced cost terms the plan is priced with (as
        ``StepCostModel.reduced_terms``, or ``decide``'s roofline reading).

        Leaves the slots taken at ``lam`` in ``buf[0]``.  This runs two or
        three times in every decision, so it is a handful of array
        operations over the table (compare, multiply, one matrix product for
        the per-position sums); the scan over K_step, at most ``max_k + 1``
        values, is plain Python, cheaper than array calls at that size.
        """
        _, a_tok, a_pass, _ = terms
        bar = lam * a_tok
        take, weighted = buf[0], buf[1]
        # With a zero verification cost the bar is 0 and only positive
        # survival counts (slots above a ceiling are 0 and never granted).
        if bar > 0:
            np.greater_equal(s, bar, out=take)
        else:
            np.greater(s, 0.0, out=take)
        np.multiply(s, take, out=weighted)
        counts, gains = (self._ones[:batch] @ buf).tolist()
        n_cum = [0.0, *accumulate(counts)]
        gain_cum = [0.0, *accumulate(gains)]
        room, knee_slope = self._knee
        thresholds = None
        if room < n_cum[-1]:
            n_cum, gain_cum, thresholds = self._knee_plans(s, lam, a_tok, bar, n_cum, gain_cum)
        if fixed_k_step is None:
            js = range(len(n_cum))
        else:
            js = (fixed_k_step,)
            n_cum, gain_cum = [n_cum[fixed_k_step]], [gain_cum[fixed_k_step]]
            if thresholds is not None:
                thresholds = [thresholds[fixed_k_step]]
        if optimistic:
            seconds = cost.predict_lower(batch, [batch + n for n in n_cum], js, self._optimism,
                                         terms)
            if js[0] == 0:
                seconds[0] = t_plain  # plain decoding is judged at its point estimate
        else:
            seconds = [t_plain + a_tok * n + a_pass * cost.draft_passes(j)
                       for n, j in zip(n_cum, js)]
        if knee_slope > 0:
            # The knee's extra seconds for n slots, beyond the plain step's.
            past0 = max(-room, 0.0)
            seconds = [sec + knee_slope * (max(n - room, 0.0) - past0) if j > 0 else sec
                       for sec, n, j in zip(seconds, n_cum, js)]
        share = self._catchup_share
        if share > 0:
            seconds = [sec + share if j > 0 else sec for sec, j in zip(seconds, js)]
        nets = [g - lam * ((sec if sec > 1e-12 else 1e-12) - t_plain)
                for g, sec in zip(gain_cum, seconds)]
        if fixed_k_step is None:
            # A K_step whose last position holds no slot runs a draft pass
            # for nothing; the optimistic bound, looser for longer drafts
            # the data has not covered, could still rank it first.
            for i in range(1, len(nets)):
                if n_cum[i] == n_cum[i - 1] and gain_cum[i] == gain_cum[i - 1]:
                    nets[i] = -math.inf
        i = nets.index(max(nets))  # the first best, as argmax would
        self._threshold = None if thresholds is None else thresholds[i]
        return js[i], batch + gain_cum[i], int(n_cum[i]), max(seconds[i], 1e-12)

    def _knee_plans(self, s, lam, a_tok, bar, n_cum, gain_cum):
        """Per K_step, the best slots when the step may cross the cost knee.

        Below the knee a slot costs a_tok, past it a_tok + knee_slope.  Gains
        taken in order of survival fall and costs rise, so the best number of
        slots is where they cross: every slot worth the higher price, then
        more, up to the knee, among those worth the lower price.  Returns
        (slots, gains, survival threshold) per K_step; the slots are the
        table's largest within positions < K_step.
        """
        room, knee_slope = self._knee
        width = s.shape[1]
        bar_hi = lam * (a_tok + knee_slope)
        positions = np.broadcast_to(np.arange(width), s.shape)
        worth = (s >= bar) & (s > 0.0) if bar > 0 else s > 0.0
        vals, pos = s[worth], positions[worth]
        order = np.argsort(-vals, kind="stable")
        vals, pos = vals[order], pos[order]
        n_out, g_out, thr_out = [0.0], [0.0], [math.inf]
        for j in range(1, width + 1):
            mine = vals[pos < j]
            n_lo = mine.size
            n_hi = int(np.count_nonzero(mine >= bar_hi))
            n = n_lo if room >= n_lo else max(n_hi, int(max(room, 0.0)))
            n_out.append(float(n))
            g_out.append(float(mine[:n].sum()) if n < n_lo else gain_cum[j])
            thr_out.append(float(mine[n - 1]) if n > 0 else math.inf)
        return n_out, g_out, thr_out

    def _buffer(self, batch: int, width: int) -> np.ndarray:
        """A (2, batch, width) scratch table; one allocation per width, grown by doubling."""
        buf = self._cache.get(width)
        if buf is None or buf.shape[1] < batch:
            rows = max(64, 1 << (batch - 1).bit_length())
            buf = self._cache[width] = np.zeros((2, rows, width))
            if self._ones.size < rows:
                self._ones = np.ones(rows)
        return buf[:, :batch]

    def _positions(self, width: int) -> np.ndarray:
        pos = self._positions_cache.get(width)
        if pos is None:
            pos = self._positions_cache[width] = np.arange(width)[None, :]
        return pos


class StaticPolicy:
    name = "static"

    def __init__(self, k: int) -> None:
        self.k = k

    def decide(self, ceilings: np.ndarray, fixed_k_step: int | None = None) -> Decision:
        k = np.minimum(ceilings, self.k)
        k_step = fixed_k_step if fixed_k_step is not None else self.k
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
        k_step = fixed_k_step if fixed_k_step is not None else int(k.max(initial=0))
        return Decision(k_step=k_step, k=k)
