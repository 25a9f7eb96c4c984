"""What the benchmarks compare: model setups, policies, workloads.

One table of setups (``SETUPS``) for both benchmarks: the in-process one
reads a ``Setup`` as it is; the served one (bench/served.py) reads it
through ``ServedSetup``, with its grid from ``Setup.served``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

PROMPTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"

# vLLM's own batch-size table ("dynamic SD", speculative_config
# num_speculative_tokens_per_batch_size), as an operator would write it for a
# CPU: fewer drafts as the batch grows, at least one.  Inclusive ranges.
VLLM_TABLE = [[1, 1, 4], [2, 3, 3], [4, 7, 2], [8, 256, 1]]


@dataclass(frozen=True)
class Served:
    """A setup's grid in the served benchmark (bench/served.py)."""

    workloads: tuple[str, ...]
    concurrency: tuple[int, ...]
    output_tokens: int
    requests: int  # per run at concurrency 1; waves * c at concurrency c > 1
    rate: float  # requests per second of the Poisson cell (0: none)
    rate_workload: str = "mixed"  # the one workload that gets the Poisson cell
    # The grid's arms; vllm-k6, vllm-k8 and adaptive-history only when asked for (--arms).
    arms: tuple[str, ...] = ("plain", "vllm-k2", "vllm-k4", "vllm-table", "plugin-k2", "adaptive")
    max_prompt_tokens: int = 384
    # For the up-front estimate only (measured costs replace it).
    nominal_tok_s: float = 6.0
    prefill_s_per_token: float = 0.01
    ready_s: float = 60.0


@dataclass(frozen=True)
class Setup:
    name: str
    title: str
    target: str  # a model-cache key, or a path (tiny smoke setup)
    method: str
    draft: str | None = None
    ceiling: int = 8
    static_ks: tuple[int, ...] = (1, 2, 4, 8)
    spec_extra: dict = field(default_factory=dict)
    engine_extra: dict = field(default_factory=dict)
    # Rough output tokens per second at concurrency 1 on the 2-core CPU, for
    # the up-front time estimate only (measured rates replace it).
    nominal_tok_s: float = 3.0
    workloads: tuple[str, ...] = ("code_completion", "code_edit", "prose", "math", "json", "mixed")
    max_tokens: int = 48
    served: Served | None = None  # its grid in the served benchmark


@dataclass(frozen=True)
class ServedSetup:
    """A setup as the served benchmark reads it: the models from its ``Setup``,
    the grid (workloads, loads, arms, estimates) from ``Setup.served``."""

    setup: Setup

    @property
    def max_model_len(self) -> int:
        return self.setup.engine_extra.get("max_model_len", 1024)

    @property
    def dtype(self) -> str | None:
        return self.setup.engine_extra.get("dtype")

    def __getattr__(self, name):
        if name.startswith("__") or name == "setup":
            raise AttributeError(name)
        grid = self.setup.served
        return getattr(grid, name) if hasattr(grid, name) else getattr(self.setup, name)


SETUPS = {
    "qwen": Setup(
        name="qwen",
        title="Qwen2.5-Coder-1.5B + 0.5B draft (draft_model)",
        target="qwen-coder-1.5b",
        method="draft_model",
        draft="qwen-coder-0.5b",
        engine_extra={"max_model_len": 1024},
        nominal_tok_s=2.5,
        served=Served(
            workloads=("humaneval", "sharegpt", "mixed", "json"), concurrency=(1, 4),
            output_tokens=64, requests=3, rate=0.0,
            # vLLM's batch table gives K=4 to one request and K=2 to four: at this
            # grid's loads it is the vllm-k4 and vllm-k2 arms, so it is not run twice.
            arms=("plain", "vllm-k2", "vllm-k4", "adaptive"),
            nominal_tok_s=5.4, prefill_s_per_token=0.005, ready_s=65.0),
    ),
    "smollm-ngram": Setup(
        name="smollm-ngram",
        title="SmolLM2-135M + n-gram prompt lookup",
        target="smollm2-135m",
        method="ngram",
        spec_extra={"prompt_lookup_min": 2, "prompt_lookup_max": 5},
        engine_extra={"max_model_len": 1024},
        nominal_tok_s=25.0,
        max_tokens=64,
        served=Served(
            workloads=("humaneval", "sharegpt", "mixed", "json"), concurrency=(1, 2, 4, 8),
            output_tokens=64, requests=3, rate=1.0,
            nominal_tok_s=26.0, prefill_s_per_token=0.001, ready_s=35.0),
    ),
    # Smoke test only: tiny random-weight models made on the spot.
    "tiny": Setup(
        name="tiny",
        title="tiny successor models (smoke test)",
        target="tiny:copy_target",
        method="draft_model",
        draft="tiny:copy_draft_half",
        ceiling=4,
        static_ks=(1, 2, 4),
        engine_extra={"max_model_len": 512, "dtype": "float32"},
        nominal_tok_s=60.0,
        workloads=("easy", "hard", "mixed"),
        max_tokens=32,
        served=Served(
            workloads=("easy", "hard"), concurrency=(1, 2), output_tokens=16,
            requests=2, rate=0.0, nominal_tok_s=60.0, prefill_s_per_token=0.0, ready_s=30.0),
    ),
}

