"""Step-cost model: named setups and the seconds of a step.

The named devices and model shapes, and the assumptions beside them, are in
``devices.py``; analysis over this model (batch tables, crossover) in
``analysis.py``.

**Measured pricing** (``h200``, the default GPU): each forward pass is priced
from passes measured on one H200 (``measured.py``, ``data/README.md``), plus
the named assumptions below for what that table does not hold (host time,
all-reduce between TP ranks, the controller's decision).

**Roofline pricing** (``h200-roofline``, ``h100``: devices without a measured
table, and the CPU profile with fitted constants).  One forward pass of a
model over ``T`` tokens costs

    t_pass = max(bytes / (tp * bandwidth * eff_bw), flops / (tp * peak * eff_flops))
             + pass overhead + layers * layer overhead + all-reduces (tp > 1)

with ``bytes`` = the weights read once per pass (every layer and the LM head;
the input embedding is a gather of ``T`` rows, negligible) + the KV cache read
by attention (each request's whole context, once per pass, however many query
tokens it has) + the KV written for the new tokens, and ``flops`` = 2 per
weight per token + 4 per (query token, context token) pair per attention
layer.  Efficiencies and overheads are stated assumptions, not vendor figures
(see ``benchmarks/SIMULATOR.md``).  Against the measured H200 passes this is
optimistic: the 8B target's measured passes take 1.45x it (median), the 70B
TP=2 rank 1.27x, the 1B draft 3.4x, the EAGLE-3 layer 1.20x.

A speculative step is the target's verification pass over every scheduled
token (1 + k_r per decoding request, plus prefill chunks) and the proposer's
``K_step`` passes: with ``draft_model`` (and EAGLE) the first pass runs over
the same scheduled tokens, the other ``K_step - 1`` over one token per
decoding request.  ``draft_at_k0`` says whether the first pass also runs when
``K_step == 0`` (vLLM today: yes, to keep the draft's KV cache in sync) or is
skipped (the "zero-cost fallback" variant).  Plain decoding (no speculative
config at all) never runs the draft.

On a GPU every pass runs as a CUDA graph padded to the next of vLLM's
default capture sizes (``vllm_capture_sizes``): the weight GEMMs compute the
padded rows, so step times are step functions of the token count up to the
largest captured size (512); past it a pass runs unpadded.

Nothing here imports vLLM or the controller.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from vllm_specplug.tools.sim import measured
from vllm_specplug.tools.sim.devices import DEVICES, MODELS, Device, ModelShape


@dataclass(frozen=True)
class Acceptance:
    """Per-setup acceptance levels the scenarios are built from.

    ``easy``/``hard``: conditional acceptance of the first draft position for
    an agreeing / a disagreeing workload; position ``p`` is accepted (given
    ``p - 1`` was) with ``alpha * decay ** (p - 1)``.
    """

    easy: float
    hard: float
    decay: float = 1.0
    spread: float = 0.05  # per-request standard deviation around the level


@dataclass(frozen=True)
class Workload:
    prompt_median: float = 512
    output_median: float = 256
    sigma: float = 0.0  # lognormal shape of both lengths (0: fixed, like `vllm bench` random)
    prompt_max: int = 4096
    output_max: int = 2048
    max_batched_tokens: int = 8192  # chunked-prefill budget per step


@dataclass(frozen=True)
class Setup:
    key: str
    device: Device
    target: ModelShape
    draft: ModelShape
    method: str
    tp: int
    acceptance: Acceptance
    workload: Workload = field(default_factory=Workload)
    max_k: int = 8
    draft_at_k0: bool = True  # vLLM today; False = zero-cost fallback
    noise: float = 0.05  # lognormal sigma of measured step times
    max_concurrency: int = 512  # max_num_seqs of the simulated engine

    def capture_sizes(self, speculative: bool = True) -> tuple[int, ...] | None:
        """vLLM's default CUDA-graph capture sizes for this engine (None: eager)."""
        if not self.device.cuda_graphs:
            return None
        return vllm_capture_sizes(1 + self.max_k if speculative else 1, self.max_concurrency,
                                  self.workload.max_batched_tokens)

    @property
    def label(self) -> str:
        fb = "today" if self.draft_at_k0 else "zero-cost fallback"
        tp = f" TP={self.tp}" if self.tp > 1 else ""
        return (f"{self.target.name} + {self.draft.name} ({self.method}) on "
                f"{self.device.name}{tp}, K=0 {fb}")

    def draft_size_ratio(self) -> float:
        return self.draft.scheduler_size_estimate() / self.target.scheduler_size_estimate()

    def cost(self) -> "StepCost":
        return StepCost(self)

    def kv_capacity_tokens(self) -> float:
        free = self.tp * self.device.memory_bytes * 0.9 - self.target.weight_bytes \
            - self.draft.weight_bytes
        per_tok = self.target.kv_bytes_per_token + self.draft.kv_bytes_per_token
        return max(free, 0.0) / per_tok


