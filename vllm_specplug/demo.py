"""The main job: the benchmark's quick mode on the Qwen coder pair.

    make demo        # or: python -m vllm_specplug.demo

Runs ``python -m vllm_specplug.bench --quick``: Qwen2.5-Coder-1.5B (target)
with Qwen2.5-Coder-0.5B (draft) from the offline model cache, on an easy
workload (code completion: the draft agrees) and a hard one (open prose: it
often does not), one request at a time, comparing plain decoding, static
K=2 and K=4, the adaptive policy, and the adaptive policy without zero-cost
fallback.  Prints a table, checks that every greedy output equals plain
decoding, and writes ``results.md``, ``results.json`` and PNG plots to
``demo-results/``.  About ten to fifteen minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="demo-results", help="folder for the table and PNGs")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="tokens per request (default: the quick mode's 32)")
    args = parser.parse_args(argv)

    from vllm_specplug import models

    missing = [k for k in models.GROUPS["qwen-coder-pair"] if not models.is_cached(k)]
    if missing:
        print(f"models {missing} are not in the cache; fetch them with:\n"
              "  python -m vllm_specplug.models fetch qwen-coder-pair", file=sys.stderr)
        return 1
    from vllm_specplug.bench.__main__ import main as bench_main

    bench_args = ["--quick", "--out", args.out]
    if args.max_tokens:
        bench_args += ["--max-tokens", str(args.max_tokens)]
    return bench_main(bench_args)


if __name__ == "__main__":
    sys.exit(main())
