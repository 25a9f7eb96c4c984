"""The served benchmark (``python -m vllm_specplug.tools.bench --served``): the report
on made-up runs, then the whole mode end to end on the tiny models: real
``vllm-specplug serve`` processes driven by vLLM's own ``vllm bench serve``.
Speed is not checked here; that is what the benchmark itself is for."""

import json
import math
import os
import statistics

import pytest

from vllm_specplug.tools.bench import served, served_report
from vllm_specplug.tools.bench.server import server_command
from vllm_specplug.tools.bench.served_client import per_request, raw_path
from vllm_specplug.tools.bench.served_grid import build_cells


def run(arm, tok_s, workload="humaneval", kind="c", c=1, texts=("a", "b")):
    return dict(setup="s", arm=arm, workload=workload, kind=kind, concurrency=c, rate=None,
                requests=len(texts), output_throughput=tok_s, mean_ttft_ms=10.0,
                texts=list(texts), tpots_ms=[1.0] * len(texts), output_lens=[4] * len(texts))


def test_report_ratios_misses_and_mismatches():
    runs = [run("plain", 10.0), run("vllm-k4", 16.0), run("adaptive", 15.0),
            run("plain", 20.0, c=4), run("vllm-k4", 12.0, c=4),
            run("adaptive", 18.0, c=4, texts=("a", "X")),
            run("plain", 8.0, kind="cold"), run("adaptive", 12.0, kind="cold"),
            run("plain", 11.0, kind="repeat"), run("adaptive", 14.0, kind="repeat")]
    res = served_report.summarise(runs, [], {"setups": {"s": "S"}},
                                  [dict(setup="s", arm="vllm-k2", cell=None, error="boom")])
    cells = {c["load"]: c for c in res["cells"]}
    assert cells["c=1"]["best_fixed"] == "vllm-k4"
    assert cells["c=1"]["adaptive_vs_best"] == pytest.approx(15 / 16)
    assert cells["c=4"]["best_fixed"] == "plain"
    assert cells["c=4"]["adaptive_vs_best"] == pytest.approx(18 / 20)
    assert [m["load"] for m in res["misses"]] == ["c=1", "c=4"]  # 0.9375 and 0.9 < 0.95
    (mm,) = res["mismatches"]
    assert (mm["arm"], mm["load"], mm["requests"], mm["explained"]) == ("adaptive", "c=4", [1], False)
    (cold,) = [c for c in res["cold"] if c["arm"] == "adaptive"]
    assert (cold["cold_tok_s"], cold["warm_tok_s"]) == (12.0, 15.0)
    assert {n["arm"]: round(n["spread"], 3) for n in res["noise"]} == {
        "plain": round(1 / 10.5, 3), "adaptive": round(1 / 14.5, 3)}
    md = served_report.markdown(dict(res, meta={"setups": {"s": "S"}, "output_tokens": {"s": 4},
                                                "dtype": {"s": "float32"}}))
    assert "MISSED: s humaneval c=1: 0.938 of vllm-k4" in md
    assert "FAILED: s vllm-k2 server start: boom" in md
    assert "NOT explained by a static arm" in md


def test_a_mismatch_a_static_arm_shares_is_explained():
    runs = [run("plain", 10.0), run("vllm-k2", 12.0, texts=("a", "X")),
            run("adaptive", 12.0, texts=("a", "X"))]
    res = served_report.summarise(runs, [], {"setups": {"s": "S"}})
    assert all(m["explained"] for m in res["mismatches"])


