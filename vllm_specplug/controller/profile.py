"""The step-cost profile: what a step costs, measured once before serving.

A step of vLLM with speculative decoding costs, on one engine:

    target(T)                a step that drafts nothing (K_step = 0) over
                             the T tokens it schedules (decode tokens,
                             drafts to verify, prefill chunks): the
                             target's forward pass, sampling and
                             verification, and whatever the proposer does
                             at K_step = 0 (vLLM runs a draft model's first
                             pass there too, unless the zero-cost fallback
                             skips it);
  + first(T)                 what drafting at all adds over the same T
                             tokens (K_step >= 1): the draft's first pass
                             where K_step = 0 skipped it;
  + (K_step - 1) * pass(B)   each further draft position, one token for
                             each of the B requests;
  + catchup(C)               a draft catch-up over C skipped tokens (the
                             zero-cost fallback's repair pass, a prefill of
                             the draft over those tokens).

``StepProfile`` holds the three curves at a handful of sizes, measured at
start-up on the engine's own shapes (``vllm_specplug.profiling``) or derived
from a device model (the simulator), and interpolates between them.  On a
GPU with CUDA graphs a step runs at the next captured size: ``pad_sizes``
makes the curves step functions there, as vLLM's own adaptive verification
tables do.  Live step times correct these prices (``ProfileCorrection``, in
``correction.py``).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field

import numba
import numpy as np


def _interp(x: float, xs: list, ys: list, tail: float = 0.0) -> float:
    """Piecewise linear in ``xs``; flat below the first size, the last slope past
    the last (at least ``tail``).

    Scalar and on lists: it prices every plan, and NumPy's per-call cost
    is many times this loop's at a profile's handful of sizes.
    """
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        if len(xs) == 1 and not tail:
            return ys[0] * x / max(xs[0], 1.0)
        slope = (ys[0] / max(xs[0], 1.0) if len(xs) == 1
                 else (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        return ys[-1] + max(slope, tail, 0.0) * (x - xs[-1])
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _interp_many(x: np.ndarray, xs: np.ndarray, ys: np.ndarray, tail: float = 0.0) -> np.ndarray:
    """``_interp`` at each of ``x``."""
    y = np.interp(x, xs, ys)
    if xs.size == 1 and not tail:
        return np.where(x > xs[0], ys[0] * x / max(xs[0], 1.0), y)
    slope = max(ys[0] / max(xs[0], 1.0) if xs.size == 1
                else (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), tail, 0.0)
    past = x > xs[-1]
    return np.where(past, ys[-1] + slope * (x - xs[-1]), y) if past.any() else y


def isotonic(ys) -> np.ndarray:
    """The non-decreasing sequence closest to ``ys`` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in np.asarray(ys, dtype=np.float64).tolist():
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return np.repeat([m for m, _ in blocks], [int(n) for _, n in blocks])


def convex_rise(ys) -> np.ndarray:
    """``ys`` (on equally spaced sizes) made convex and non-decreasing, from
    its first value to its last: its steps fitted non-decreasing
    (``isotonic``, so the total rise is kept), the curve then floored at its
    first value.  A step that jumps and falls back (one noisy point) is
    spread over the steps it pools with; a curve already convex and rising
    is kept as it is."""
    ys = np.asarray(ys, dtype=np.float64)
    if ys.size < 3:
        return np.maximum.accumulate(ys)
    return _convex_rise(ys)


@numba.njit(cache=True)
def _convex_rise(ys):
    n = ys.size - 1
    mean = np.empty(n)
    count = np.empty(n, dtype=np.int64)
    top = 0
    for i in range(n):  # pool adjacent violators over the steps
        mean[top], count[top] = ys[i + 1] - ys[i], 1
        top += 1
        while top > 1 and mean[top - 2] > mean[top - 1]:
            c = count[top - 2] + count[top - 1]
            mean[top - 2] = (mean[top - 2] * count[top - 2] + mean[top - 1] * count[top - 1]) / c
            count[top - 2] = c
            top -= 1
    out = np.empty(n + 1)
    out[0] = ys[0]
    at = 0
    for b in range(top):  # the steps rise: a dip comes first, and is floored at the start
        for _ in range(count[b]):
            out[at + 1] = out[at] + mean[b]
            at += 1
    for i in range(1, n + 1):
        out[i] = max(out[i], ys[0])
    return out


