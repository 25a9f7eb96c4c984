"""Workloads: where requests come from and how their drafts get accepted.

A scenario is a request source (prompt and output lengths) plus an
acceptance process.  The process holds one row of state per engine slot and
answers two questions for the decoding requests of a step: the *true*
survival curve (what the oracle is allowed to know) and a draw of how many of
``k`` drafts were accepted (what the policies get to observe).

Difficulty is a property of the text, so drift and switches happen along a
request's output tokens, not along engine steps: every policy meets the same
easy and hard stretches of the i-th request, however fast it moves.

Parametric processes, built from the setup's ``easy``/``hard`` levels
(conditional acceptance of draft position 1; position ``p`` decays by
``decay ** (p - 1)``):

- ``easy``, ``hard``: every request near one level (per-request spread 0.05).
- ``mixed``: half the requests easy, half hard, fixed for their lifetime.
- ``drift``: each request's level moves smoothly between hard and easy
  along its text (sinusoid, period 400 tokens, random phase).
- ``switch``: each request flips between its easy and hard level at random
  points of its text (segments of 100 tokens on average, geometric).
- ``trace:PATH``: replay a recorded JSONL trace (see ``trace.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from vllm_specplug.tools.sim.cost import Setup
from vllm_specplug.tools.sim.trace import Trace, read_trace

PARAMETRIC = ("easy", "hard", "mixed", "drift", "switch")
DRIFT_PERIOD = 400.0  # tokens
SWITCH_MEAN = 100.0  # tokens per regime segment, on average
MAX_SWITCHES = 64


@dataclass
class RequestSpec:
    prompt: int
    output: int  # tokens to generate
    generated: int = 0  # already generated (warm start): prefill done
    klass: str = ""  # "easy"/"hard" for sources that fix it per request
    trace_index: int = -1


class LengthSource:
    """Lognormal prompt/output lengths around the setup's medians.  The
    first ``warm`` requests start mid-flight (a random fraction of their
    output already generated, prefill done) so the engine starts near steady
    state instead of with every request prefilling at once."""

    def __init__(self, setup: Setup, rng: np.random.Generator, warm: int = 0) -> None:
        self.w = setup.workload
        self.rng = rng
        self.warm = warm

    def next(self) -> RequestSpec | None:
        w, rng = self.w, self.rng
        z = rng.standard_normal(2)
        u = float(rng.random())
        prompt = int(np.clip(round(w.prompt_median * np.exp(w.sigma * z[0])), 8, w.prompt_max))
        if self.warm > 0:
            # The stationary state of a closed loop: a slot is found in the
            # middle of a request picked in proportion to its length
            # (lognormal -> median times exp(sigma^2)), at a uniform point.
            self.warm -= 1
            total = int(np.clip(round(w.output_median * np.exp(w.sigma ** 2 + w.sigma * z[1])),
                                4, w.output_max))
            done = min(int(u * total), total - 1)
            return RequestSpec(prompt, total - done, generated=done)
        total = int(np.clip(round(w.output_median * np.exp(w.sigma * z[1])), 4, w.output_max))
        return RequestSpec(prompt, total)


class ListSource:
    """A finite list of requests, in order (then the workload is over)."""

    def __init__(self, specs: list[RequestSpec]) -> None:
        self.specs = list(specs)
        self.i = 0

    def next(self) -> RequestSpec | None:
        if self.i >= len(self.specs):
            return None
        self.i += 1
        return self.specs[self.i - 1]


class TraceSource:
    """Trace requests in order, cycling; lengths from the trace when it
    has them, else from the setup's distributions."""

    def __init__(self, trace: Trace, setup: Setup, rng: np.random.Generator, warm: int) -> None:
        self.trace = trace
        self.lengths = LengthSource(setup, rng, warm)
        self.i = 0

    def next(self) -> RequestSpec | None:
        tr = self.trace.requests[self.i % len(self.trace.requests)]
        spec = self.lengths.next()
        if tr.prompt_tokens is not None:
            spec.prompt = tr.prompt_tokens
        if tr.output_tokens is not None:
            spec.output = tr.output_tokens
            spec.generated = tr.generated
        elif spec.generated:
            spec.generated = 0  # unknown lifetime: start fresh
        spec.trace_index = self.i % len(self.trace.requests)
        self.i += 1
        return spec


