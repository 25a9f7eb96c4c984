"""What vllm-specplug's per-token draft stop would cost inside a GPU draft loop (torch only, no vLLM).

    OUT=/tmp/out PYTHONPATH=. python benchmarks/gpu_confidence_cost.py

Why: the plugin's confidence stop (``patches/draft_confidence.py``) runs only on vLLM's CPU V1
runner today.  After every draft position it computes the drafted token's softmax probability
(``_confidence``: float cast, max, log-sum-exp, exp over the vocabulary), copies it to the host and
asks the controller's ``DraftStopper.after_position`` whether the next position runs.  On a GPU
that is a host sync per position, which vLLM's GPU drafter (positions back to back, no host read
in between) does not have.  This prices that, next to the passes it would sit between.

What it measures, bfloat16, context L=1024, B requests in (1, 4, 16, 64), K=8:
  - draft_pass_ms: one decode pass (q=1, logits at the last token, greedy argmax in the graph) of a
    random-weight Qwen2.5-0.5B-shaped draft, captured in a CUDA graph, median of timed replays;
    target_step_ms: a Qwen2.5-1.5B-shaped target, plain decode (q=1) and verify (q=1+8, logits at
    every query token), the reference a draft pass is compared with;
  - confidence_gpu_ms (CUDA events, not in a graph, as the plugin runs it) and confidence_copy_ms
    (the same plus ``.cpu().numpy()``, host wall clock) on the draft's [B, vocab] logits;
  - stopper_host_ms: one real ``DraftStopper.after_position`` (and stopper_init_ms: building one);
  - a K=8 draft loop, host wall clock: (a) loop_vllm_ms: 8 replays back to back, one sync at the
    end; (b) loop_confidence_ms: confidence + copy + after_position after each position (a rule
    that never stops); (c) loop_stop_at_2_ms: (b) with caps of 2, so the rule stops after 2.
What it is not: vLLM's kernels or drafter (attention is PyTorch SDPA over a contiguous cache, no
rotary, every position writes the same cache slot), no scheduler, sampler or input preparation.
Writes OUT/gpu-confidence-cost.jsonl (one JSON line per measurement; the first: device, torch,
dtype) and OUT/summary.md.  Without CUDA it runs tiny shapes on the CPU (perf_counter, no graphs):
a dry run of seconds.
"""
import gc
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

OUT = os.environ.get("OUT", "/tmp/out")
os.makedirs(OUT, exist_ok=True)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.bfloat16 if DEV == "cuda" else torch.float32
TINY = DEV != "cuda"
K = 8
# name: hidden, layers, heads, kv_heads, head_dim, intermediate, vocab
DRAFT = ("qwen2.5-0.5b", (896, 24, 14, 2, 64, 4864, 151936))
TARGET = ("qwen2.5-1.5b", (1536, 28, 12, 2, 128, 8960, 151936))
L, BS = 1024, (1, 4, 16, 64)
WARM, REPS, SMALL, LOOPS = 20, 100, 200, 50
if TINY:
    DRAFT = ("tiny-draft", (128, 2, 4, 2, 32, 256, 1000))
    TARGET = ("tiny-target", (256, 2, 4, 2, 64, 512, 1000))
    L, BS = 64, (1, 4)
    WARM, REPS, SMALL, LOOPS = 2, 5, 20, 5
    torch.set_num_threads(1)  # a dry run on a shared machine

try:
    import numba  # noqa: F401  (the controller's policy kernels; the stop rule is NumPy)
except ImportError:  # a torch-only machine: the kernels run as plain Python, unused here
    import sys
    import types

    sys.modules["numba"] = types.SimpleNamespace(
        njit=lambda *a, **k: a[0] if a and callable(a[0]) else (lambda f: f))
try:  # the controller's stop rule: plain NumPy, no vLLM
    from vllm_specplug.controller.confidence import EDGES, DraftStopper, StopRule
    STOPPER_ERR = None
except Exception as e:  # noqa: BLE001
    DraftStopper = StopRule = None
    EDGES = np.array([0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.995])
    STOPPER_ERR = f"import vllm_specplug.controller.confidence failed: {e!r}"[:300]


