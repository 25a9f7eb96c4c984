"""The benchmark command, as a smoke test on tiny models (speed is not
checked here: that is what the benchmark itself is for)."""

import json

import pytest

from vllm_specplug.tools.bench import report
from vllm_specplug.tools.bench.runner import RunResult


def run(setup, workload, c, policy, tok_s, rep=0):
    return RunResult(setup=setup, workload=workload, concurrency=c, policy=policy, rep=rep,
                     tok_s=tok_s, wall_s=1.0, output_tokens=10, tpot_mean_s=0.1,
                     tpot_p90_s=0.2, accepted_len=1.0, drafted_per_step=0.0,
                     fallback_frac=1.0, engine_steps=10)


def test_report_ratios_and_targets():
    runs = [run("s", "hard", 1, "plain", 10), run("s", "hard", 1, "plain", 12),
            run("s", "hard", 1, "static-K2", 8), run("s", "hard", 1, "static-K4", 6),
            run("s", "hard", 1, "goodput", 10.5),
            run("s", "mixed", 1, "plain", 10), run("s", "mixed", 1, "static-K2", 12),
            run("s", "mixed", 1, "vllm-table", 11), run("s", "mixed", 1, "goodput", 13.5),
            run("s", "mixed", 4, "plain", 20), run("s", "mixed", 4, "static-K2", 20),
            run("s", "mixed", 4, "goodput", 18)]
    res = report.summarise(runs, {"setups": {"s": "S"}}, [])
    cells = {(c["workload"], c["concurrency"], c["policy"]): c for c in res["cells"]}
    hard = cells[("hard", 1, "goodput")]
    assert hard["x_plain"] == pytest.approx(10.5 / 11)  # median of the plain runs
    assert res["best_static"]["s/hard/1"] == "static-K2"
    assert hard["x_best_fixed"] == pytest.approx(10.5 / 11)
    assert cells[("mixed", 1, "goodput")]["x_best_static"] == pytest.approx(13.5 / 12)
    by_target = {(t["target"], t["workload"], t["concurrency"]): t for t in res["targets"]}
    assert by_target[(">= 0.95 x max(plain, best static K)", "hard", 1)]["ok"]
    assert not by_target[(">= 0.95 x max(plain, best static K)", "mixed", 4)]["ok"]
    beats = [t for t in res["targets"] if t["target"].startswith("mixed: beats")][0]
    assert beats["value"] == pytest.approx(13.5 / 12, abs=1e-3) and beats["ok"]
    never = [t for t in res["targets"] if t["target"].startswith("mixed: never")][0]
    assert never["value"] == pytest.approx(0.9) and not never["ok"]
    md = report.markdown(res)
    assert "MISSED" in md and "| hard | 1 |" in md


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory):
    from vllm_specplug.tools.bench.__main__ import main

    out = tmp_path_factory.mktemp("bench")
    rc = main(["--setups", "tiny", "--workloads", "easy,hard", "--concurrency", "1",
               "--repeats", "1", "--requests", "2", "--max-tokens", "16",
               "--policies", "plain,static,goodput", "--out", str(out),
               "--tiny-root", str(tmp_path_factory.mktemp("tiny"))])
    return rc, out


def test_bench_runs_end_to_end_and_checks_outputs(bench_out):
    rc, out = bench_out
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    policies = {c["policy"] for c in results["cells"]}
    assert policies == {"plain", "k0", "static-K1", "static-K2", "static-K4", "goodput"}
    assert not results["mismatches"]
    assert all(c["tok_s"] > 0 for c in results["cells"])
    assert (out / "speedup-tiny.png").stat().st_size > 0
    assert "goodput / max(plain, best static)" in (out / "results.md").read_text()


