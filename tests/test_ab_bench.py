"""The interleaved A/B benchmark (tools/bench/ab.py): its statistics on
made-up waves, then the whole mode end to end on the tiny models (one
server, every arm per request, vLLM's own client)."""

import json

import pytest

from vllm_specplug.tools.bench import ab, ab_report


def waves(rates, tokens=64):
    return [dict(wave=i, total_output_tokens=tokens, duration=tokens / r)
            for i, r in enumerate(rates)]


def test_paired_ratio_pools_each_arm_and_cancels_a_drift_both_arms_share():
    # The host slows 1.5x over the run; arm a is 10% faster than b in every wave.
    drift = [1.0, 0.9, 0.8, 0.7, 0.667]
    a = waves([11 * d for d in drift])
    b = waves([10 * d for d in drift])
    r = ab_report.paired_ratio(a, b)
    assert r["ratio"] == pytest.approx(1.1, abs=1e-3)
    assert r["lo"] == pytest.approx(1.1, abs=1e-3) and r["hi"] == pytest.approx(1.1, abs=1e-3)
    assert r["waves"] == 5
    # Unpaired noise widens the interval around the pooled ratio.
    noisy = ab_report.paired_ratio(waves([11, 9, 12, 10]), waves([10, 10, 10, 10]))
    assert noisy["lo"] < noisy["ratio"] < noisy["hi"]
    assert ab_report.paired_ratio(a, []) == {}


def test_no_difference_check_reads_the_waves_where_adaptive_drafted_nothing(tmp_path):
    def run(arm, wave, rate, prefix):
        return dict(setup="s", arm=arm, workload="w", concurrency=4, repeat=False, wave=wave,
                    total_output_tokens=64, duration=64 / rate, request_id_prefix=prefix)

    runs = [run("plain", 0, 10, "ab-plain-0-"), run("adaptive", 0, 9.5, "ab-adaptive-0-"),
            run("plain", 1, 10, "ab-plain-1-"), run("adaptive", 1, 10.5, "ab-adaptive-1-"),
            run("plain", 2, 10, "ab-plain-2-"), run("adaptive", 2, 14, "ab-adaptive-2-")]
    plans = [{"ab-adaptive-0-0-x": 0, "ab-plain-0-0-x": 0}, {"ab-adaptive-1-0-x": 0},
             {"ab-adaptive-2-0-x": 0}, {"ab-adaptive-2-0-x": 3}]  # wave 2 drafted
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "s-ab-trace.jsonl").write_text("".join(
        json.dumps({"event": "plan", "requests": {f"cmpl-{r}": {"k": k} for r, k in p.items()}})
        + "\n" + json.dumps({"event": "verify", "requests": {}}) + "\n" for p in plans))
    marked = ab_report.mark_drafting(runs, tmp_path)
    assert [r.get("drafted") for r in marked] == [None, False, None, False, None, True]
    check = ab_report.null_check(marked)["s"]
    assert check["waves"] == 2 and check["mean"] == pytest.approx(1.0)
    assert check["lowest"] == pytest.approx(0.95) and check["highest"] == pytest.approx(1.05)
    # Without a trace nothing is marked and there is no check.
    assert ab_report.null_check(ab_report.mark_drafting(runs, tmp_path / "none")) == {}


def test_each_arm_sends_its_k_in_vllm_xargs_beside_the_grammar():
    argv = ["--model", "m", "--extra-body", json.dumps({"structured_outputs": {"json": {}}})]
    out = ab._with_xargs(argv, 4)
    body = json.loads(out[out.index("--extra-body") + 1])
    assert body == {"structured_outputs": {"json": {}}, "vllm_xargs": {"specplug_k": 4}}
    assert ab._with_xargs(["--model", "m"], None) == ["--model", "m"]  # adaptive: nothing set
    plain = ab._with_xargs(["--model", "m"], 0)
    assert json.loads(plain[-1]) == {"vllm_xargs": {"specplug_k": 0}}
    assert [a for a, _ in ab.arms_of("qwen")] == ["plain", "k2", "k4", "k8", "adaptive"]
    assert [a for a, _ in ab.arms_of("smollm-ngram")] == ["plain", "k2", "k4", "k6", "adaptive"]


def test_wave_orders_put_every_arm_after_every_other_and_at_every_place_alike():
    from collections import Counter

    for n in (2, 3, 4, 5):
        orders = ab.wave_orders(n)
        assert len(orders) == 2 * n and all(sorted(o) == list(range(n)) for o in orders)
        after = Counter((o[j], o[j + 1]) for o in orders for j in range(n - 1))
        assert set(after) == {(a, b) for a in range(n) for b in range(n) if a != b}
        assert len(set(after.values())) == 1
        assert set(Counter((a, o.index(a)) for o in orders for a in o).values()) == {2}
        # Two waves in a row: every arm's mean place is the middle one.
        for i in range(0, 2 * n, 2):
            assert {orders[i].index(a) + orders[i + 1].index(a) for a in range(n)} == {n - 1}


def test_ab_mode_end_to_end_on_tiny_models(tmp_path):
    import vllm.benchmarks.serve  # noqa: F401  (vLLM's import sets variables of its own)

    out = tmp_path / "ab"
    rc = ab.main(["--ab", "--setups", "tiny", "--workloads", "easy", "--concurrency", "1",
                  "--waves", "2", "--out", str(out), "--tiny-root", str(tmp_path / "tiny")])
    res = json.loads((out / "results.json").read_text())
    assert not res["failures"], res["failures"]
    assert rc == 0
    # Every arm ran every wave of the cell and of its repeat, in changing orders.
    seen = {(r["arm"], r["wave"], r["repeat"]) for r in res["runs"]}
    assert seen == {(a, w, rep) for a in ("plain", "k2", "adaptive") for w in (0, 1)
                    for rep in (False, True)}
    order = [r["arm"] for r in res["runs"] if not r["repeat"]]
    assert order[:3] != order[3:6] and sorted(order[:3]) == sorted(order[3:6])
    for r in res["runs"]:
        assert r["completed"] == 1 and r["failed"] == 0
        assert r["request_id_prefix"].startswith(f"ab-{r['arm']}-easy-c1-")
    assert res["null_check"] == {}  # no decision trace
    cell = res["cells"][0]
    assert cell["differs_from_plain"] == []  # one server, every arm, plain's greedy text
    assert set(cell["vs"]) == {"plain", "k2"} and cell["best_fixed"] == "k2"
    assert cell["vs"]["plain"]["lo"] <= cell["vs"]["plain"]["ratio"] <= cell["vs"]["plain"]["hi"]
    assert (out / "ab-ratios.png").is_file() and (out / "ab-speedup.png").is_file()
    assert "Repeatability" in (out / "results.md").read_text()
    (out / "results.md").unlink()
    assert ab.main(["--ab", "--render", str(out)]) == 0
    assert json.loads((out / "results.json").read_text())["cells"] == res["cells"]