def vllm_capture_sizes(query_len: int, max_num_seqs: int, max_batched_tokens: int,
                       limit: int = 512) -> tuple[int, ...]:
    """``VllmConfig._set_cudagraph_sizes`` with nothing configured (vLLM 0.32).

    1, 2, 4, multiples of 8 below 256 and multiples of 16 from 256 up to the
    largest size, ``min(512, max_num_seqs * query_len * 2)``; with
    speculative decoding (``query_len = 1 + num_speculative_tokens``) also
    every uniform decode size ``n * query_len`` for request counts ``n`` on
    the same grid, within that largest size.
    """
    top = min(limit, max_num_seqs * query_len * 2, max_batched_tokens)

    def grid(hi: int) -> list[int]:
        return [n for n in (1, 2, 4) if n <= hi] + list(range(8, min(hi + 1, 256), 8)) \
            + list(range(256, hi + 1, 16))

    sizes = set(grid(top))
    if query_len > 1:
        reqs = min(max_num_seqs, limit)
        sizes |= {n * query_len for n in set(grid(reqs)) | {reqs} if n * query_len <= top}
    elif max_num_seqs <= top:
        sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


def default_tp(device: Device, target: ModelShape) -> int:
    """Smallest power-of-two TP whose weights take at most 60% of the memory."""
    if device.platform == "cpu":
        return 1
    tp = 1
    while target.params * target.bytes_per_param > 0.6 * tp * device.memory_bytes and tp < 8:
        tp *= 2
    return tp


SETUP_KEYS = ("70b-1b", "8b-eagle", "cpu-qwen")


def make_setup(key: str, gpu: str = "h200", draft_at_k0: bool = True,
               tp: int | None = None, noise: float | None = None) -> Setup:
    if key == "70b-1b":
        dev = DEVICES[gpu]
        target = MODELS["llama-3-70b"]
        s = Setup(key, dev, target, MODELS["llama-3.2-1b"], "draft_model",
                  tp or default_tp(dev, target), Acceptance(easy=0.80, hard=0.35))
    elif key == "8b-eagle":
        dev = DEVICES[gpu]
        target = MODELS["llama-3.1-8b"]
        s = Setup(key, dev, target, MODELS["eagle3-llama-3.1-8b"], "eagle3",
                  tp or default_tp(dev, target),
                  Acceptance(easy=0.85, hard=0.45, decay=0.97))
    elif key == "cpu-qwen":
        # The demo pair on this machine.  Acceptance from shared/models.md:
        # code prompt 100% draft agreement (0.95 used: three prompts, not
        # one), prose 72.5%.
        s = Setup(key, DEVICES["cpu"], MODELS["qwen2.5-1.5b"], MODELS["qwen2.5-0.5b"],
                  "draft_model", 1, Acceptance(easy=0.95, hard=0.725), noise=0.10,
                  workload=Workload(prompt_median=64, output_median=128, prompt_max=512,
                                    output_max=512, max_batched_tokens=2048),
                  max_concurrency=16)
    else:
        raise ValueError(f"unknown setup {key!r}; known: {', '.join(SETUP_KEYS)}")
    s = replace(s, draft_at_k0=draft_at_k0)
    if noise is not None:
        s = replace(s, noise=noise)
    return s