def confidence_gpu(logits):  # the device part of _confidence
    lg = logits.float()
    return torch.exp(lg.max(dim=-1).values - torch.logsumexp(lg, dim=-1))


try:  # the plugin's own function (imports only vllm_specplug.deployment, no vLLM)
    from vllm_specplug.patches.draft_confidence import _confidence as confidence
    CONF_SRC = "vllm_specplug.patches.draft_confidence._confidence"
except Exception:  # noqa: BLE001
    CONF_SRC = "local copy of _confidence"

    def confidence(logits):
        return confidence_gpu(logits).cpu().numpy()


def sync():
    _ = DEV == "cuda" and torch.cuda.synchronize()


class Model:
    """Random-weight decoder (Qwen2 layout: qkv bias, tied embedding); KV buffers flat, viewed per B."""

    def __init__(self, hidden, layers, heads, kvh, hd, inter, vocab, cap):
        self.h, self.heads, self.kvh, self.hd = hidden, heads, kvh, hd
        g = torch.Generator(device=DEV).manual_seed(0)

        def w(*s):
            return (torch.randn(*s, device=DEV, generator=g, dtype=torch.float32) * 0.02).to(DT)

        def z(n):
            return torch.zeros(n, device=DEV, dtype=DT)
        self.emb = w(vocab, hidden)  # the LM head is emb.T
        self.lnf = torch.ones(hidden, device=DEV, dtype=DT)
        self.w = [dict(ln1=self.lnf.clone(), qkv=w(hidden, (heads + 2 * kvh) * hd),
                       b=z((heads + 2 * kvh) * hd), o=w(heads * hd, hidden), ln2=self.lnf.clone(),
                       gu=w(hidden, 2 * inter), d=w(inter, hidden),
                       k=z(cap * kvh * hd), v=z(cap * kvh * hd)) for _ in range(layers)]

    def forward(self, tok, B, q, all_logits):
        kvh, hd, g = self.kvh, self.hd, self.heads // self.kvh
        res = self.emb[tok]  # [B*q, hidden]
        for lw in self.w:
            qkv = F.rms_norm(res, (self.h,), lw["ln1"]) @ lw["qkv"] + lw["b"]
            qq, kk, vv = qkv.split([self.heads * hd, kvh * hd, kvh * hd], dim=-1)
            n = B * kvh * (L + q) * hd
            kc = lw["k"][:n].view(B, kvh, L + q, hd)
            vc = lw["v"][:n].view(B, kvh, L + q, hd)
            kc[:, :, L:] = kk.view(B, q, kvh, hd).transpose(1, 2)
            vc[:, :, L:] = vv.view(B, q, kvh, hd).transpose(1, 2)
            qq = qq.view(B, q, kvh, g, hd).permute(0, 2, 1, 3, 4).reshape(B, kvh, q * g, hd)
            a = F.scaled_dot_product_attention(qq, kc, vc)
            a = a.view(B, kvh, q, g, hd).permute(0, 2, 1, 3, 4).reshape(B * q, self.heads * hd)
            res = res + a @ lw["o"]
            gg, uu = (F.rms_norm(res, (self.h,), lw["ln2"]) @ lw["gu"]).chunk(2, dim=-1)
            res = res + (F.silu(gg) * uu) @ lw["d"]
        hN = F.rms_norm(res, (self.h,), self.lnf)
        if not all_logits:
            hN = hN.view(B, q, self.h)[:, -1]
        return hN @ self.emb.t()


def capture(fn):
    """fn as a CUDA graph: returns its replay (on the CPU: fn itself)."""
    if DEV != "cuda":
        fn()
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay  # the bound method keeps the graph alive


def free():
    gc.collect()
    _ = DEV == "cuda" and torch.cuda.empty_cache()


