"""How a cached step-cost profile is judged at start-up, on real engine starts.

    .venv/bin/python benchmarks/validate_check.py [--starts 4] [--samples 8] [--out FILE.json]

A cached profile is checked at start-up before it is used
(``profiling.validate``): two shapes at one request (plain, and drafting K)
are stepped ``WARMUP`` times untimed and ``REPEATS`` times timed, and their
``robust_median`` must lie within ``VALIDATE_TOLERANCE`` of the cached
price.  This script measures what those constants decide on this machine:
the Qwen2.5-Coder pair (1.5B + 0.5B, ``draft_model``, K=8, the plugin's
defaults) is started once with an empty profile cache (the profile is
measured and cached), then ``--starts`` more times in fresh processes on
that cache; each of those starts times ``--samples`` steps of each shape
(nothing discarded) in place of the validation's, and accepts the table
whatever they read.  From the raw samples, per (warm-up, repeats, median
rule): the measured / cached ratios over the starts, and at which
tolerances every start would have kept the table.  Needs the models
(``vllm-specplug models fetch qwen-coder-pair``); about 1.5 min a start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

K = 8


def child(out: str, samples: int) -> None:
    """One engine start on the cache, its validation's raw samples written to ``out``."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import vllm_specplug.profiling as profiling
    import vllm_specplug.profiling.validation as validation
    from vllm_specplug.controller import StepProfile
    from vllm_specplug.tools.models import model_path

    shapes = []
    judged = {}
    validation.WARMUP, validation.REPEATS = 0, samples
    validation.VALIDATE_TOLERANCE = float("inf")  # keep the table: the samples are the result
    median = validation.robust_median

    def recording(times):
        shapes.append(list(times))
        return median(times)

    validation.robust_median = recording
    validate = validation.validate

    def validating(executor, vllm_config, kv_cache_config, profile, k, *a, **kw):
        steps = validation.validate_steps

        def timed(bench, k):
            plain, t_plain, wide, t_wide = steps(bench, k)
            judged.update(plain_price=profile.step(t_plain, 1, 0),
                          wide_price=profile.step(t_wide, 1, k), t_plain=t_plain, t_wide=t_wide)
            return plain, t_plain, wide, t_wide
        validation.validate_steps = timed
        try:
            return validate(executor, vllm_config, kv_cache_config, profile, k, *a, **kw)
        finally:
            validation.validate_steps = steps

    validation.validate = validating
    from vllm import LLM

    t0 = time.time()
    llm = LLM(model=str(model_path("qwen-coder-1.5b")),
              speculative_config={"method": "draft_model",
                                  "model": str(model_path("qwen-coder-0.5b")),
                                  "num_speculative_tokens": K},
              scheduler_cls="vllm_specplug.AdaptiveSpecScheduler",
              additional_config={"specplug": {}}, max_model_len=2048, enforce_eager=True,
              dtype="bfloat16")
    cached = [f for f in os.listdir(profiling.cache_dir()) if f.endswith(".json")]
    result = {"seconds": time.time() - t0, "validated": bool(judged), "cache": cached}
    if judged:
        result.update(judged, plain=shapes[0], wide=shapes[1])
    else:
        meta = StepProfile.load(os.path.join(profiling.cache_dir(), cached[0])).meta
        result["measured_s"] = meta.get("seconds")
    with open(out, "w") as f:
        json.dump(result, f)
    del llm


def rules():
    from vllm_specplug.profiling import robust_median

    return {"robust median (1.5x fastest)": robust_median, "median": statistics.median,
            "fastest": min}


def analyse(starts: list[dict]) -> list[dict]:
    rows = []
    for warmup in (0, 1, 2):
        for repeats in (1, 2, 3, 5):
            for name, rule in rules().items():
                if warmup + repeats > len(starts[0]["plain"]):
                    continue
                ratios = []
                for s in starts:
                    for key in ("plain", "wide"):
                        ratios.append(rule(s[key][warmup:warmup + repeats]) / s[f"{key}_price"])
                worst = max(abs(r - 1.0) for r in ratios)
                rows.append({"warmup": warmup, "repeats": repeats, "rule": name,
                             "ratios": [round(r, 3) for r in ratios], "worst": round(worst, 3),
                             "kept_at": {t: all(abs(r - 1) <= t for r in ratios)
                                         for t in (0.1, 0.25, 0.4)}})
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--starts", type=int, default=4, help="starts on the cached profile")
    p.add_argument("--samples", type=int, default=8, help="timed steps per shape and start")
    p.add_argument("--out", help="write the raw samples and the table as JSON here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.samples)
        return
    work = tempfile.mkdtemp(prefix="specplug-validate-")
    env = dict(os.environ, VLLM_SPECPLUG_PROFILE_CACHE=os.path.join(work, "profiles"))
    starts = []
    for i in range(args.starts + 1):
        out = os.path.join(work, f"start-{i}.json")
        print(f"start {i + 1}/{args.starts + 1} ({'measures' if i == 0 else 'validates'}) ...",
              flush=True)
        subprocess.run([sys.executable, __file__, "--child", out, "--samples",
                        str(args.samples)], env=env, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        with open(out) as f:
            r = json.load(f)
        print(f"  {r['seconds']:.0f} s" + (
            f"; plain {[round(x * 1e3) for x in r['plain']]} ms (cached "
            f"{r['plain_price'] * 1e3:.0f}), K={K} {[round(x * 1e3) for x in r['wide']]} ms "
            f"(cached {r['wide_price'] * 1e3:.0f})" if r["validated"] else
            f"; measured the profile in {r['measured_s']} s"), flush=True)
        if i and not r["validated"]:
            sys.exit("a start on the cached profile did not validate it")
        if i:
            starts.append(r)
    rows = analyse(starts)
    print("\n| warm-up | repeats | rule | measured / cached, every start and shape | worst |"
          " kept by all at 0.1 / 0.25 / 0.4 |")
    print("|---:|---:|---|---|---:|---|")
    for r in rows:
        kept = " / ".join("yes" if r["kept_at"][t] else "no" for t in (0.1, 0.25, 0.4))
        print(f"| {r['warmup']} | {r['repeats']} | {r['rule']} | "
              f"{', '.join(f'{x:.2f}' for x in r['ratios'])} | {r['worst']:.2f} | {kept} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"starts": starts, "table": rows}, f, indent=1)


if __name__ == "__main__":
    main()
