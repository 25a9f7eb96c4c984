"""How much any per-token draft stop can win at one request, on real greedy token sequences.

    .venv/bin/python benchmarks/stop_replay.py record --out /tmp/stop   # the models, ~10 min
    .venv/bin/python benchmarks/stop_replay.py replay /tmp/stop/sequences.jsonl

Why: the served benchmark's ratios move 15-37% between runs of the same arm on this machine (its
speed drifts), so it cannot tell whether a stop rule is a few percent from what is possible.  With
greedy decoding a speculative step's outcome is fixed by the text alone: the draft's j-th token is
accepted exactly when it equals the target's next token and every draft before it was accepted, and
while the drafts are accepted the draft sees exactly the target's text.  So one teacher-forced pass
of the draft over the target's greedy output gives, for every output position t, whether a draft
offered at t is accepted (``match``) and the draft's probability of its token (``confidence``),
whatever step the position falls in.

``record``: the Qwen pair of the served benchmark (float32, transformers; the same models as
``vllm-specplug models``), prompts from the served benchmark's HumanEval and ShareGPT sources taken
from the end of their seeded order (the grid's cells use the start), the target's 64 greedy tokens,
then the draft's pass over prompt + output.  Writes ``sequences.jsonl`` (per prompt: workload,
match[t], confidence[t] for t >= 1; the prompt's step yields token 0; and, for other signals
than the top-1 probability, the top-1 less the top-2 probability, the entropy, and the target's
output token ids).

``replay``: one request (c = 1) decoding each sequence, per policy, on a step-cost model:
plain (one token a step); static K = 1..8 (vLLM's: K drafts, K passes); the oracle (knows where
the first rejection falls: drafts exactly the accepted run, none when the first draft fails); and
the plugin (``SpecController`` with the served defaults and the step-cost profile as its belief,
``stop_rule`` and ``DraftStopper`` fed the recorded confidences, the controller observing each step
as the scheduler does: verifications, confidences, the step's seconds).  The true step cost is
``--plain-s`` for a plain step and ``--first-s + (passes - 1) * --pass-s`` more for a step that
drafts (defaults: medians of the Qwen pair's served steps at one request on this machine, from the
``dedb02d`` grid's trace: K_step 1 at 0.191 s, K_step 8 at 0.553 s, plain 0.155 s);
``--pass-scales 1,0.3`` multiplies the draft's share, for a cheaper (GPU-like) draft.  Output
tokens per second of decoding per policy, as a multiple of plain's and of the best static K's, per
workload; ``--out DIR``: results.md, results.json and stop-replay.png there.
What it leaves out: the prompt's step (the same for every policy but the passes it drafts), a
confidence past the first rejection (the draft's own continuation is not recorded: the position's
teacher-forced confidence stands in for it, which only decides whether a wasted pass runs), and
bfloat16 (served) against float32 (here).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

OUTPUT_TOKENS = 64


# -- record ------------------------------------------------------------------
def record(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_specplug.tools import models
    from vllm_specplug.tools.bench.served import SETUPS, _sources

    setup = SETUPS["qwen"]
    target_dir, draft_dir = models.model_path(setup.target), models.model_path(setup.draft)
    tok = AutoTokenizer.from_pretrained(target_dir)
    torch.set_num_threads(args.threads)
    target = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, torch_dtype=torch.float32).eval()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "sequences.jsonl"
    started = time.monotonic()
    with open(path, "w") as f:
        for workload in args.workloads.split(","):
            prompts, is_chat = _sources(setup, workload, tok, None)
            if is_chat:
                prompts = [tok.apply_chat_template([{"role": "user", "content": p}],
                                                   add_generation_prompt=True, tokenize=False)
                           for p in prompts]
            for i, text in enumerate(prompts[-args.prompts:]):
                ids = tok(text, return_tensors="pt").input_ids
                with torch.no_grad():
                    gen = target.generate(ids, max_new_tokens=OUTPUT_TOKENS, do_sample=False,
                                          pad_token_id=tok.eos_token_id)
                    full = gen[0]
                    n = full.numel() - ids.shape[1]
                    logits = draft(full[None, :-1]).logits[0, ids.shape[1]:].float()
                probs = torch.softmax(logits, dim=-1)
                top2 = probs.topk(2, dim=-1)
                conf, guess = top2.values[:, 0], top2.indices[:, 0]
                entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(dim=-1)
                y = full[ids.shape[1] + 1:]
                # Position t >= 1: the draft's guess of output token t given tokens < t.
                match = (guess[: n - 1] == y).tolist()

                def rounded(x):
                    return [round(float(v), 5) for v in x[: n - 1]]

                f.write(json.dumps({"workload": workload, "prompt": len(prompts) - args.prompts + i,
                                    "match": [int(m) for m in match],
                                    "confidence": rounded(conf),
                                    # For other signals than the top-1 probability:
                                    "margin": rounded(conf - top2.values[:, 1]),
                                    "entropy": rounded(entropy),
                                    "tokens": full[ids.shape[1]:].tolist()})
                        + "\n")
                f.flush()
                print(f"[record] {workload} {i + 1}/{args.prompts}: {n} tokens, "
                      f"{sum(match)}/{len(match)} drafts match, "
                      f"{time.monotonic() - started:.0f} s", file=sys.stderr)
    print(path)
    return 0


# -- replay ------------------------------------------------------------------
class Cost:
    def __init__(self, plain_s: float, first_s: float, pass_s: float, scale: float) -> None:
        self.plain_s, self.first_s, self.pass_s = plain_s, first_s * scale, pass_s * scale

    def __call__(self, passes: int) -> float:
        return self.plain_s + (self.first_s + (passes - 1) * self.pass_s if passes > 0 else 0.0)


def run_length(match, t: int, limit: int) -> int:
    n = 0
    while n < limit and t + n < len(match) and match[t + n]:
        n += 1
    return n


def decode(match, cost: Cost, choose, observe=None) -> tuple[int, float]:
    """One request through ``match``: ``choose(t)`` gives a step's (drafts offered, draft passes
    run) at position ``t``; ``observe(t, offered, accepted, passes, seconds)`` sees its outcome.
    A step yields its accepted drafts and the target's own next token, not past the end."""
    t, tokens, seconds = 0, 0, 0.0
    while t < len(match):
        offered, passes = choose(t)
        offered = min(offered, len(match) - t)
        a = run_length(match, t, offered)
        s = cost(passes)
        if observe is not None:
            observe(t, offered, a, passes, s)
        tokens, seconds, t = tokens + min(a + 1, len(match) - t), seconds + s, t + a + 1
    return tokens, seconds