def device_ms(fn, warm, reps):
    """Median ms of fn's device work: CUDA events (perf_counter on the CPU)."""
    for _ in range(warm):
        fn()
    sync()
    ts = []
    for _ in range(reps):
        if DEV == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); fn(); b.record(); b.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter(); fn(); ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def host_ms(fn, warm, reps):
    """Median host wall clock of fn in ms, the device idle at each start (fn syncs if it must)."""
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter(); fn(); ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def make_rule(B, cap):
    """A step's stop rule for B requests: history chances 0.6-0.95, a calibration that has seen 500
    drafts per bin, cuts so low that the loop runs all K positions (unless cap stops it)."""
    cond = np.random.default_rng(0).uniform(0.6, 0.95, (B, K))
    verified = np.full(EDGES.size + 1, 500.0)
    accepted = verified * np.array([0.15, 0.35, 0.55, 0.7, 0.8, 0.88, 0.93, 0.96, 0.98])
    return StopRule([f"r{i}" for i in range(B)], cond, np.full(B, cap, dtype=np.int64),
                    accepted, verified, EDGES, np.full(1, 1e-9), 1e-9)


def new_stopper(rule, batch_ids):
    """As the worker's patch builds one per propose call (_start)."""
    index = {rid: i for i, rid in enumerate(rule.req_ids)}
    return DraftStopper(rule, np.array([index.get(r, -1) for r in batch_ids], dtype=np.int64))