def test_rounds_pool_into_one_longer_run_and_keep_each_rounds_ratio():
    def r(arm, rnd, tokens, seconds, texts=("a", "b"), counts=None):
        return dict(run(arm, tokens / seconds, texts=texts), round=rnd, duration=seconds,
                    total_output_tokens=tokens, completed=2, failed=0, ttfts_ms=[5.0, 7.0],
                    spec_counts=counts)

    spec = dict(drafts=10.0, draft_tokens=40.0, accepted=30.0)
    runs = [r("plain", 1, 100, 10.0), r("vllm-k4", 1, 100, 5.0, counts=spec),
            r("adaptive", 1, 100, 4.0, counts=spec),
            r("adaptive", 2, 100, 20.0, texts=("a", "X"), counts=dict(spec, accepted=10.0)),
            r("vllm-k4", 2, 100, 10.0, counts=spec), r("plain", 2, 100, 10.0)]
    res = served_report.summarise(runs, [], {"setups": {"s": "S"}, "rounds": 2})
    (cell,) = res["cells"]
    # Pooled: 200 tokens over 24 s against 200 over 15 s, not the mean of 25 and 5 tok/s.
    assert cell["adaptive_vs_best"] == pytest.approx((200 / 24) / (200 / 15))
    assert cell["rounds"] == pytest.approx([25 / 20, 5 / 10])
    (adaptive,) = [x for x in res["runs"] if x["arm"] == "adaptive"]
    assert adaptive["completed"] == 4 and adaptive["acceptance"] == pytest.approx(40 / 80)
    assert len(res["runs_by_round"]) == 6
    # Texts are compared with plain's of the same round.
    (mm,) = res["mismatches"]
    assert (mm["arm"], mm["requests"]) == ("adaptive", [1])
    md = served_report.markdown(dict(res, meta={"setups": {"s": "S"}, "output_tokens": {"s": 4},
                                                "dtype": {"s": "float32"}, "rounds": 2}))
    assert "pools 2 rounds" in md and "| 1.25, 0.50 |" in md
    with pytest.raises(SystemExit, match="--rounds: 0"):
        served.parse_args(["--served", "--rounds", "0"])
    assert served.parse_args(["--served"]).waves == 2
    with pytest.raises(SystemExit, match="--waves: 0"):
        served.parse_args(["--served", "--waves", "0"])
    with pytest.raises(SystemExit, match="--cold-requests: 0"):
        served.parse_args(["--served", "--cold-requests", "0"])


def test_the_cold_run_takes_its_own_number_of_requests(tmp_path):
    cells = build_cells(served.SETUPS["tiny"], ["easy"], [1], False, tmp_path, None,
                        requests=2, cold_requests=5)
    assert [(c.kind, c.requests) for c in cells] == [("cold", 5), ("c", 2), ("repeat", 2)]
    # Disjoint prompts: the warm cell starts after the cold run's five.
    cold, warm = (open(c.path).read().splitlines() for c in cells[:2])
    assert len(cold) == 5 and not set(cold) & set(warm)


def test_each_round_is_compared_with_the_pooled_best_arm_and_gives_an_interval():
    def r(arm, rnd, tok_s):
        return dict(run(arm, tok_s), round=rnd, duration=100 / tok_s, total_output_tokens=100)

    rounds = [(10, 20, 19), (13, 12, 12), (10, 22, 20)]  # plain, vllm-k4, adaptive tok/s
    runs = [r(arm, i + 1, x) for i, xs in enumerate(rounds)
            for arm, x in zip(("plain", "vllm-k4", "adaptive"), xs)]
    res = served_report.summarise(runs, [], {"setups": {"s": "S"}, "rounds": 3})
    (cell,) = res["cells"]
    assert cell["best_fixed"] == "vllm-k4"
    # Round 2's plain was faster than its vllm-k4; the round still compares with vllm-k4,
    # the arm the pooled cell found best, not with whichever arm was luckiest that round.
    assert cell["rounds"] == pytest.approx([19 / 20, 12 / 12, 20 / 22])
    logs = [math.log(x) for x in cell["rounds"]]
    half = 2.920 * statistics.stdev(logs) / math.sqrt(3)  # t(0.95, 2 degrees of freedom)
    mean = statistics.fmean(logs)
    assert cell["interval"] == pytest.approx([math.exp(mean - half), math.exp(mean + half)])
    assert served_report.ratio_interval([0.9]) is None
    md = served_report.markdown(dict(res, meta={"setups": {"s": "S"}, "output_tokens": {"s": 4},
                                                "dtype": {"s": "float32"}, "rounds": 3}))
    lo, hi = cell["interval"]
    assert "90% interval |" in md and f"| {lo:.2f}-{hi:.2f} |" in md