def measured_table(device: Device, model: ModelShape, tp: int) -> measured.PassTable:
    """The measured rows of ``model`` at tensor-parallel size ``tp`` on ``device``."""
    names = dict(model.measured_as)
    _, tables = measured.load(device.table)
    if tp not in names or names[tp] not in tables:
        raise ValueError(
            f"{device.table} has no passes of {model.name} at TP={tp}; use a roofline device "
            f"(--gpu h200-roofline) for it")
    return tables[names[tp]]


class PassShape(NamedTuple):
    """What a pass runs over, for the measured pricing: ``n_dec`` decoding
    requests with ``dec_ctx`` cached tokens in all, and prefill chunks
    ``chunks`` after ``chunk_ctx`` cached tokens each (None: none)."""

    n_dec: float
    dec_ctx: float
    chunks: np.ndarray | None = None
    chunk_ctx: np.ndarray | None = None


class StepCost:
    """Seconds of one engine step, from what the step does (noise-free).

    Padding follows the engine: a speculative engine captures its uniform
    decode sizes as well as the plain grid (``Setup.capture_sizes``).  The
    pass itself comes from the device's measured table when it has one
    (``measured.py``), from the roofline otherwise; host time per pass and
    the all-reduces are added to either."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.pads = {spec: (None if p is None else np.asarray(p, dtype=np.float64))
                     for spec in (True, False) for p in [setup.capture_sizes(spec)]}
        d = setup.device
        self.bw = setup.tp * d.mem_bandwidth * d.bw_efficiency
        self.fl = setup.tp * d.peak_flops * d.flops_efficiency
        t, q = setup.target, setup.draft
        self.target_fixed = d.step_overhead_s + t.layers * d.layer_overhead_s
        self.draft_fixed = d.pass_overhead_s + q.layers * d.layer_overhead_s
        self.tables = None
        if d.table is not None:
            self.tables = {id(m): measured_table(d, m, setup.tp) for m in (t, q)}

    # -- one pass, vectorised over candidate plans ---------------------------
    def padded(self, tokens, speculative: bool = True):
        """Tokens a pass computes: the next capture size, unpadded past the last."""
        pads = self.pads[speculative]
        if pads is None:
            return tokens
        t = np.asarray(tokens, dtype=np.float64)
        idx = np.searchsorted(pads, t)
        return np.where(idx < pads.size, pads[np.minimum(idx, pads.size - 1)], t)

    def allreduce(self, model: ModelShape, padded):
        """Two all-reduces per layer between TP ranks (assumed, see ALLREDUCE_*)."""
        if self.setup.tp <= 1:
            return 0.0
        d = self.setup.device
        n = self.setup.tp
        size = np.asarray(padded, dtype=np.float64) * model.hidden * model.bytes_per_param
        one = d.allreduce_s + size * 2.0 * (n - 1) / n / d.allreduce_bytes_per_s
        return 2.0 * model.layers * one

    def _pass(self, model: ModelShape, fixed: float, tokens, kv_read_tokens, pairs,
              speculative: bool, shape: PassShape | None = None):
        padded = self.padded(tokens, speculative)
        extra = fixed + self.allreduce(model, padded)
        if self.tables is not None:
            if shape is None:  # one token per request
                shape = PassShape(float(tokens), float(kv_read_tokens))
            return self.tables[id(model)].pass_seconds(
                tokens, padded, shape.n_dec, shape.dec_ctx, shape.chunks, shape.chunk_ctx) + extra
        bytes_ = (model.weight_bytes + (np.asarray(kv_read_tokens) + tokens)
                  * model.kv_bytes_per_token)
        flops = np.asarray(padded) * model.flops_per_token \
            + np.asarray(pairs) * model.attn_flops_per_pair
        return np.maximum(bytes_ / self.bw, flops / self.fl) + extra

    def target_pass(self, tokens, kv_read_tokens, pairs, speculative: bool = True,
                    shape: PassShape | None = None):
        return self._pass(self.setup.target, self.target_fixed, tokens, kv_read_tokens, pairs,
                          speculative, shape)

    def draft_pass(self, tokens, kv_read_tokens, pairs, shape: PassShape | None = None):
        """A draft pass; without ``shape``, ``tokens`` requests of one token each."""
        return self._pass(self.setup.draft, self.draft_fixed, tokens, kv_read_tokens, pairs,
                          True, shape)

    def draft_time(self, k_step, tokens, n_decode, kv_read_tokens, pairs, ctx_decode,
                   shape: PassShape | None = None):
        """The proposer's work for a step with ``K_step`` draft positions.

        First pass over the step's scheduled tokens (``shape``; skipped at
        K_step=0 in the zero-cost variant), then ``K_step - 1`` passes over
        one token per decoding request.
        """
        k_step = np.asarray(k_step)
        first = self.draft_pass(tokens, kv_read_tokens, pairs, shape)
        if not self.setup.draft_at_k0:
            first = np.where(k_step > 0, first, 0.0)
        more = np.maximum(k_step - 1, 0)
        if n_decode > 0:
            later = self.draft_pass(n_decode, ctx_decode, ctx_decode)
        else:
            later = 0.0
        return first + more * later

    # -- a whole step -------------------------------------------------------
    def step(self, ctx_decode: np.ndarray, k: np.ndarray, k_step: int,
             prefill_ctx: np.ndarray | None = None, prefill_chunk: np.ndarray | None = None,
             speculative: bool = True, draft_batch: int | None = None,
             draft_ctx: float | None = None) -> float:
        """One step: decoding requests with contexts ``ctx_decode`` verify
        ``k`` drafts each; prefill chunks ``prefill_chunk`` after
        ``prefill_ctx`` tokens already cached; the proposer then runs
        ``k_step`` draft positions for ``draft_batch`` requests (default:
        the decoding ones) whose contexts sum to ``draft_ctx``.
        ``speculative=False`` is plain decoding (no speculative config: no
        draft work at all)."""
        n_dec = len(ctx_decode) if draft_batch is None else draft_batch
        q = 1 + k
        tokens = float(q.sum())
        ctx_sum = float(ctx_decode.sum())
        pairs = float((q * ctx_decode).sum() + (q * (q + 1) / 2).sum())
        kv = ctx_sum
        if prefill_chunk is not None and len(prefill_chunk):
            tokens += float(prefill_chunk.sum())
            kv += float(prefill_ctx.sum())
            c = prefill_chunk
            pairs += float((c * prefill_ctx + c * (c + 1) / 2).sum())
        has_chunks = prefill_chunk is not None and len(prefill_chunk)
        shape = PassShape(len(ctx_decode), ctx_sum, prefill_chunk if has_chunks else None,
                          prefill_ctx if has_chunks else None)
        t = float(self.target_pass(tokens, kv, pairs, speculative, shape))
        if speculative:
            t += float(self.draft_time(k_step, tokens, n_dec, kv, pairs,
                                       ctx_sum if draft_ctx is None else draft_ctx, shape))
        return t

    # -- analytic helpers (tests, crossover, vLLM's batch table) --------------
    def decode_step(self, batch: int, k: int, ctx: float, speculative: bool = True) -> float:
        c = np.full(batch, float(ctx))
        return self.step(c, np.full(batch, k), k, speculative=speculative)

    def expected_goodput(self, batch: int, k: int, ctx: float, survival: np.ndarray) -> float:
        """Expected output tokens/s of a decode-only step with K=k for all
        requests, ``survival[j]`` = P(drafts 1..j+1 all accepted)."""
        tokens = batch * (1.0 + float(np.sum(survival[:k])))
        return tokens / self.decode_step(batch, k, ctx, speculative=k > 0)
