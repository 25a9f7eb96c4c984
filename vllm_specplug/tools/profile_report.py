"""``vllm-specplug profile --config FILE``: a deployment's step-cost profile, shown.

Starts the deployment's engine in this process (the plugin measures its
profile at start-up, ``vllm_specplug.profiling``), then prints the table and
writes ``profile.json`` and ``profile.png``.
"""

from __future__ import annotations

import os
import sys

from vllm_specplug.controller import StepProfile


def plot(profile: StepProfile, path: str, title: str = "") -> None:
    """The profile as a PNG: step time by tokens, and the cost of a draft position by batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    t = profile.tokens
    left.plot(t, profile.target_s * 1e3, "o-", label="K_step = 0 step")
    left.plot(t, (profile.target_s + profile.first_s) * 1e3, "s-", label="K_step = 1 step")
    left.set_xscale("log", base=2)
    left.set_xlabel("tokens in the step")
    left.set_ylabel("ms")
    left.legend()
    left.grid(alpha=0.3)
    right.plot(profile.batch, profile.pass_s * 1e3, "o-", label="one more draft position")
    if profile.catchup_tokens is not None:
        ax = right.twiny()
        ax.plot(profile.catchup_tokens, profile.catchup_s * 1e3, "x--", color="C3",
                label="catch-up (top axis: tokens)")
        ax.legend(loc="lower right")
    right.set_xlabel("requests in the step")
    right.set_ylabel("ms")
    right.legend(loc="upper left")
    right.grid(alpha=0.3)
    meta = profile.meta
    fig.suptitle(title or f"step-cost profile ({meta.get('source', '?')}, "
                 f"{meta.get('shapes', '?')} shapes in {meta.get('seconds', '?')} s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """``vllm-specplug profile --config FILE``: measure this deployment's profile and show it."""
    import argparse

    p = argparse.ArgumentParser(
        prog="vllm-specplug profile",
        description="Measure the step-cost profile of a deployment (the same YAML as "
                    "`vllm-specplug serve --config`) and print it as a table and a PNG.")
    p.add_argument("--config", required=True, help="a vllm serve YAML config")
    p.add_argument("--out", default="specplug-profile", help="folder for profile.json/.png")
    p.add_argument("--cached", action="store_true",
                   help="use a cached profile when it passes its check (default: measure anew)")
    args = p.parse_args(argv)
    import dataclasses

    import yaml

    with open(args.config) as f:
        raw = yaml.safe_load(f) or {}
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    kwargs = {k.replace("-", "_"): v for k, v in raw.items()}
    dropped = sorted(k for k in kwargs if k not in known)
    kwargs = {k: v for k, v in kwargs.items() if k in known}
    # Model cache keys resolve as under `vllm-specplug serve`.
    from vllm_specplug.tools.models import resolve_model, resolve_spec

    if "model" in kwargs:
        kwargs["model"] = resolve_model(kwargs["model"])
    kwargs["speculative_config"] = resolve_spec(kwargs.get("speculative_config"), None)
    if kwargs.get("speculative_config") is None:
        print("vllm-specplug profile: the config has no speculative-config", file=sys.stderr)
        return 2
    if not args.cached:
        os.environ["VLLM_SPECPLUG_PROFILE_FRESH"] = "1"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if int(kwargs.get("tensor_parallel_size", 1) or 1) == 1:
        kwargs.setdefault("distributed_executor_backend", "uni")
    kwargs["scheduler_cls"] = "vllm_specplug.AdaptiveSpecScheduler"
    if dropped:
        print(f"[profile] serve-only keys not used here: {', '.join(dropped)}")
    from vllm import LLM

    llm = LLM(**kwargs)
    try:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        profile = sched.specplug.profile
    except AttributeError:
        print("vllm-specplug profile: run with VLLM_ENABLE_V1_MULTIPROCESSING=0 "
              "(the scheduler must be in this process)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    profile.save(os.path.join(args.out, "profile.json"))
    plot(profile, os.path.join(args.out, "profile.png"))
    print(profile.table())
    print(f"[profile] {profile.meta.get('source')}: {profile.meta.get('shapes')} shapes in "
          f"{profile.meta.get('seconds')} s; wrote {args.out}/profile.json and profile.png")
    return 0
