"""Adaptive speculation with vLLM's Python ``LLM`` class.

    vllm-specplug models fetch qwen-coder-pair     # once
    python examples/offline_llm.py

Qwen2.5-Coder-1.5B drafts with Qwen2.5-Coder-0.5B; ``num_speculative_tokens``
is the ceiling and the plugin picks 0..ceiling per request every step.  The
second request sets its own ceiling (``specplug_max_k``) to 0: plain
decoding for that request only.
"""

import os
import sys

from vllm_specplug.tools.models import is_cached, model_path


def main() -> None:
    missing = [k for k in ("qwen-coder-1.5b", "qwen-coder-0.5b") if not is_cached(k)]
    if missing:
        sys.exit(f"models not in the cache: {', '.join(missing)}\n"
                 "fetch them once with:  vllm-specplug models fetch qwen-coder-pair")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on the CPU build

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(model_path("qwen-coder-1.5b")),
        speculative_config={
            "method": "draft_model",
            "model": str(model_path("qwen-coder-0.5b")),
            "num_speculative_tokens": 4,
        },
        scheduler_cls="vllm_specplug.AdaptiveSpecScheduler",
        additional_config={"specplug": {"policy": "goodput"}},
        per_request_spec_decode_metrics="summary",
        max_model_len=2048,
        enforce_eager=True,
    )
    prompts = ["def fibonacci(n: int) -> int:\n", "Write a haiku about the sea:\n"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=48),
        SamplingParams(temperature=0.0, max_tokens=48, extra_args={"specplug_max_k": 0}),
    ]
    for out in llm.generate(prompts, params):
        m = out.outputs[0].spec_decode_metrics  # per request, vLLM's own
        d = m.to_dict() if m is not None else {"num_draft_tokens": 0,
                                               "num_accepted_draft_tokens": 0}
        print(f"--- {out.prompt!r}\n{out.outputs[0].text}\n"
              f"[drafted {d['num_draft_tokens']}, accepted {d['num_accepted_draft_tokens']}]")


if __name__ == "__main__":  # vLLM spawns processes: keep the guard
    main()