def static(seq, k: int, cost: Cost) -> tuple[int, float]:
    return decode(seq["match"], cost, lambda t: (k, k))


def oracle(seq, width: int, cost: Cost) -> tuple[int, float]:
    def choose(t):
        run = run_length(seq["match"], t, width)
        return run, run

    return decode(seq["match"], cost, choose)


def threshold(seq, tau: float, width: int, cost: Cost) -> tuple[int, float]:
    """Draft while the draft's confidence is at least ``tau`` (up to ``width``): the
    confidence signal alone, at a threshold picked afterwards (optimistic)."""
    match, conf = seq["match"], seq["confidence"]

    def choose(t):
        passes = 0
        while passes < width and t + passes < len(match):
            passes += 1
            if conf[t + passes - 1] < tau:
                return passes - 1, passes  # the doubtful draft is run, not offered
        return passes, passes

    return decode(match, cost, choose)


def plugin(seqs, profile, cost: Cost, width: int, confidence: bool = True,
           calibrated: list | None = None) -> list[tuple[int, float]]:
    """The controller and the stop over the sequences in order, one request at a time;
    ``calibrated``: sequences whose every position the calibration has seen before the first
    step (with ``seqs`` themselves: the confidence's calibration known in advance, a bound)."""
    from vllm_specplug.config import SpecPlugConfig
    from vllm_specplug.controller import SpecController
    from vllm_specplug.controller.confidence import DraftStopper

    settings = SpecPlugConfig.from_dict({}, width).controller_settings(width)
    ctrl = SpecController(settings, profile)
    for seq in calibrated or []:  # each position as a one-draft verification
        ctrl.observe_confidence([[c] for c in seq["confidence"]], seq["match"])
    out = []
    for n, seq in enumerate(seqs):
        rid = f"r{n}"
        ctrl.add_request(rid)
        match, conf = seq["match"], seq["confidence"]

        def choose(t):
            left = len(match) - t  # max_tokens less the output so far (tokens 0..t)
            d = ctrl.plan([rid], base_tokens=1, tokens_left=[left])
            k_step = min(int(d.k_step), width)
            rule = ctrl.stop_rule() if confidence else None
            if rule is None or k_step <= 0:
                return min(int(d.k[0]), k_step), k_step
            k_step = min(max(k_step, int(rule.caps.max(initial=0))), width)
            stopper = DraftStopper(rule, np.array([0]))
            passes = 0
            while passes < k_step:
                j = min(t + passes, len(conf) - 1)
                passes += 1
                if not stopper.after_position(np.array([conf[j]])):
                    break
            return int(stopper.limits()[0]), passes

        def observe(t, offered, a, passes, seconds):
            if offered > 0:
                ctrl.observe_verifications([rid], [offered], [a])
                ctrl.observe_confidence([conf[t:t + offered]], [a])
            ctrl.observe_step(1, 1 + offered, passes, seconds)

        out.append(decode(match, cost, choose, observe))
        ctrl.finish_request(rid)
    return out