def test_bench_reports_a_mismatch_loudly(tmp_path, monkeypatch, bench_out):
    from vllm_specplug.tools.bench import __main__ as bench_main
    from vllm_specplug.tools.bench import runner

    real = runner.run_cell

    def corrupted(llm, prompts, c, speculative):
        r = real(llm, prompts, c, speculative)
        if speculative:
            r["outputs"][0] = r["outputs"][0][:-1] + [0]
        return r

    monkeypatch.setattr(bench_main, "run_cell", corrupted)
    rc = bench_main.main(["--setups", "tiny", "--workloads", "hard", "--concurrency", "1",
                          "--repeats", "1", "--requests", "1", "--max-tokens", "8",
                          "--policies", "plain,goodput", "--out", str(tmp_path),
                          "--tiny-root", str(tmp_path / "tiny")])
    assert rc == 1
    results = json.loads((tmp_path / "results.json").read_text())
    assert {m["policy"] for m in results["mismatches"]} == {"k0", "goodput"}


def test_mismatches_that_static_k_shares_are_told_apart_from_the_policys():
    # bfloat16 on an AVX-512-BF16 CPU: vLLM's own static K diverges from plain
    # greedy output at near ties, and every policy that verifies drafts with
    # it; that must not read as the adaptive policy's fault, and anything
    # else must.
    from vllm_specplug.tools.bench.__main__ import mark_static_k_mismatches

    def mm(policy, requests, rep=0, workload="prose"):
        return dict(setup="qwen", workload=workload, concurrency=1, policy=policy, rep=rep,
                    requests=requests)

    ms = [mm("static-K2", [0]), mm("static-K4", [0, 3]), mm("goodput", [0]),
          mm("goodput-no-zcf", [0, 3]), mm("goodput", [1], rep=1), mm("goodput", [2]),
          mm("k0", [0]), mm("goodput", [0], workload="code")]
    mark_static_k_mismatches(ms)
    assert [m["also_under_static_k"] for m in ms] == [
        True, True,   # static K's own
        True, True,   # every request also wrong under a static K, same cell and repeat
        False,        # another repeat: no static K diverged there
        False,        # a request no static K got wrong
        False,        # k0 verifies nothing: always the run's failure
        False]        # another workload


def test_mismatches_explained_by_static_k_are_one_note_not_an_alarm():
    from vllm_specplug.tools.bench.__main__ import numerics_note
    from vllm_specplug.tools.bench.setups import SETUPS

    ms = [dict(setup="qwen", workload="prose", concurrency=1, policy=p, rep=0, requests=[1],
               also_under_static_k=True) for p in ("static-K4", "goodput", "static-K2")]
    note = numerics_note(ms, [SETUPS["qwen"]])
    assert note.count("\n") == 0 and "MISMATCH" not in note
    assert "3 greedy output(s)" in note and "qwen prose c=1: goodput, static-K2, static-K4" in note
    assert "bfloat16" in note and "never how they are verified" in note


def test_the_adapter_cost_benchmark_runs(tmp_path):
    """benchmarks/adapter_cost.py end to end on two requests (its numbers are not checked)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "adapter_cost.py"
    out = subprocess.run([sys.executable, str(script), "--batches", "2", "--steps", "5",
                          "--warmup", "3", "--models", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "paired per-step sum" in out.stdout
    assert "    2  plugin |" in out.stdout


def _benchmark(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_confidence_replay_scores_the_kept_traces():
    """benchmarks/confidence_replay.py on the traces results/ keeps: the confidence's
    calibrated chance predicts better than the position's rate alone (log loss)."""
    replay = _benchmark("confidence_replay")
    import glob

    runs = replay.traces(sorted(glob.glob(str(replay.ROOT / "results" / "*" / "logs" /
                                              "*-trace.jsonl"))))
    assert runs, "no kept trace carries the draft's confidence"
    base = replay.score(runs, *replay.VARIANTS["default"])
    unused = replay.score(runs, *replay.VARIANTS["confidence unused"])
    assert base["drafts"] == unused["drafts"] > 0
    assert base["log_loss"] < unused["log_loss"]


