"""The main job: the served benchmark's quick mode on the Qwen coder pair.

    make demo        # or: python -m vllm_specplug.tools.demo

Runs ``python -m vllm_specplug.tools.bench --served --quick``: Qwen2.5-Coder-1.5B
(target) with Qwen2.5-Coder-0.5B (draft) from the offline model cache, each
arm a real ``vllm-specplug serve`` driven by vLLM's own ``vllm bench serve``
on public prompts (HumanEval code completions, ShareGPT chat turns) at one
and four concurrent requests: plain decoding, vLLM's own static K=4, and the
adaptive policy.  Prints a table, compares every arm's greedy texts with
plain decoding's, and writes ``results.md``, ``results.json`` and PNG plots to
``demo-results/``.  About fifteen minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="demo-results", help="folder for the tables and PNGs")
    args = parser.parse_args(argv)

    from vllm_specplug.tools import datasets, models

    missing = [k for k in models.GROUPS["qwen-coder-pair"] if not models.is_cached(k)]
    if missing:
        print(f"models {missing} are not in the cache; fetch them with:\n"
              "  vllm-specplug models fetch qwen-coder-pair", file=sys.stderr)
        return 1
    missing = [k for k in ("humaneval", "sharegpt") if not datasets.is_cached(k)]
    if missing:
        print(f"prompt sets {missing} are not fetched; fetch them with:\n"
              "  vllm-specplug data fetch humaneval sharegpt", file=sys.stderr)
        return 1
    from vllm_specplug.tools.bench.served import main as served_main

    return served_main(["--served", "--quick", "--out", args.out])


if __name__ == "__main__":
    from vllm_specplug.tools.bench import exit_quietly

    exit_quietly(main())