def auc(seqs) -> float:
    """How well the confidence ranks the drafts the target accepts above the ones it rejects:
    the chance an accepted draft's is the higher of an accepted and a rejected one's."""
    y = np.concatenate([s["match"] for s in seqs]).astype(bool)
    x = np.concatenate([s["confidence"] for s in seqs]).astype(np.float64)
    _, inv, count = np.unique(x, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(count) - (count - 1) / 2.0)[inv]  # ties share their mean rank
    n1, n0 = int(y.sum()), int((~y).sum())
    return float((ranks[y].sum() - n1 * (n1 + 1) / 2) / max(n1 * n0, 1))


def rate(pairs) -> float:
    return sum(p[0] for p in pairs) / sum(p[1] for p in pairs)


def compare(group, cost: Cost, profile, width: int = 8) -> dict:
    """Tokens per second of decoding, per policy, over one workload's sequences."""
    from vllm_specplug.controller.profile import StepProfile

    if profile is None:  # the plugin believes the true costs
        profile = StepProfile([1, 64], [cost.plain_s] * 2, [cost.first_s] * 2, [1, 64],
                              [cost.pass_s] * 2, meta={"zero_cost_fallback": True})
    rates = {"plain": rate([static(s, 0, cost) for s in group])}
    for k in range(1, width + 1):
        rates[f"static K={k}"] = rate([static(s, k, cost) for s in group])
    taus = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)
    best_tau = max((rate([threshold(s, x, width, cost) for s in group]), x) for x in taus)
    # The name stays the same whichever threshold won (the plot's bars line up).
    rates[f"confidence threshold (best of {len(taus)})"] = best_tau[0]
    rates["threshold"] = best_tau[1]
    rates["plugin, history only"] = rate(plugin(group, profile, cost, width, False))
    rates["plugin"] = rate(plugin(group, profile, cost, width))
    rates["plugin, calibrated in advance"] = rate(plugin(group, profile, cost, width,
                                                         calibrated=group))
    rates["oracle"] = rate([oracle(s, width, cost) for s in group])
    return rates


def with_signal(seq: dict, signal: str) -> dict:
    """``seq`` with ``signal`` as its confidence: the draft's top-1 probability
    (``confidence``), its top-1 less top-2 probability (``margin``) or exp(-entropy)
    (``entropy``: 1 when the draft is sure, as the others)."""
    if signal == "confidence":
        return seq
    x = np.asarray(seq[signal], dtype=np.float64)
    return dict(seq, confidence=(np.exp(-x) if signal == "entropy" else x).tolist())