@dataclass
class StepProfile:
    tokens: np.ndarray      # token sizes of the target and first-pass curves
    target_s: np.ndarray    # seconds of a K_step = 0 step, per token size
    first_s: np.ndarray     # what K_step >= 1 adds at that size (0: a lookup proposer)
    batch: np.ndarray       # request counts of the draft-pass curve
    pass_s: np.ndarray      # one further draft position over that many requests
    # The zero-cost fallback's catch-up: seconds per number of caught-up
    # tokens (None: priced as the first pass over those tokens).
    catchup_tokens: np.ndarray | None = None
    catchup_s: np.ndarray | None = None
    # Captured sizes (CUDA graphs): a step of T tokens runs padded to the next one.
    pad_sizes: np.ndarray | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("tokens", "target_s", "first_s", "batch", "pass_s"):
            setattr(self, name, np.asarray(getattr(self, name), dtype=np.float64))
        if self.tokens.size < 1 or self.batch.size < 1:
            raise ValueError("a step-cost profile needs at least one size per curve")
        if self.tokens.size != self.target_s.size or self.tokens.size != self.first_s.size:
            raise ValueError("tokens, target_s and first_s must have the same length")
        if self.batch.size != self.pass_s.size:
            raise ValueError("batch and pass_s must have the same length")
        if np.any(np.diff(self.tokens) <= 0) or np.any(np.diff(self.batch) <= 0):
            raise ValueError("profile sizes must be strictly increasing")
        if not (np.all(np.isfinite(self.target_s)) and np.all(self.target_s > 0)):
            raise ValueError("target_s must be positive and finite")
        self.first_s = np.maximum(self.first_s, 0.0)
        self.pass_s = np.maximum(self.pass_s, 0.0)
        if self.pad_sizes is not None:
            self.pad_sizes = np.asarray(sorted(self.pad_sizes), dtype=np.float64)
        # Python lists for the scalar lookups (see _interp).
        self._lists = tuple(a.tolist() for a in (self.tokens, self.target_s, self.first_s,
                                                 self.batch, self.pass_s))
        self._pads = None if self.pad_sizes is None else self.pad_sizes.tolist()
        if (self.catchup_tokens is None) != (self.catchup_s is None):
            raise ValueError("catchup_tokens and catchup_s come together")
        if self.catchup_tokens is not None:
            self.catchup_tokens = np.asarray(self.catchup_tokens, dtype=np.float64)
            self.catchup_s = np.maximum(np.asarray(self.catchup_s, dtype=np.float64), 0.0)
            if self.catchup_tokens.size != self.catchup_s.size or self.catchup_tokens.size < 1:
                raise ValueError("catchup_tokens and catchup_s must have the same length")
            order = np.argsort(self.catchup_tokens)
            self._catchup = (self.catchup_tokens[order].tolist(), self.catchup_s[order].tolist())
        # Past its largest size the first pass grows at least as the catch-up
        # does per token: both are the draft's forward over tokens it has not
        # seen (a prompt chunk, skipped tokens), but the first pass is timed
        # at decoding sizes (up to a few dozen tokens, where a pass's fixed
        # cost hides its slope) and the catch-up over hundreds.  Extended
        # with its own slope, the Qwen pair's first pass priced a 480-token
        # prompt chunk at 0.27 s of draft work; served it cost 1.1 s, and
        # the catch-up curve says 1.0 s.
        self._first_tail = 0.0
        if self.catchup_tokens is not None and len(self._catchup[0]) > 1:
            (*_, x0, x1), (*_, y0, y1) = self._catchup
            self._first_tail = max((y1 - y0) / (x1 - x0), 0.0)

    # -- pricing -------------------------------------------------------------
    def _pad(self, x):
        if self.pad_sizes is None or self.pad_sizes.size == 0:
            return x
        idx = np.searchsorted(self.pad_sizes, x)
        padded = self.pad_sizes[np.minimum(idx, self.pad_sizes.size - 1)]
        # Past the largest captured size vLLM runs eagerly, unpadded.
        return np.where(idx < self.pad_sizes.size, padded, x)

    def _pad1(self, x: float) -> float:
        pads = self._pads
        if not pads or x > pads[-1]:
            return x  # past the largest captured size vLLM runs eagerly, unpadded
        return pads[bisect.bisect_left(pads, x)]

    def target(self, tokens: float) -> float:
        return _interp(self._pad1(float(tokens)), self._lists[0], self._lists[1])

    def first(self, tokens: float) -> float:
        if tokens <= 0:
            return 0.0
        return _interp(self._pad1(float(tokens)), self._lists[0], self._lists[2],
                       self._first_tail)

    def verify_and_first(self, tokens: np.ndarray) -> np.ndarray:
        """``target + first`` at each of ``tokens`` (an array): a drafting step before its
        further passes."""
        # Each curve on its own: past the last size each keeps its own
        # (non-negative) slope, the first pass at least the catch-up's, as
        # target() and first() do.
        t = self._pad(np.asarray(tokens, dtype=np.float64))
        return (_interp_many(t, self.tokens, self.target_s)
                + np.where(t > 0, _interp_many(t, self.tokens, self.first_s,
                                               self._first_tail), 0.0))

    def draft_pass(self, batch: float) -> float:
        return _interp(self._pad1(float(batch)), self._lists[3], self._lists[4])

    def catchup(self, tokens: float) -> float:
        """A draft catch-up over ``tokens`` skipped tokens."""
        if tokens <= 0:
            return 0.0
        if self.catchup_tokens is None:
            return self.first(tokens)
        xs, ys = self._catchup
        if len(xs) == 1:
            return ys[0] * tokens / max(xs[0], 1.0)
        return max(_interp(float(tokens), xs, ys), 0.0)

    def draft(self, tokens: float, batch: float, k_step: int) -> float:
        """What drafting ``k_step`` positions adds to a step of ``tokens``."""
        if k_step <= 0:
            return 0.0
        return self.first(tokens) + (k_step - 1) * self.draft_pass(batch)

    def step(self, tokens: float, batch: float, k_step: int, catchup_tokens: float = 0.0) -> float:
        return (self.target(tokens) + self.draft(tokens, batch, k_step)
                + self.catchup(catchup_tokens))

    def monotone(self) -> "StepProfile":
        """This profile with its draft-pass and catch-up curves non-decreasing
        in their size (``isotonic``); the token curves are kept as measured.

        A draft pass over more requests, or a catch-up over more tokens,
        should not cost less: where the medians say so (noise), the fit
        averages the two.  The target and first-pass curves are not fitted
        across sizes: their points come from different batch sizes, and a
        smaller shape can be truly slower (a 1-token step measured slower
        than a 4-token one); pooling it would raise the larger batch's plain
        price.  A plan reads them from its own step's size up, where
        ``GoodputPolicy.prices`` makes them non-decreasing.
        """
        catchup = (None, None) if self.catchup_tokens is None else (
            self._catchup[0], isotonic(self._catchup[1]))
        return StepProfile(self.tokens, self.target_s, self.first_s,
                           self.batch, isotonic(self.pass_s), *catchup,
                           pad_sizes=self.pad_sizes, meta=dict(self.meta))

    @property
    def skips_draft_at_k0(self) -> bool:
        """``first`` is the draft's pass that a K_step = 0 step skips (zero-cost fallback).

        Otherwise it is what drafting adds to a step that runs the draft anyway.
        """
        return bool(self.meta.get("zero_cost_fallback"))

    def with_first_pass_at_k0(self) -> "StepProfile":
        """This profile where the draft's first pass runs at K_step = 0 too (no skipping)."""
        meta = dict(self.meta, zero_cost_fallback=False)
        return StepProfile(self.tokens, self.target_s + self.first_s, np.zeros_like(self.first_s),
                           self.batch, self.pass_s, pad_sizes=self.pad_sizes, meta=meta)

    # -- storage -------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens.tolist(), "target_s": self.target_s.tolist(),
            "first_s": self.first_s.tolist(), "batch": self.batch.tolist(),
            "pass_s": self.pass_s.tolist(),
            "catchup_tokens": None if self.catchup_tokens is None else self.catchup_tokens.tolist(),
            "catchup_s": None if self.catchup_s is None else self.catchup_s.tolist(),
            "pad_sizes": None if self.pad_sizes is None else self.pad_sizes.tolist(),
            # What this start timed (``start_check``) is not the next start's.
            "meta": {k: v for k, v in self.meta.items() if k != "start_check"},
        }

    @classmethod
    def from_dict(cls, d: dict) -> "StepProfile":
        missing = [k for k in ("tokens", "target_s", "first_s", "batch", "pass_s") if k not in d]
        if missing:
            raise ValueError(f"step-cost profile lacks {', '.join(missing)}")
        return cls(d["tokens"], d["target_s"], d["first_s"], d["batch"], d["pass_s"],
                   d.get("catchup_tokens"), d.get("catchup_s"), d.get("pad_sizes"),
                   dict(d.get("meta") or {}))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "StepProfile":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def table(self) -> str:
        """The profile as a Markdown table (milliseconds)."""
        lines = ["| tokens in step | target step (ms) | draft first pass (ms) |",
                 "|---:|---:|---:|"]
        for t, a, b in zip(self.tokens, self.target_s, self.first_s):
            lines.append(f"| {int(t)} | {a * 1e3:.2f} | {b * 1e3:.2f} |")
        lines += ["", "| requests | one more draft position (ms) |", "|---:|---:|"]
        for b, p in zip(self.batch, self.pass_s):
            lines.append(f"| {int(b)} | {p * 1e3:.2f} |")
        if self.catchup_tokens is not None:
            lines += ["", "| caught-up tokens | catch-up (ms) |", "|---:|---:|"]
            for c, t in zip(*self._catchup):
                lines.append(f"| {int(c)} | {t * 1e3:.2f} |")
        return "\n".join(lines)


