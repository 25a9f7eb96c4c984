"""A simulator that drives the real controller at GPU scale.

No vLLM import: a step-cost model (``cost``: GPU passes priced from a table
measured on an H200, ``measured``; a roofline for devices without one; the
named devices and models in ``devices``, analysis over it in ``analysis``),
acceptance processes
and request sources (``scenarios``, ``trace``), a discrete-step engine
(``engine``; its policies in ``policies``, a cell's spec in ``cell``, running
one in ``run``), and the sweep (``sweep``), tables (``report``), plots (``plots``) and
provenance (``provenance``).
``python -m vllm_specplug.tools.sim --help`` runs it; ``benchmarks/SIMULATOR.md``
explains it.
"""

from vllm_specplug.tools.sim.cell import CellSpec
from vllm_specplug.tools.sim.policies import POLICIES
from vllm_specplug.tools.sim.run import record_trace, run_cell

__all__ = ["POLICIES", "CellSpec", "record_trace", "run_cell"]