def _finished_run(root, rounds, commit, arms=("plain", "adaptive")):
    """A made-up finished served run on disk: results.json and vLLM's raw files."""
    by_round = []
    for rnd, speeds in enumerate(rounds, 1):
        for arm, tok_s in zip(arms, speeds):
            rec = dict(run(arm, tok_s), round=rnd, duration=100 / tok_s, total_output_tokens=100)
            rec.pop("texts"), rec.pop("tpots_ms")
            by_round.append(rec)
            raw = raw_path(root, "s", arm, "humaneval/c1/c", rnd)
            raw.parent.mkdir(parents=True, exist_ok=True)
            raw.write_text(json.dumps(dict(itls=[[0.1, 0.1]] * 2, output_lens=[3, 3],
                                           ttfts=[0.5, 0.5], generated_texts=["a", "b"])))
    meta = {"setups": {"s": "S"}, "output_tokens": {"s": 4}, "dtype": {"s": "float32"},
            "rounds": len(rounds), "command": f"run {commit}", "commit": commit,
            "date": "2026-12-03", "wall_minutes": 1.0, "machine": "m", "vllm": "0.32.0"}
    servers = [dict(setup="s", arm=a, round=i + 1, ready_s=1.0, kv_tokens=10, rss_ready_gib=1.0)
               for i in range(len(rounds)) for a in arms]
    root.mkdir(parents=True, exist_ok=True)
    (root / "results.json").write_text(json.dumps(dict(meta=meta, servers=servers,
                                                       runs=by_round, runs_by_round=by_round)))
    return root