# The draft's share of the target's parameters when it cannot be counted
# (a controller built without a profile, a config without sizes): about the
# Qwen2.5-Coder 0.5B draft's share of its 1.5B target.
# Source: the parameter share; constants_sweep.py at d7f86db (profile: off).
UNKNOWN_DRAFT_RATIO = 0.3


# The prior profile's prices, in plain steps of one request: a token more in
# a step on a CPU (compute-bound almost at once) and on a GPU (memory-bound
# small steps); a draft pass as this share of the draft's parameter share;
# a lookup proposer's host work per request.
# Source: SIMULATOR.md "CPU calibration" (CPU); the GPU's x0.5 / x2 variants decide
# alike (no measured GPU value); d7f86db (draft factor 0.5 -> 1.0: the Qwen pair's
# profiles); the SmolLM2 + n-gram profiles (lookup pass 0.003-0.0055 of a plain step).
PRIOR_TOKEN_COST_CPU = 0.25
PRIOR_TOKEN_COST_GPU = 0.02
PRIOR_DRAFT_FACTOR = 1.0
PRIOR_LOOKUP_PASS = 0.005


def prior_profile(platform: str, draft_size_ratio: float | None, max_tokens: int,
                  max_batch: int, draft_runs_at_k0: bool = False) -> StepProfile:
    """A profile from parameter counts alone, for ``profile: off``.

    Only relative costs matter to the policy (it compares rates), so the unit
    is one plain decode step of one request.  On a CPU the forward pass is
    compute-bound almost at once (verifying 4 drafts cost about 2x a plain
    step here); on a GPU small steps are memory-bound and extra tokens are
    nearly free.  A draft model's passes cost its share of the parameters;
    ``draft_size_ratio=None`` is a lookup proposer (n-gram), whose work is on
    the host and nearly free.  ``draft_runs_at_k0``: vLLM runs the draft's
    first pass at K_step = 0 too, so it belongs to the K_step = 0 step.
    """
    per_token = PRIOR_TOKEN_COST_CPU if platform == "cpu" else PRIOR_TOKEN_COST_GPU
    tokens = np.unique(np.geomspace(1, max(max_tokens, 2), 8).round())
    batch = np.unique(np.geomspace(1, max(max_batch, 2), 6).round())
    target = 1.0 + per_token * (tokens - 1)
    if draft_size_ratio is None:
        first = np.zeros_like(tokens)
        passes = PRIOR_LOOKUP_PASS * batch
    else:
        ratio = PRIOR_DRAFT_FACTOR * min(max(draft_size_ratio, 0.02), 1.0)
        first = ratio * target
        passes = ratio * (1.0 + per_token * (batch - 1))
        if draft_runs_at_k0:
            target, first = target + first, np.zeros_like(tokens)
    skips = draft_size_ratio is not None and not draft_runs_at_k0
    return StepProfile(tokens, target, first, batch, passes,
                       meta={"source": "prior", "platform": platform, "zero_cost_fallback": skips})
