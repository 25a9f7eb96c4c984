"""Records the reference controller's decisions for ``tests/test_decision_equivalence.py``.

Run once; not part of the test run.  The reference is the pre-optimisation
controller (issue 49), a verbatim copy kept as ``tests/reference_controller``
until the file this writes replaced it.  It was recorded from commit ff123d4,
whose package still has what the copy's profile module imports
(``StepProfile``, ``prior_profile``, ``ProfileCorrection`` from
``vllm_specplug.controller.profile``); take both from there, and this script
and the test's input generators from the current checkout::

    mkdir /tmp/reference
    git archive ff123d4 vllm_specplug tests/reference_controller | tar -x -C /tmp/reference
    git show ad3b4f0 -- vllm_specplug/controller/profile.py | patch -p1 -d /tmp/reference
    patch -p1 -d /tmp/reference < tests/data/reference_pricing.patch
    patch -p1 -d /tmp/reference < tests/data/reference_passes.patch
    patch -p1 -d /tmp/reference < tests/data/reference_horizon.patch
    patch -p1 -d /tmp/reference < tests/data/reference_offsets.patch
    PYTHONPATH=/tmp/reference:/tmp/reference/tests python tests/data/record_reference.py

The patches give the reference the pricing rules added since: ``ad3b4f0``
(the first pass past its timed sizes grows at least at the catch-up's
slope), ``reference_pricing.patch`` (a plain decoding shape measured
lately keeps its own price; a decoding drafting step is corrected against
the convex curve its plan read), ``reference_passes.patch`` (drafting
steps keyed by their draft passes, each pass count at its own level
weighed against the common one), ``reference_horizon.patch`` (the tokens
left as finished requests' lengths say, and a lone new prompt that waits for
its batch: ``controller/horizon.py``, whose class it copies) and
``reference_offsets.patch`` (a drafting shape's residual one kept offset per
request band, none at one request), each written there in the reference's
own terms.  A later change of what a decision
prices goes into the reference the same way, so that the test keeps checking
only how the controller computes its decisions.

It writes ``tests/data/reference_decisions.npz`` (about 280 KiB): the seeded
random inputs the test builds (its generators are imported from it, so they
must still draw from their generators as they did), decided by the reference.
The test then asks the current controller for the same decisions.
"""

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent))  # after PYTHONPATH: the test module, not the reference's

import reference_controller as ref  # noqa: E402
import test_decision_equivalence as t  # noqa: E402

# The reference had a survival floor on candidate slots (1e-3); the
# controller's candidates are the slots whose survival is above 0.
ref.GoodputPolicy.MIN_SURVIVAL = 0.0
# The reference predates plain probes: nothing to switch off there.


def main() -> None:
    out = {}
    out.update(t.pack("goodput", [d for seed in t.GOODPUT_SEEDS
                                  for d in t.goodput_decisions(seed, ref)]))
    decisions, step, probed, stats, k_counts = [], [], [], [], []
    seed_at, k_at = [0], [0]
    for seed in t.TRAFFIC_SEEDS:
        steps, s = t.traffic(seed, ref)
        decisions += [d for _, d, _ in steps]
        step += [i for i, _, _ in steps]
        probed += [p for _, _, p in steps]
        seed_at.append(len(decisions))
        stats.append([getattr(s, name) for name in t.STATS])
        assert all(v == int(v) for v in stats[-1]), stats[-1]
        k_counts.append(np.asarray(s.k_counts, dtype=np.int64))
        k_at.append(k_at[-1] + k_counts[-1].size)
    out.update(t.pack("traffic", decisions))
    out.update({"traffic.step": np.array(step, dtype=np.int32),
                "traffic.probed": np.array(probed, dtype=bool),
                "traffic.seed_offsets": np.array(seed_at, dtype=np.int32),
                "traffic.stats": np.array(stats, dtype=np.int64),
                "traffic.k_counts": np.concatenate(k_counts),
                "traffic.k_counts_offsets": np.array(k_at, dtype=np.int32)})
    runs = [run for batch in t.BENCHMARK_BATCHES for run in t.benchmark_traffic(batch, ref)]
    out.update(t.pack("benchmark", [d for d, _, _ in runs]))
    out["benchmark.seconds"] = np.array([s for _, _, s in runs], dtype=np.float64)
    out["estimator"] = np.array(json.dumps([t.estimator_steps(seed, ref)
                                            for seed in t.ESTIMATOR_SEEDS]))
    path = HERE / "reference_decisions.npz"
    np.savez_compressed(path, **out)
    print(f"{path}: {path.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