class ParametricAcceptance:
    """Per-request levels and switch points are drawn once per admitted
    request from their own stream, so every policy sees the same i-th
    request; acceptance draws come from another stream."""

    def __init__(self, kind: str, setup: Setup, capacity: int, rng) -> None:
        if kind not in PARAMETRIC:
            raise ValueError(f"unknown scenario {kind!r}")
        self.kind = kind
        self.acc = setup.acceptance
        self.width = setup.max_k
        self.rng_req = rng("request-levels")
        self.rng = rng("acceptance-draws")
        self.decay = self.acc.decay ** np.arange(self.width)
        self.easy = np.zeros(capacity)
        self.hard = np.zeros(capacity)
        self.regime = np.zeros(capacity)  # 1.0 = easy, 0.0 = hard; drift: phase
        self.pos = np.zeros(capacity)  # output tokens generated so far
        self.switches = np.full((capacity, MAX_SWITCHES), np.inf)

    def start(self, slot: int, spec: RequestSpec) -> None:
        z = self.rng_req.standard_normal(2)
        u = float(self.rng_req.random())
        seg = self.rng_req.geometric(1.0 / SWITCH_MEAN, MAX_SWITCHES)
        lo, hi = 0.01, 0.99
        self.easy[slot] = np.clip(self.acc.easy + self.acc.spread * z[0], lo, hi)
        self.hard[slot] = np.clip(self.acc.hard + self.acc.spread * z[1], lo, hi)
        self.pos[slot] = spec.generated
        self.switches[slot] = np.inf
        k = self.kind
        if spec.klass:
            self.regime[slot] = 1.0 if spec.klass == "easy" else 0.0
        elif k == "easy":
            self.regime[slot] = 1.0
        elif k == "hard":
            self.regime[slot] = 0.0
        elif k in ("mixed", "switch"):
            self.regime[slot] = float(u < 0.5)
            if k == "switch":
                self.switches[slot] = np.cumsum(seg)
        else:  # drift: a phase
            self.regime[slot] = u

    def advance(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        self.pos[slots] += tokens

    def level(self, slots: np.ndarray) -> np.ndarray:
        if self.kind == "drift":
            w = 0.5 + 0.5 * np.sin(2 * np.pi * (self.pos[slots] / DRIFT_PERIOD
                                                + self.regime[slots]))
        elif self.kind == "switch":
            flips = (self.switches[slots] <= self.pos[slots, None]).sum(axis=1)
            w = np.abs(self.regime[slots] - (flips % 2))
        else:
            w = self.regime[slots]
        return self.hard[slots] + w * (self.easy[slots] - self.hard[slots])

    def conditional(self, slots: np.ndarray) -> np.ndarray:
        return np.clip(self.level(slots)[:, None] * self.decay[None, :], 0.0, 1.0)

    def survival(self, slots: np.ndarray) -> np.ndarray:
        return np.cumprod(self.conditional(slots), axis=1)

    def draw(self, slots: np.ndarray, k: np.ndarray) -> np.ndarray:
        if not len(slots):
            return np.zeros(0, dtype=np.int64)
        u = self.rng.random((len(slots), self.width))
        ok = np.cumprod(u < self.conditional(slots), axis=1)
        return (ok * (np.arange(self.width)[None, :] < k[:, None])).sum(axis=1).astype(np.int64)


class TraceAcceptance:
    """Replays run lengths of agreeing drafts from a trace (see trace.py)."""

    def __init__(self, trace: Trace, setup: Setup, capacity: int, rng) -> None:
        self.trace = trace
        self.width = setup.max_k
        self.rng = rng("acceptance-draws")
        self.req = np.full(capacity, -1, dtype=np.int64)
        self.pos = np.zeros(capacity, dtype=np.int64)
        known = [r.alpha() for r in trace.requests if r.records]
        fallback = float(np.mean(known)) if known else 0.5
        self.alphas = np.array([r.alpha() if r.records else fallback for r in trace.requests])

    def start(self, slot: int, spec: RequestSpec) -> None:
        self.req[slot] = spec.trace_index
        self.pos[slot] = 0

    def advance(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        pass

    def survival(self, slots: np.ndarray) -> np.ndarray:
        a = self.alphas[self.req[slots]]
        return a[:, None] ** np.arange(1, self.width + 1)[None, :]

    def draw(self, slots: np.ndarray, k: np.ndarray) -> np.ndarray:
        out = np.zeros(len(slots), dtype=np.int64)
        for i, (s, kk) in enumerate(zip(slots.tolist(), k.tolist())):
            if kk <= 0:
                continue
            tr = self.trace.requests[self.req[s]]
            if tr.records:
                d, a = tr.records[self.pos[s] % len(tr.records)]
            else:  # no acceptance recorded for this request: geometric
                d, a = 0, 0
            self.pos[s] += 1
            run = a
            if a >= d:  # censored: at least d
                alpha = self.alphas[self.req[s]]
                while run < kk and self.rng.random() < alpha:
                    run += 1
            out[i] = min(kk, run)
        return out


@dataclass(frozen=True)
class Scenario:
    name: str
    trace_path: str | None = None

    @property
    def is_trace(self) -> bool:
        return self.trace_path is not None

    def make(self, setup: Setup, capacity: int, rng, warm: int, source=None):
        """(request source, acceptance process) for one run; ``rng(purpose)``
        returns an independent generator per purpose."""
        if self.is_trace:
            trace = _load(self.trace_path)
            src = source or TraceSource(trace, setup, rng("lengths"), warm)
            return src, TraceAcceptance(trace, setup, capacity, rng)
        src = source or LengthSource(setup, rng("lengths"), warm)
        return src, ParametricAcceptance(self.name, setup, capacity, rng)


_TRACES: dict[tuple, Trace] = {}


def _load(path: str) -> Trace:
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_mtime_ns, st.st_size)
    if key not in _TRACES:
        _TRACES[key] = read_trace(path)
    return _TRACES[key]


def make_scenario(name: str) -> Scenario:
    if name.startswith("trace:"):
        path = name[len("trace:"):]
        if not path:
            raise ValueError("trace scenario needs a path: trace:PATH")
        return Scenario(name, path)
    if name not in PARAMETRIC:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(PARAMETRIC)}, trace:PATH")
    return Scenario(name)