def test_the_stop_replay_counts_steps_as_greedy_verification_does():
    """benchmarks/stop_replay.py: a draft at a position is accepted when it matches and every
    draft before it in the step did; the oracle drafts exactly the accepted run."""
    sr = _benchmark("stop_replay")
    cost = sr.Cost(plain_s=1.0, first_s=0.5, pass_s=0.25, scale=1.0)
    seq = {"match": [1, 1, 0, 1, 1, 1], "confidence": [0.99, 0.9, 0.2, 0.99, 0.99, 0.99]}
    # K=2: steps at 0 (2 accepted, 3 tokens), 3 (2, 3 tokens): 6 tokens in 2 steps of 1.75 s.
    assert sr.static([seq], 2, cost) == (6, 3.5)
    # Plain: one token a step.
    assert sr.static([seq], 0, cost) == (6, 6.0)
    # The oracle: 2 drafts (1.75 s), then 3 from position 3 (2.0 s; the sequence ends).
    assert sr.oracle([seq], 8, cost) == (6, 3.75)
    # Two requests at once: a step verifies both; the one that ends first leaves the other alone.
    other = {"match": [0, 0, 0], "confidence": [0.1, 0.1, 0.1]}
    assert sr.static([seq, other], 2, cost, concurrency=2) == (9, 5.25)
    # The oracle runs the batch's deepest request's passes.
    assert sr.oracle([seq, other], 8, cost, concurrency=2) == (9, 1.75 + 2.0 + 1.0)
    # The other signals stand in for the confidence, each 1 where the draft is sure.
    seq.update(margin=[0.5] * 6, entropy=[0.0] * 6)
    assert sr.with_signal(seq, "margin")["confidence"] == [0.5] * 6
    assert sr.with_signal(seq, "entropy")["confidence"] == [1.0] * 6
    assert sr.with_signal(seq, "confidence") is seq
    # AUC: 1 where every accepted draft is surer than every rejected one, a half for a tie.
    assert sr.auc([seq]) == 1.0 and sr.auc([{"match": [1, 0], "confidence": [0.5, 0.5]}]) == 0.5


def test_the_stop_replay_on_the_kept_sequences():
    """The kept real sequences (benchmarks/results/stop-replay-*): with the draft's confidence the
    plugin beats its history-only self and the best static K, and no policy beats the oracle."""
    import glob
    import json

    sr = _benchmark("stop_replay")
    paths = sorted(glob.glob(str(sr.Path(sr.__file__).parent / "results" / "stop-replay-*" /
                                 "sequences.jsonl")))
    assert paths, "no kept stop-replay sequences"
    seqs = [json.loads(line) for line in open(paths[-1]) if line.strip()]
    group = [s for s in seqs if s["workload"] == "humaneval"][:8]
    rates = sr.compare(group, sr.Cost(0.155, 0.036, 0.052, 1.0), None)
    best = max(v for k, v in rates.items() if k.startswith("static"))
    assert rates["plugin"] > max(best, rates["plugin, history only"])
    assert rates["oracle"] == max(rates.values())
    assert best < rates["plugin, calibrated in advance"] < rates["oracle"]


def test_the_validate_check_judges_starts_by_each_rule():
    """benchmarks/validate_check.py's table from raw samples (its engine starts need models)."""
    check = _benchmark("validate_check")
    starts = [{"plain": [0.30, 0.11, 0.10, 0.10, 0.12], "plain_price": 0.10,
               "wide": [0.20, 0.21, 0.20, 0.40, 0.20], "wide_price": 0.20}]
    rows = {(r["warmup"], r["repeats"], r["rule"]): r for r in check.analyse(starts)}
    cold = rows[(0, 1, "median")]
    assert cold["ratios"] == [3.0, 1.0] and not cold["kept_at"][0.4]
    warm = rows[(1, 3, "robust median (1.5x fastest)")]
    assert warm["ratios"] == [1.0, 1.025] and warm["kept_at"][0.1]
    assert (2, 5, "median") not in rows  # more samples than a start has
