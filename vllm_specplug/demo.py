"""The main job: plain vs static K vs adaptive K on the Qwen coder pair.

    make demo        # or: python -m vllm_specplug.demo

Runs Qwen2.5-Coder-1.5B (target) with Qwen2.5-Coder-0.5B (draft) from the
offline model cache on an easy workload (code completion: the draft agrees)
and a hard one (open prose: it often does not), one request at a time, with
three settings: plain decoding, vLLM's static K=4, and this plugin's
adaptive K (ceiling 4).  Prints a table of output tokens per second and the
ratio to plain decoding, checks that every greedy output equals plain
decoding, and writes a PNG.  Takes about ten minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

WORKLOADS = {
    "code (easy)": [
        "def quicksort(arr):\n    \"\"\"Sort a list with quicksort.\"\"\"\n",
        "class Stack:\n    \"\"\"A simple LIFO stack backed by a list.\"\"\"\n\n    def __init__(self):\n",
        "def is_prime(n: int) -> bool:\n    \"\"\"Return True if n is a prime number.\"\"\"\n",
    ],
    "prose (hard)": [
        "Write a short, vivid description of a thunderstorm over a mountain village:",
        "Tell a brief story about a lighthouse keeper who finds a strange letter:",
        "Describe the taste of a dish you have never eaten, in poetic language:",
    ],
}
CEILING = 4


def settings(target: str, draft: str) -> dict[str, dict]:
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": CEILING}
    return {
        "plain": {},
        f"static K={CEILING}": {"speculative_config": spec},
        "adaptive (specplug)": {
            "speculative_config": spec,
            "scheduler_cls": "vllm_specplug.AdaptiveSpecScheduler",
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", default="demo-results", help="folder for the table and PNG")
    args = parser.parse_args(argv)

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-%d" % (max(os.cpu_count() or 1, 1) - 1))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm_specplug import models

    missing = [k for k in models.GROUPS["qwen-coder-pair"] if not models.is_cached(k)]
    if missing:
        print(f"models {missing} are not in the cache; fetch them with:\n"
              "  python -m vllm_specplug.models fetch qwen-coder-pair", file=sys.stderr)
        return 1
    target = str(models.model_path("qwen-coder-1.5b"))
    draft = str(models.model_path("qwen-coder-0.5b"))

    from vllm import LLM, SamplingParams

    from vllm_specplug.testing import shutdown_llm

    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results: dict[str, dict[str, float]] = {}
    outputs: dict[str, dict[str, list]] = {}
    configs = settings(target, draft)
    total = len(configs) * len(WORKLOADS)
    done = 0
    t_start = time.time()
    for name, extra in configs.items():
        print(f"[demo] starting engine: {name}", flush=True)
        llm = LLM(model=target, enforce_eager=True, distributed_executor_backend="uni",
                  max_model_len=1024, max_num_seqs=4, seed=0, **extra)
        llm.generate(["def f(x):"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        results[name], outputs[name] = {}, {}
        for workload, prompts in WORKLOADS.items():
            t0 = time.perf_counter()
            tokens, texts = 0, []
            for p in prompts:  # one request at a time: latency-bound serving
                o = llm.generate([p], greedy, use_tqdm=False)[0].outputs[0]
                tokens += len(o.token_ids)
                texts.append(list(o.token_ids))
            results[name][workload] = tokens / (time.perf_counter() - t0)
            outputs[name][workload] = texts
            done += 1
            print(f"[demo] {done}/{total} {name:22s} {workload:14s} "
                  f"{results[name][workload]:6.2f} tok/s  ({time.time() - t_start:.0f}s elapsed)",
                  flush=True)
        shutdown_llm(llm)
        del llm
        gc.collect()

    mismatches = [(n, w) for n in outputs for w in outputs[n]
                  if outputs[n][w] != outputs["plain"][w]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["| setting | " + " | ".join(f"{w} tok/s (x plain)" for w in WORKLOADS) + " |",
             "|---|" + "---|" * len(WORKLOADS)]
    for name in results:
        cells = [f"{results[name][w]:.2f} ({results[name][w] / results['plain'][w]:.2f}x)"
                 for w in WORKLOADS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print("\n" + table + "\n")
    print("greedy outputs identical to plain decoding:",
          "yes" if not mismatches else f"NO, mismatches in {mismatches}")
    (out / "demo.md").write_text(table + "\n")
    (out / "demo.json").write_text(json.dumps(results, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / len(results)
        for i, name in enumerate(results):
            xs = [j + i * width for j in range(len(WORKLOADS))]
            ax.bar(xs, [results[name][w] / results["plain"][w] for w in WORKLOADS],
                   width, label=name)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(WORKLOADS))])
        ax.set_xticklabels(list(WORKLOADS))
        ax.set_ylabel("throughput / plain decoding")
        ax.set_title("Qwen2.5-Coder 1.5B + 0.5B draft, one request at a time (CPU)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "demo.png", dpi=120)
        print(f"plot: {out / 'demo.png'}")
    except ImportError:
        print("matplotlib is not installed: no plot")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