# The setups the served benchmark runs, by name.
SERVED_SETUPS = {name: ServedSetup(s) for name, s in SETUPS.items() if s.served}

# Policy name -> how the spec engine is configured for it (None: the plain
# engine).  "pin" leaves K_step to vLLM (its batch-size table).
POLICIES = {
    # Plain decoding on its own engine (no speculative config).  These
    # machines are noisy, so the ratios use "k0" as the baseline instead:
    "plain": None,
    # plain decoding on the speculative engine, run interleaved with the
    # other policies: every request's K is 0, so the target decodes one
    # token per step and the draft model never runs (zero-cost fallback; an
    # n-gram proposer proposes nothing).  Reported side by side with the
    # plain engine, so any overhead of the speculative engine itself shows.
    "k0": {"policy": "static", "static_k": 0},
    "static": {"policy": "static"},  # expanded to static-K<k> per setup
    "vllm-table": {"policy": "static", "pin": True, "table": True},
    "heuristic": {"policy": "heuristic"},
    "goodput": {"policy": "goodput"},
    # The adaptive policy with vLLM's draft first pass
    # at K=0 (draft_model only).
    "goodput-no-zcf": {"policy": "goodput", "zero_cost_fallback": False},
}


def policy_names(setup: Setup, wanted: list[str]) -> list[str]:
    names = []
    for p in wanted:
        if p == "static":
            names += [f"static-K{k}" for k in setup.static_ks]
        elif p == "plain":
            names += ["plain", "k0"]
        elif p == "goodput-no-zcf" and setup.method != "draft_model":
            continue
        else:
            names.append(p)
    return names


def policy_overrides(name: str) -> tuple[dict, bool, bool]:
    """(specplug config overrides, pin K_step to vLLM, use vLLM's table)."""
    if name.startswith("static-K"):
        return {"policy": "static", "static_k": int(name[len("static-K"):]),
                "zero_cost_fallback": True}, False, False
    spec = dict(POLICIES[name])
    pin = spec.pop("pin", False)
    table = spec.pop("table", False)
    spec.setdefault("zero_cost_fallback", True)
    spec.setdefault("static_k", None)
    return spec, pin, table


def load_prompts(setup: Setup, workload: str, path: str | None = None):
    """[(prompt, max_tokens)] from a JSON-lines file (``prompt``, ``max_tokens``)."""
    default_max_tokens = setup.max_tokens
    if setup.name == "tiny" and path is None:
        return _tiny_prompts(workload, default_max_tokens)
    file = Path(path) if path else PROMPTS_DIR / f"{workload}.jsonl"
    out = []
    with open(file) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
                prompt = rec["prompt"]
            except (ValueError, KeyError, TypeError) as exc:
                raise SystemExit(f"{file}:{n}: each line must be a JSON object with a "
                                 f"'prompt' field ({exc})")
            if not isinstance(prompt, str) or not prompt:
                raise SystemExit(f"{file}:{n}: 'prompt' must be a non-empty string")
            out.append((prompt, int(rec.get("max_tokens", default_max_tokens))))
    if not out:
        raise SystemExit(f"{file}: no prompts")
    return out


def _tiny_prompts(workload: str, max_tokens: int):
    from vllm_specplug.tools.testing import easy_prompt, hard_prompt

    easy = [(easy_prompt(i), max_tokens) for i in range(6)]
    hard = [(hard_prompt(i), max_tokens) for i in range(6)]
    if workload == "easy":
        return easy
    if workload == "hard":
        return hard
    return [p for pair in zip(easy, hard) for p in pair]
