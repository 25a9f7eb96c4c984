"""The simulator's plots: goodput and speedup over plain decoding by
concurrency, one PNG per setup."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vllm_specplug.tools.sim.policies import POLICIES


STYLE = {"plain": ("black", "-"), "static-1": ("#9ecae1", "--"), "static-2": ("#6baed6", "--"),
         "static-4": ("#3182bd", "--"), "static-8": ("#08519c", "--"),
         "table": ("#31a354", "-."), "heuristic": ("#fd8d3c", ":"),
         "v2-av": ("#2c7fb8", "--"), "goodput-pinned": ("#e7298a", "-."),
         "goodput": ("#d62728", "-"), "oracle": ("#7f7f7f", ":")}


def plot(agg: dict, setups: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for setup, scens in agg.items():
        names = list(scens)
        fig, axes = plt.subplots(2, len(names), figsize=(3.6 * len(names), 6.4),
                                 squeeze=False, sharex=True)
        for j, scen in enumerate(names):
            by_c = scens[scen]
            cs = sorted(by_c)
            for pol in POLICIES:
                if not all(pol in by_c[c] for c in cs):
                    continue
                g = np.array([by_c[c][pol]["goodput"] for c in cs])
                plain = np.array([by_c[c]["plain"]["goodput"] for c in cs])
                color, ls = STYLE.get(pol, ("gray", "-"))
                lw = 2.2 if pol == "goodput" else 1.2
                axes[0, j].plot(cs, g, ls, color=color, lw=lw, label=pol, marker=".")
                axes[1, j].plot(cs, g / plain, ls, color=color, lw=lw, label=pol, marker=".")
            axes[0, j].set_title(scen)
            axes[0, j].set_xscale("log", base=2)
            axes[0, j].set_yscale("log")
            axes[1, j].axhline(1.0, color="black", lw=0.6)
            axes[1, j].set_xlabel("concurrency")
            axes[0, j].grid(alpha=0.3)
            axes[1, j].grid(alpha=0.3)
        axes[0, 0].set_ylabel("goodput (output tok/s)")
        axes[1, 0].set_ylabel("speedup vs plain")
        axes[0, -1].legend(fontsize=7, loc="best")
        fig.suptitle(setups[setup]["label"], fontsize=9)
        fig.tight_layout()
        path = out / f"{setup}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path.name)
    return files
