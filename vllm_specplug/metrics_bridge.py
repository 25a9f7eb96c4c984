"""The plugin's series on ``/metrics`` of plain ``vllm serve``, with no set-up.

The controller's series live in vLLM's engine-core process; ``/metrics`` is
served by the API-server process, from its own default registry unless
``PROMETHEUS_MULTIPROC_DIR`` is set.  Without that variable nothing carries
the engine core's series across, and the routes vLLM offers do not either: a
stat-logger plugin only sees vLLM's fixed ``SchedulerStats`` fields, and
setting the variable from a plugin comes too late (prometheus_client is
imported by then) and would hide vLLM's own series.

So, only when ``PROMETHEUS_MULTIPROC_DIR`` is unset:

- the engine core, when it runs in a child process, writes a snapshot of its
  series (JSON, replaced atomically at each metrics flush) to
  ``<root>/<parent pid>/engine-<rank>-<pid>.json``;
- every process that loads the plugin (vLLM loads general plugins in its
  API server too) registers ``SnapshotCollector`` in the default registry,
  which serves the snapshots its own children wrote.  It declares no names
  (``describe`` is empty, and it has no ``_name``), so vLLM's clean-up of
  ``vllm:`` collectors leaves it alone, and snapshots of processes that no
  longer run are dropped.

``<root>`` is ``$VLLM_SPECPLUG_METRICS_DIR`` or ``<tmp>/vllm-specplug-metrics``.
With ``PROMETHEUS_MULTIPROC_DIR`` set (``vllm-specplug serve``, several API
servers) prometheus_client's own multiprocess mode carries the series and
this module does nothing.
"""

from __future__ import annotations

import glob
import json
import multiprocessing
import os
import tempfile

ENV_DIR = "VLLM_SPECPLUG_METRICS_DIR"


def snapshot_root() -> str:
    return os.environ.get(ENV_DIR) or os.path.join(tempfile.gettempdir(),
                                                   "vllm-specplug-metrics")


def active() -> bool:
    return not os.environ.get("PROMETHEUS_MULTIPROC_DIR")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SnapshotWriter:
    """Engine-core side: this process's series, for its parent's ``/metrics``."""

    def __init__(self, engine: str) -> None:
        self.dir = os.path.join(snapshot_root(), str(os.getppid()))
        self.path = os.path.join(self.dir, f"engine-{engine}-{os.getpid()}.json")

    @classmethod
    def for_this_process(cls, engine: str) -> "SnapshotWriter | None":
        """A writer where the bridge is needed: no multiprocess dir, a child process."""
        if not active() or multiprocessing.parent_process() is None:
            return None
        return cls(engine)

    def write(self, collectors) -> None:
        families = []
        for collector in collectors:
            for m in collector.collect():
                families.append({"name": m.name, "documentation": m.documentation,
                                 "type": m.type, "unit": m.unit,
                                 "samples": [[s.name, s.labels, s.value] for s in m.samples]})
        os.makedirs(self.dir, exist_ok=True)
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "families": families}, f)
        os.replace(tmp, self.path)


class SnapshotCollector:
    """API-server side: the snapshots this process's children wrote."""

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.metrics_core import Metric

        merged: dict[str, Metric] = {}
        for path in sorted(glob.glob(os.path.join(snapshot_root(), str(os.getpid()),
                                                  "engine-*.json"))):
            try:
                with open(path) as f:
                    snap = json.load(f)
            except (OSError, ValueError):
                continue  # being replaced, or gone
            if not _alive(int(snap.get("pid", 0))):
                try:
                    os.remove(path)
                except OSError:
                    pass
                continue
            for fam in snap.get("families", []):
                m = merged.get(fam["name"])
                if m is None:
                    m = merged[fam["name"]] = Metric(fam["name"], fam["documentation"],
                                                     fam["type"], fam.get("unit", ""))
                for name, labels, value in fam["samples"]:
                    m.add_sample(name, labels, value)
        return list(merged.values())


_REGISTERED: list[SnapshotCollector] = []


def register_collector() -> bool:
    """Serve children's snapshots from this process's default registry (once)."""
    if _REGISTERED or not active():
        return False
    from prometheus_client import REGISTRY

    collector = SnapshotCollector()
    REGISTRY.register(collector)
    _REGISTERED.append(collector)
    return True
