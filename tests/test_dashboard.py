"""The Grafana dashboard (``examples/grafana/vllm-specplug.json``), no engine.

It loads into Grafana's own dashboard model (``grafana-foundation-sdk``, generated
from Grafana's schema) with every field it sets kept; every query parses as far
as its series names go, and names only series the plugin or vLLM define.  That
a running server exports each of them is ``test_server.py``'s
``test_the_dashboard_queries_series_the_server_exports``.
"""

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "examples" / "grafana" / "vllm-specplug.json"
SERIES = re.compile(r"vllm:[a-z_]+")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queried_series(dash: dict | None = None) -> set[str]:
    dash = dash or dashboard()
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return {m for e in exprs for m in SERIES.findall(e)}


def _kept(mine, theirs, path="") -> list[str]:
    """Paths of ``mine`` that ``theirs`` lost or changed."""
    if isinstance(mine, dict):
        if not isinstance(theirs, dict):
            return [path]
        return [p for k, v in mine.items() for p in _kept(v, theirs.get(k), f"{path}.{k}")]
    if isinstance(mine, list):
        if not isinstance(theirs, list) or len(theirs) != len(mine):
            return [path]
        return [p for i, v in enumerate(mine) for p in _kept(v, theirs[i], f"{path}[{i}]")]
    return [] if mine == theirs else [path]


def test_the_dashboard_loads_into_grafanas_dashboard_model():
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    mine = dashboard()
    loaded = json.loads(JSONEncoder().encode(Dashboard.from_json(mine)))
    assert _kept(mine, loaded) == []
    # A field Grafana's model does not know is dropped: the check can fail.
    assert _kept({**mine, "panelz": []}, loaded) == [".panelz"]


def test_every_panel_has_a_query_and_the_series_are_the_plugins_or_vllms():
    from vllm_specplug import metrics

    dash = dashboard()
    assert dash["panels"] and all(p["targets"] for p in dash["panels"])
    ids = [p["id"] for p in dash["panels"]]
    assert len(set(ids)) == len(ids)
    source = Path(metrics.__file__).read_text()
    for name in queried_series(dash):
        base = re.sub(r"_total$", "", name)
        assert base.startswith(("vllm:specplug_", "vllm:spec_decode_", "vllm:generation_tokens")), name
        if base.startswith("vllm:specplug_"):
            assert f'"{base}"' in source, f"{name} is not a series metrics.py defines"
    wanted = {"vllm:specplug_request_steps_total", "vllm:specplug_steps_total",
              "vllm:specplug_requests_in_fallback", "vllm:specplug_estimated_acceptance",
              "vllm:specplug_probes_total", "vllm:spec_decode_num_accepted_tokens_total",
              "vllm:specplug_measured_step_seconds_total"}
    assert wanted <= queried_series(dash)