def test_pool_joins_the_rounds_of_finished_runs_into_one_report(tmp_path):
    a = _finished_run(tmp_path / "a", [(10, 12), (10, 11)], "aaa")
    b = _finished_run(tmp_path / "b", [(10, 9)], "bbb")
    out = tmp_path / "pooled"
    assert served.main(["--served", "--pool", str(a), str(b), "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["rounds"] == 3 and res["meta"]["commit"] == "aaa, bbb"
    assert sorted({r["round"] for r in res["runs_by_round"]}) == [1, 2, 3]
    (cell,) = res["cells"]
    assert cell["rounds"] == pytest.approx([1.2, 1.1, 0.9])
    assert cell["adaptive_vs_best"] == pytest.approx(300 / (100 / 12 + 100 / 11 + 100 / 9) / 10)
    assert "aaa, bbb" in (out / "results.md").read_text()
    # A pooled report renders again from its sources.
    assert served.main(["--served", "--render", str(out)]) == 0
    # Runs of different grids do not pool.
    c = _finished_run(tmp_path / "c", [(10, 12, 13)], "ccc", arms=("plain", "vllm-k4", "adaptive"))
    with pytest.raises(SystemExit, match="not of one grid"):
        served.pool([a, c], tmp_path / "bad")


def test_tpot_per_request_counts_tokens_not_stream_chunks():
    # With speculation a chunk carries several tokens: 9 tokens after the
    # first in 3 chunks 0.3 s apart is 0.1 s a token, not 0.3.
    raw = dict(itls=[[0.3, 0.3, 0.3], [0.2]], output_lens=[10, 3], ttfts=[0.5, 0.25],
               generated_texts=["a", "b"])
    got = per_request(raw)
    assert got["tpots_ms"] == pytest.approx([100.0, 100.0])
    assert got["ttfts_ms"] == pytest.approx([500.0, 250.0]) and got["texts"] == ["a", "b"]


def test_server_commands_run_vllm_as_users_do():
    setup = served.SETUPS["qwen"]
    argv, env = server_command(setup, "vllm-k4", "/t", "/d", 8000, 4)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "draft_model", "num_speculative_tokens": 4, "model": "/d"}
    assert "--scheduler-cls" not in argv and env == {"VLLM_PLUGINS": "none"}
    argv, env = server_command(setup, "adaptive", "/t", "/d", 8000, 4)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["num_speculative_tokens"] == setup.ceiling and env == {}
    assert argv[argv.index("--scheduler-cls") + 1] == "vllm_specplug.AdaptiveSpecScheduler"
    assert "trace_path" not in json.loads(argv[argv.index("--additional-config") + 1])["specplug"]
    argv, _ = server_command(setup, "adaptive", "/t", "/d", 8000, 4, "/x/trace.jsonl")
    assert json.loads(argv[argv.index("--additional-config") + 1])["specplug"]["trace_path"] == (
        "/x/trace.jsonl")
    # The plugin's own path at vLLM's K=2: the plugin loaded, its static policy.
    argv, env = server_command(setup, "plugin-k2", "/t", "/d", 8000, 4)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["num_speculative_tokens"] == 2 and env == {}
    assert argv[argv.index("--scheduler-cls") + 1] == "vllm_specplug.AdaptiveSpecScheduler"
    assert json.loads(argv[argv.index("--additional-config") + 1])["specplug"] == {
        "policy": "static", "static_k": 2}
    # ... and at K=0 on the speculative engine (vLLM's K stays the ceiling).
    argv, env = server_command(setup, "plugin-k0", "/t", "/d", 8000, 4)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["num_speculative_tokens"] == setup.ceiling and env == {}
    assert json.loads(argv[argv.index("--additional-config") + 1])["specplug"] == {
        "policy": "static", "static_k": 0}
    argv, _ = server_command(setup, "plain", "/t", "/d", 8000, 4)
    assert "--speculative-config" not in argv
    with pytest.raises(SystemExit, match="plain is required"):
        served.parse_args(["--served", "--arms", "adaptive"])


def test_served_mode_end_to_end_on_tiny_models(tmp_path):
    out = tmp_path / "served"
    import vllm.benchmarks.serve  # noqa: F401  (vLLM's import sets variables of its own)

    env_before = dict(os.environ)
    rc = served.main(["--served", "--setups", "tiny", "--workloads", "easy",
                      "--concurrency", "1", "--arms", "plain,adaptive", "--out", str(out),
                      "--tiny-root", str(tmp_path / "tiny")])
    # The servers get their settings; this process's environment is left alone.
    assert dict(os.environ) == env_before
    res = json.loads((out / "results.json").read_text())
    assert not res["failures"], res["failures"]
    assert rc == 0
    kinds = {(r["arm"], r["kind"]) for r in res["runs"]}
    assert kinds == {(a, k) for a in ("plain", "adaptive") for k in ("cold", "c", "repeat")}
    for r in res["runs"]:
        assert r["completed"] == r["requests"] and r["failed"] == 0
    # Greedy texts of the adaptive arm equal plain decoding's, request by request.
    assert res["mismatches"] == []
    (cell,) = res["cells"]
    assert cell["adaptive_vs_best"] > 0 and cell["best_fixed"] == "plain"
    adaptive = [r for r in res["runs"] if r["arm"] == "adaptive" and r["kind"] == "c"][0]
    assert adaptive["acceptance"] is not None  # it drafted, through vLLM's counters
    assert all(s["kv_tokens"] > 0 for s in res["servers"])
    assert (out / "results.md").is_file() and (out / "served-speedup-tiny.png").is_file()
    # The report is rebuilt from the run's files alone.
    (out / "results.md").unlink()
    assert served.main(["--served", "--render", str(out)]) == 0
    again = json.loads((out / "results.json").read_text())
    assert again["cells"] == res["cells"] and again["mismatches"] == []
    assert (out / "results.md").is_file()