def main():
    t_start = time.time()
    f = open(os.path.join(OUT, "gpu-confidence-cost.jsonl"), "w")

    def emit(rec):
        print(json.dumps(rec), flush=True); f.write(json.dumps(rec) + "\n"); f.flush()

    emit({"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
          "dtype": str(DT), "L": L, "K": K, "draft": DRAFT[0], "target": TARGET[0],
          "confidence_fn": CONF_SRC, "stopper": STOPPER_ERR or "vllm_specplug.controller.confidence"})
    rows = {B: {} for B in BS}

    # The target: plain decode (q=1) and verification of K drafts (q=1+K), logits at every token.
    print(f"[{time.time() - t_start:.0f}s] building target {TARGET[0]}", flush=True)
    model = Model(*TARGET[1], cap=max(BS) * (L + 1 + K))
    for B in BS:
        for q, key in ((1, "target_step_ms"), (1 + K, "target_verify_ms")):
            tok = torch.randint(0, TARGET[1][6], (B * q,), device=DEV)
            replay = capture(lambda: model.forward(tok, B, q, True))
            ms = device_ms(replay, WARM, REPS)
            rows[B][key] = ms
            emit({"what": key, "model": TARGET[0], "B": B, "q": q, "L": L, "ms": round(ms, 4)})
            del replay
    del model
    free()
    print(f"[{time.time() - t_start:.0f}s] building draft {DRAFT[0]}", flush=True)
    model = Model(*DRAFT[1], cap=max(BS) * (L + 1))
    for B in BS:
        r = rows[B]
        tok = torch.randint(0, DRAFT[1][6], (B,), device=DEV)
        drafts = torch.zeros(B, K, dtype=torch.long, device=DEV)
        out = {}

        def step():  # one draft position: the pass, then greedy argmax into the next input
            out["logits"] = model.forward(tok, B, 1, False)
            tok.copy_(out["logits"].argmax(dim=-1))

        replay = capture(step)
        r["draft_pass_ms"] = device_ms(replay, WARM, REPS)
        emit({"what": "draft_pass_ms", "model": DRAFT[0], "B": B, "q": 1, "L": L,
              "ms": round(r["draft_pass_ms"], 4)})
        logits = out["logits"]  # the graph's output buffer
        r["confidence_gpu_ms"] = device_ms(lambda: confidence_gpu(logits), WARM, SMALL)
        r["confidence_copy_ms"] = host_ms(lambda: confidence(logits), WARM, SMALL)
        emit({"what": "confidence", "B": B, "vocab": logits.shape[-1], "logits_dtype": str(logits.dtype),
              "confidence_gpu_ms": round(r["confidence_gpu_ms"], 4),
              "confidence_copy_ms": round(r["confidence_copy_ms"], 4)})

        ids = [f"r{i}" for i in range(B)]
        rule_go, rule_2 = (make_rule(B, K), make_rule(B, 2)) if STOPPER_ERR is None else (None, None)
        if rule_go is not None:
            confs = np.random.default_rng(1).beta(4.0, 1.0, (K, B))  # mostly confident, every bin
            t_init, t_call = [], []
            for _ in range(SMALL // K + WARM):
                t0 = time.perf_counter(); st = new_stopper(rule_go, ids)
                t_init.append((time.perf_counter() - t0) * 1e3)
                for j in range(K):
                    t0 = time.perf_counter(); st.after_position(confs[j])
                    t_call.append((time.perf_counter() - t0) * 1e3)
            r["stopper_host_ms"] = statistics.median(t_call[WARM * K:])
            r["stopper_init_ms"] = statistics.median(t_init[WARM:])
        else:
            r["stopper_host_ms"] = r["stopper_init_ms"] = None
        emit({"what": "stopper", "B": B, "K": K, "calls": (SMALL // K) * K, "error": STOPPER_ERR,
              **{k: r[k] and round(r[k], 5) for k in ("stopper_host_ms", "stopper_init_ms")}})

        ran = {}

        def loop(rule, stop_after, key):
            """K draft positions; with a rule (or a stop count when the stopper is missing) the
            confidence goes to the host after each and decides whether the next one runs."""
            st = new_stopper(rule, ids) if rule is not None else None
            j = 0
            for j in range(K):
                replay()
                drafts[:, j].copy_(tok)
                if stop_after is None:
                    continue
                conf = confidence(out["logits"])
                go = st.after_position(conf) if st is not None else j + 1 < stop_after
                if not go:
                    break
            sync()
            ran[key] = j + 1

        for key, rule, stop in (("loop_vllm_ms", None, None), ("loop_confidence_ms", rule_go, K),
                                ("loop_stop_at_2_ms", rule_2, 2)):
            r[key] = host_ms(lambda: loop(rule, stop, key), WARM // 4 + 1, LOOPS)
            emit({"what": key, "B": B, "K": K, "positions_run": ran[key], "ms": round(r[key], 4)})
        over = r["loop_confidence_ms"] - r["loop_vllm_ms"]
        r["overhead_pct"] = 100 * over / r["loop_vllm_ms"]
        r["overhead_per_position_ms"] = over / K
        r["overhead_per_position_pct_of_pass"] = 100 * over / K / r["draft_pass_ms"]
        emit({"what": "overhead", "B": B, "overhead_pct": round(r["overhead_pct"], 2),
              "per_position_ms": round(r["overhead_per_position_ms"], 4),
              "per_position_pct_of_draft_pass": round(r["overhead_per_position_pct_of_pass"], 2),
              "positions_run": dict(ran)})
        del replay, out, logits
    del model
    free()

    def fmt(v, d=3):
        return "n/a" if v is None else f"{v:.{d}f}"

    dev = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (tiny shapes)"
    lines = [f"# Draft-stop cost in a GPU draft loop: {dev}, torch {torch.__version__}, {DT}, "
             f"L={L}, K={K}, draft {DRAFT[0]}, target {TARGET[0]}", "",
             "| B | draft pass ms | target plain ms | target verify-9 ms | conf GPU ms | conf+copy ms "
             "| stopper host ms | loop vLLM ms | loop conf ms | loop stop@2 ms | overhead % "
             "| overhead/position ms | overhead/position % of pass |",
             "|---:" * 13 + "|"]
    for B in BS:
        r = rows[B]
        lines.append("| " + " | ".join([str(B)] + [fmt(r[k]) for k in (
            "draft_pass_ms", "target_step_ms", "target_verify_ms", "confidence_gpu_ms",
            "confidence_copy_ms", "stopper_host_ms", "loop_vllm_ms", "loop_confidence_ms",
            "loop_stop_at_2_ms")] + [fmt(r["overhead_pct"], 1), fmt(r["overhead_per_position_ms"]),
                                     fmt(r["overhead_per_position_pct_of_pass"], 1)]) + " |")
    lines += ["", f"Medians; device times by {'CUDA events' if DEV == 'cuda' else 'perf_counter'}, loops "
              "and copies by host wall clock. Overhead = (loop conf - loop vLLM) / loop vLLM; a "
              "position's share = overhead / K / draft pass. Confidence: " + CONF_SRC + "."]
    if STOPPER_ERR:
        lines.append(f"Stopper not timed (the loops ran confidence + copy only, stop by count): {STOPPER_ERR}")
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    with open(os.path.join(OUT, "summary.md"), "w") as s:
        s.write(text)
    emit({"done": True, "seconds": round(time.time() - t_start, 1)})
    f.close()


if __name__ == "__main__":
    main()
