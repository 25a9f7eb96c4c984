"""The simulator's sweep: the cells of a grid, and ``run_cell`` mapped over
them (in this process, a process pool or Ray), with progress on stderr."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ProcessPoolExecutor

from vllm_specplug.tools.sim.cell import CellSpec
from vllm_specplug.tools.sim.cost import make_setup
from vllm_specplug.tools.sim.run import run_cell


def cell_specs(setups, scenarios, policies, concurrency, seeds, **opts) -> list[CellSpec]:
    specs = []
    for setup in setups:
        cap = make_setup(setup, gpu=opts.get("gpu", "h200")).max_concurrency
        for scenario in scenarios:
            for c in concurrency:
                if c > cap:
                    continue
                for policy in policies:
                    for seed in range(seeds):
                        specs.append(CellSpec(setup, scenario, policy, c, seed, **opts))
    return specs


def _cost_rank(spec: CellSpec) -> float:
    heavy = spec.policy in ("goodput", "heuristic") or spec.policy.startswith("ctrl-")
    return -(spec.concurrency * (20 if heavy else 1)) * (spec.warmup + spec.measure)


def run_sweep(specs: list[CellSpec], jobs: int = 1, progress: bool = True,
              ray_address: str | None = None) -> list[dict]:
    """Map ``run_cell`` over ``specs`` (in parallel with ``jobs`` > 1, or as
    Ray tasks when ``ray_address`` is given: ``"local"``, ``"auto"`` or
    ``HOST:PORT``, see ``vllm_specplug.tools.sweeps``); results come back in the
    order of ``specs``, the same whichever way they ran."""
    order = sorted(range(len(specs)), key=lambda i: _cost_rank(specs[i]))
    results: list[dict | None] = [None] * len(specs)
    bar = _Progress(len(specs), progress)
    if ray_address is not None:
        from vllm_specplug.tools.sweeps import ray_map

        # Heaviest first, as below, so the longest cells do not end last.
        ordered = ray_map(run_cell, [specs[i] for i in order], address=ray_address,
                          num_cpus=jobs if jobs > 1 else None,
                          on_result=lambda j: bar.update(specs[order[j]]))
        for i, r in zip(order, ordered):
            results[i] = r
    elif jobs <= 1:
        for i in order:
            results[i] = run_cell(specs[i])
            bar.update(specs[i])
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {i: pool.submit(run_cell, specs[i]) for i in order}
            for i in order:
                results[i] = futures[i].result()
                bar.update(specs[i])
    bar.close()
    return results  # type: ignore[return-value]


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.t0 = time.time()
        self.bar = None
        self.every = max(1, total // 20)
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="cell", file=sys.stderr)
            except ImportError:
                pass

    def update(self, spec: CellSpec) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(f"{spec.setup} {spec.scenario} c={spec.concurrency}",
                                     refresh=False)
            self.bar.update(1)
            return
        if self.done % self.every and self.done != self.total:
            return
        el = time.time() - self.t0
        eta = el / self.done * (self.total - self.done)
        print(f"[sim] {self.done}/{self.total} cells, {el:.0f}s elapsed, ~{eta:.0f}s left "
              f"(last: {spec.setup} {spec.scenario} {spec.policy} c={spec.concurrency})",
              file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
