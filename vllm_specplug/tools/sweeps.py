"""Run the independent cells of a sweep as Ray tasks.

The simulator's sweeps (setups x scenarios x policies x concurrency x seeds)
are embarrassingly parallel: every cell is a pure function of its spec
(``sim.run.run_cell``), with all randomness seeded from the spec.  With
``--ray`` they run as Ray tasks, on a local Ray cluster started for the run
(and stopped after it), or with ``--ray-address HOST:PORT`` on a cluster
that is already running.  Results come back in the order of the specs and
are identical to the serial run's.

Code on the cluster: a local cluster's workers use this interpreter and its
packages.  On an existing cluster the ``vllm_specplug`` package of this
checkout is shipped with the job (Ray's ``runtime_env`` ``py_modules``), so
every node runs the same controller code as the driver whatever is installed
there; the nodes need only Ray and NumPy.

Ray is optional: ``pip install 'vllm-specplug[ray]'``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Sequence

LOCAL = "local"


class RayUnavailable(RuntimeError):
    pass


def _import_ray():
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailable(
            "--ray needs Ray: pip install 'vllm-specplug[ray]' (or pip install ray)") from exc
    return ray


def _call(fn, item):
    # A Ray task must be a function; ``fn`` may be any picklable callable.
    return fn(item)


def ray_map(fn: Callable[[Any], Any], items: Sequence[Any], address: str | None = None,
            num_cpus: int | None = None, on_result: Callable[[int], None] | None = None,
            resources: dict | None = None) -> list[Any]:
    """``[fn(x) for x in items]`` as Ray tasks, in the order of ``items``.

    ``address``: ``None`` or ``"local"`` starts a local cluster for this call
    (``num_cpus`` CPUs, default all) and stops it after; ``"auto"`` or
    ``HOST:PORT`` joins a running cluster, which is left running.  A Ray
    session already initialised in this process is used as it is.
    ``on_result(i)`` is called as each item finishes (progress).
    ``resources``: what each task holds (Ray's ``num_cpus`` / ``num_gpus``;
    default one CPU).
    """
    ray = _import_ray()
    started = False
    if not ray.is_initialized():
        common = dict(include_dashboard=False, logging_level=logging.WARNING,
                      log_to_driver=True, configure_logging=True)
        if address in (None, LOCAL):
            # Loopback only: nothing here needs to be reachable from outside.
            ray.init(num_cpus=num_cpus, _node_ip_address="127.0.0.1", **common)
        else:
            import vllm_specplug

            package = os.path.dirname(os.path.abspath(vllm_specplug.__file__))
            ray.init(address=address, runtime_env={"py_modules": [package]}, **common)
        started = True
    try:
        remote = ray.remote(**(resources or {"num_cpus": 1}))(_call)
        refs = [remote.remote(fn, x) for x in items]
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(items)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                i = index[ref]
                results[i] = ray.get(ref)
                if on_result is not None:
                    on_result(i)
        return results
    finally:
        if started:
            ray.shutdown()
