"""The draft's own confidence: calibrated online, and the per-position stop.

A draft model that is sure of its next token (a closing bracket, a repeated
identifier) is usually right; one that hesitates (the first word of a
sentence) is often wrong.  The request's history cannot tell these apart;
the draft's probability of the token it drafted can.

``ConfidenceCalibration`` learns, from verified drafts, the chance that the
target accepts a draft in each confidence bin (pooled over positions).  A
slot's chance is the bin's acceptance, with the request's own history
estimate of that position as its prior (worth ``PRIOR_WEIGHT`` outcomes): a
bin with many outcomes decides, a cold one leaves the history estimate as
it is.

``DraftStopper`` is the controller's argmax applied one draft position at a
time, inside the draft loop.  The plan fixed the rate its argmax maximised
(tokens per second of decoding: a prefill chunk in the step costs the same
whatever is drafted, so its seconds are not in it); after each position the
survival of every request's slot is known from the confidences of its actual
drafted tokens, and

- a request keeps a slot while its survival pays for the slot's
  verification, up to its cap, and stops at the first slot that does not.
  A slot's verification is priced where it falls: the step's m-th kept
  draft costs what the m-th verified token adds to the step (``slot_cuts[m]``:
  the rate times those seconds), so the surest of a position's new slots
  take the cheapest places;
- the next position runs while the slots it can add are worth its pass
  (their expected survivals less the price of the places they would take,
  summed over the requests still drafting, at least ``pass_cuts``: the rate
  times the pass's seconds at the plan's prices, and past the plan's K_step
  what that pass adds to the step as the argmax prices a plan of so many
  passes, each pass count at its own correction: a plan of four passes
  does not price an eighth at its own row's level).

A deeper slot's survival is never above the one before it, so a pass that
does not pay now cannot be made to pay by the passes after it: stopping at
the first such position is the argmax's own answer.  Nothing here imports
vLLM: the worker's patch (``patches/draft_confidence.py``) feeds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Confidence bins (the draft's top-1 probability), fine where greedy drafts
# are usually accepted.
# Source: the Qwen pair's served trace at 81f3590 (half the verified drafts
# above 0.995); confidence_replay.py on 7 traces.
EDGES = np.array([0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.995])
# Outcomes the request's history estimate weighs as, against a bin's own:
# a bin with fewer follows the history more.
# Source: confidence_replay.py: 1 and 16 score 0.987 / 1.071 of its log loss.
PRIOR_WEIGHT = 4.0


def bins(edges: np.ndarray, confidence) -> np.ndarray:
    """The confidence bin of each draft: how many of the ascending ``edges`` it reaches."""
    return np.searchsorted(edges, confidence, side="right")


def chance(accepted: np.ndarray, verified: np.ndarray, bins: np.ndarray, prior) -> np.ndarray:
    """A slot's calibrated chance: its bin's acceptance, ``prior`` (the
    history estimate) counting as ``PRIOR_WEIGHT`` outcomes."""
    return (accepted[bins] + PRIOR_WEIGHT * prior) / (verified[bins] + PRIOR_WEIGHT)


class ConfidenceCalibration:
    """Per confidence bin, pooled over positions: verified drafts and
    accepted ones (accepted drafts and each request's first rejection); per
    position the same counts, the prior of ``predict``."""

    def __init__(self, width: int, edges: np.ndarray = EDGES) -> None:
        self.width = max(int(width), 1)
        self.edges = np.asarray(edges, dtype=np.float64)
        self.by_position = np.zeros((2, self.width))  # accepted, verified
        self.by_bin = np.zeros((2, self.edges.size + 1))  # accepted, verified

    def position_rates(self) -> np.ndarray:
        acc, n = self.by_position
        return (acc + 1.0) / (n + 2.0)

    def observe(self, confidences: list, accepted: list) -> None:
        """One step's verifications: per request, the confidences of the drafts
        it offered (in order) and how many of them the target accepted."""
        pos, bin_, ok = [], [], []
        for conf, a in zip(confidences, accepted):
            conf = np.asarray(conf, dtype=np.float64)[: self.width]
            seen = min(int(a) + 1, conf.size)  # accepted ones and the first rejection
            if seen <= 0:
                continue
            pos.append(np.arange(seen))
            bin_.append(bins(self.edges, conf[:seen]))
            ok.append(np.arange(seen) < int(a))
        if not pos:
            return
        p, b = np.concatenate(pos), np.concatenate(bin_)
        o = np.concatenate(ok).astype(np.float64)
        np.add.at(self.by_position[0], p, o)
        np.add.at(self.by_position[1], p, 1.0)
        np.add.at(self.by_bin[0], b, o)
        np.add.at(self.by_bin[1], b, 1.0)

    def predict(self, positions: np.ndarray, confidences: np.ndarray) -> np.ndarray:
        """The chance of drafts at ``positions`` with ``confidences``, with the
        positions' pooled rates as the prior (no request history): what the
        trace replays."""
        return chance(self.by_bin[0], self.by_bin[1], bins(self.edges, confidences),
                      self.position_rates()[positions])

    def observed(self) -> tuple[np.ndarray, np.ndarray]:
        """(accepted, verified) per bin: the calibration's evidence."""
        return self.by_bin[0].copy(), self.by_bin[1].copy()


@dataclass
class StopRule:
    """What the worker needs to stop drafting, for one step's plan."""

    req_ids: list[str]
    conditional: np.ndarray  # [requests, width]: history chance of each position
    caps: np.ndarray         # [requests]: most drafts a request may keep
    accepted: np.ndarray     # [bins]: the calibration's evidence
    verified: np.ndarray     # [bins]
    edges: np.ndarray
    slot_cuts: np.ndarray    # [m]: survival the step's (m+1)-th kept draft needs (the last repeats)
    pass_cuts: np.ndarray    # [j]: expected tokens the position after j + 1 passes must add


def plan_stop_rule(req_ids, rows, ceilings, pr, decision, probing, estimator,
                   calibration: ConfidenceCalibration) -> StopRule | None:
    """A goodput plan (``decision`` at the prices ``pr``, for ``req_ids``, whose
    estimator rows are ``rows``) as a per-position stop (``DraftStopper``), or
    None.  ``probing``: which of them the plan probes.

    Only for a goodput plan that drafts and does not pin K_step: the
    draft loop may then run up to each request's ceiling and stops where
    the plan's own argmax, one position at a time, says the next position
    does not pay.  A request the plan left in fallback keeps none, and a
    probe keeps its size; the others may keep up to their ceilings.
    """
    if decision.k_step <= 0 or pr.fixed_k_step is not None or pr.by_n is None:
        return None
    k = decision.k
    caps = np.where((k == 0) | probing, k, ceilings)
    n = int(k.sum())
    # What each further verified draft adds to the step, up to every cap's worth.
    m = min(max(int(caps.sum()), n) + 1, pr.by_n.size)
    k_step = decision.k_step
    by_pass = pr.ratios(m)
    ratio = by_pass[k_step]
    slot_s = np.maximum(np.diff(pr.by_n[:m] * ratio[:m]), 0.0)
    n = min(n, ratio.size - 1)
    # The plan's n slots with 1, 2, ... passes, each priced as the argmax prices
    # it (at its pass count's correction); the plan itself is the K_step-th.
    by_count = (pr.by_n[n] + np.arange(by_pass.shape[0] - 1) * pr.draft_pass) * by_pass[1:, n]
    # The rate the argmax maximised: the plan's tokens over its decoding
    # seconds, the draft's unseen work owed per token.  Not the step's
    # predicted seconds: a prefill chunk's are the step's whatever is
    # drafted, and would price every pass of a prompt's step as paying.
    tokens = decision.predicted_tokens
    rate = tokens / max(float(by_count[k_step - 1]) + pr.owed * tokens, 1e-12)
    # What each further pass adds to the step: up to the plan's K_step, a pass
    # at the plan's price; past it, the plan with p + 1 passes less with p
    # (served at one request, the eighth pass cost 0.12 s where the fifth to
    # seventh cost 0.05-0.07 s: the 8+ row learns it, the plan's row does not).
    pass_s = np.full(by_count.size - 1, pr.draft_pass * ratio[n])
    pass_s[k_step - 1:] = np.maximum(np.diff(by_count[k_step - 1:]), 0.0)
    return StopRule(list(req_ids), estimator.conditional(rows), caps.astype(np.int64),
                    *calibration.observed(), calibration.edges,
                    slot_cuts=rate * slot_s, pass_cuts=rate * pass_s)


class DraftStopper:
    """The stop rule over one draft loop; ``rows[i]``: batch row i's index in the
    rule, or -1 for a row the plan did not cover (drafted as vLLM would)."""

    def __init__(self, rule: StopRule, rows: np.ndarray) -> None:
        self.rule = rule
        self.rows = np.asarray(rows, dtype=np.int64)
        self.ruled = self.rows >= 0
        idx = np.where(self.ruled, self.rows, 0)
        self.cond = rule.conditional[idx] if rule.conditional.size else np.zeros((idx.size, 0))
        self.caps = np.where(self.ruled, rule.caps[idx] if rule.caps.size else 0, 0)
        self.survival = np.ones(self.rows.size)
        self.active = self.ruled & (self.caps > 0)
        self.kept = np.zeros(self.rows.size, dtype=np.int64)
        self.confidence: list[np.ndarray] = []

    @property
    def position(self) -> int:
        return len(self.confidence)

    def after_position(self, confidence: np.ndarray) -> bool:
        """The confidences of the position just drafted; whether the next one runs."""
        j = self.position
        conf = np.asarray(confidence, dtype=np.float64)
        self.confidence.append(conf)
        if not self.ruled.any():
            return True
        width = self.cond.shape[1]
        if j < width:
            self.survival = self.survival * chance(self.rule.accepted, self.rule.verified,
                                                   bins(self.rule.edges, conf), self.cond[:, j])
        else:
            self.survival = np.zeros_like(self.survival)
        keep = self.active & (self.survival > 0.0) & (j < self.caps)
        keep[keep] = self._pays(self.survival[keep])
        self.kept[keep] = j + 1
        self.active = keep & (j + 1 < self.caps)
        if not self.active.any() or j + 1 >= width:
            return False
        nxt = self.survival[self.active] * self.cond[self.active, j + 1]
        cuts = self.rule.pass_cuts
        cut = float(cuts[min(j, cuts.size - 1)]) if cuts.size else 0.0
        return float(np.maximum(nxt - self._cuts(nxt), 0.0).sum()) >= cut

    def _cuts(self, survival: np.ndarray) -> np.ndarray:
        """The price of the places ``survival``'s slots would take, surest first, after the
        slots kept so far."""
        cuts = np.asarray(self.rule.slot_cuts, dtype=np.float64)
        if cuts.size == 0:
            return np.zeros_like(survival)
        order = np.argsort(-survival, kind="stable")
        places = np.minimum(int(self.kept.sum()) + np.arange(survival.size), cuts.size - 1)
        out = np.empty_like(survival)
        out[order] = cuts[places]
        return out

    def _pays(self, survival: np.ndarray) -> np.ndarray:
        return survival >= self._cuts(survival)

    def limits(self) -> np.ndarray:
        """Drafts each batch row may offer: its kept slots, -1 where unruled."""
        return np.where(self.ruled, self.kept, -1)