def replay(args) -> int:
    from vllm_specplug.controller.profile import StepProfile

    seqs = [with_signal(json.loads(line), args.signal)
            for line in open(args.sequences) if line.strip()]
    belief = StepProfile.load(args.profile) if args.profile else None
    results = []
    for scale in (float(x) for x in args.pass_scales.split(",")):
        cost = Cost(args.plain_s, args.first_s, args.pass_s, scale)
        for workload in dict.fromkeys(s["workload"] for s in seqs):
            group = [s for s in seqs if s["workload"] == workload]
            rates = compare(group, cost, belief)
            tau = rates.pop("threshold")
            best_k = max((v, k) for k, v in rates.items() if k.startswith("static"))[1]
            matched = sum(sum(s["match"]) for s in group) / sum(len(s["match"]) for s in group)
            results.append({"workload": workload, "prompts": len(group), "matched": matched,
                            "pass_scale": scale, "first_s": cost.first_s, "pass_s": cost.pass_s,
                            "plain_s": cost.plain_s, "best_static": best_k, "threshold": tau,
                            "signal": args.signal, "auc": auc(group),
                            "rates": rates})
            print(f"[replay] {workload}, draft cost x{scale}: plugin "
                  f"{rates['plugin'] / rates[best_k]:.3f} of {best_k}", file=sys.stderr)
    lines = [f"Sequences: `{args.sequences}`; the draft's signal: {args.signal}; the plugin's "
             f"profile: {args.profile or 'the true step costs'}.", ""]
    for r in results:
        best = r["rates"][r["best_static"]]
        lines += [f"### {r['workload']}, draft cost x{r['pass_scale']}: {r['prompts']} prompts, "
                  f"{r['matched']:.2f} of positions drafted right (the signal's AUC "
                  f"{r['auc']:.3f}); step {r['plain_s']:.3f} s "
                  f"plain, "
                  f"+{r['first_s']:.3f} s first pass, +{r['pass_s']:.3f} s each further pass",
                  "", "| policy | tokens/s | / plain | / best static K |", "|---|---|---|---|"]
        lines += [f"| {k} | {v:.2f} | {v / r['rates']['plain']:.3f} | {v / best:.3f} |"
                  for k, v in r["rates"].items()]
        lines += ["", f"Best static: {r['best_static']}; the best threshold: the draft's "
                  f"probability >= {r['threshold']}.", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.md").write_text(text + "\n")
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        plot(results, out / "stop-replay.png")
    return 0


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [k for k in results[0]["rates"] if k != "plain"]
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        best = r["rates"][r["best_static"]]
        ys = [r["rates"][k] / best if k in r["rates"] else np.nan for k in names]
        xs = np.arange(len(names)) + i * width
        ax.bar(xs, ys, width, label=f"{r['workload']}, draft cost x{r['pass_scale']}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(1.08, color="grey", lw=0.8, ls="--")
    ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2)
    ax.set_xticklabels([n.split(" (")[0] for n in names], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s over the best static K")
    ax.set_ylim(0.5, 1.5)
    ax.set_title("One request, real greedy sequences: every policy against the best static K")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="stop_replay.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--out", default="/tmp/stop-replay")
    r.add_argument("--workloads", default="humaneval,sharegpt")
    r.add_argument("--prompts", type=int, default=24, help="per workload")
    r.add_argument("--threads", type=int, default=2)
    q = sub.add_parser("replay")
    q.add_argument("sequences")
    q.add_argument("--profile", default=None,
                   help="a step-cost profile JSON, the plugin's belief (default: the true costs)")
    q.add_argument("--plain-s", type=float, default=0.155)
    q.add_argument("--first-s", type=float, default=0.036)
    q.add_argument("--pass-s", type=float, default=0.052)
    q.add_argument("--pass-scales", default="1",
                   help="comma-separated multiples of the draft's share of a step (default 1)")
    q.add_argument("--signal", default="confidence", choices=("confidence", "margin", "entropy"),
                   help="the draft's signal the plugin and the threshold read (default: its "
                        "top-1 probability, what the plugin serves with)")
    q.add_argument("--out", default=None, help="write results.md, results.json and a plot here")
    args = p.parse_args(argv)
    return record(args) if args.cmd == "record" else replay(args)


if __name__ == "__main__":
    raise SystemExit(main())
