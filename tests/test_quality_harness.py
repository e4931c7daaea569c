"""Smoke run of the quality harness: a few proxy problems through the real runtime."""

import json
import os
import sys

import pytest

from conftest import run_bench


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_last_boxed():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from quality import last_boxed

    assert last_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed("no answer") is None


def test_harness_smoke(tiny_llama, tmp_path):
    """Plumbing only: a random tiny model answers nothing right, but every policy runs, budgets
    are matched per sequence, the fidelity pass feeds the full-KV output through every policy
    (exactly reproduced by full KV itself), and the table is written."""
    run_bench("quality.py", "--model-path", tiny_llama, "--n", "3",
              "--ratios", "0.25", "--size-min", "5", "--size-max", "6", "--policies", "none", "kara", "snapkv", "--window", "48", "--buffer", "8",
              "--chunk-budget", "4", "--fidelity-n", "3", "--out", str(tmp_path))
    table = (tmp_path / "quality.md").read_text()
    assert table.startswith("command: ") and "\ndate: 20" in table and "\nmachine: " in table
    for policy in ("none", "kara", "snapkv"):
        assert f"| {policy} |" in table
    assert "/3 |" in table
    import json

    rows = {r["policy"]: r for r in json.loads((tmp_path / "quality.json").read_text())}
    # --match peak (default): the baseline never holds more generated KV than Kara's peak
    assert rows["snapkv"]["peak_kv"] <= rows["kara"]["peak_kv"] + 1
    # fidelity: full KV forced along its own output agrees with itself; every policy was measured
    # on all forced tokens (the harness raises if a forced output differs from full KV's)
    assert rows["none"]["agree"] >= 0.99 and rows["none"]["kl"] < 1e-4
    gen_tokens = round(rows["none"]["gen_len"] * 3)
    for policy in ("kara", "snapkv"):
        assert rows[policy]["fid_tokens"] == gen_tokens and 0 <= rows[policy]["agree"] <= 1
        assert rows[policy]["kl"] >= 0
    assert "next-token agreement" in table


@pytest.mark.slow
def test_proxy_model_solves_problems_with_full_kv(tmp_path):
    """The committed proxy, served by sgl_kara.Engine with full KV, answers held-out problems
    (regression check of the weights, its word-level tokenizer and the CPU serving path), and a
    compressing policy runs on it and reports the KV it kept."""
    run_bench("quality.py", "--n", "3", "--size-min", "21",
              "--size-max", "23", "--ratios", "0.25", "--policies", "none", "kara", "--fidelity-n", "0",
              "--out", str(tmp_path))
    import json

    rows = {r["policy"]: r for r in json.loads((tmp_path / "quality.json").read_text())}
    assert rows["none"]["correct"] == 3 and rows["none"]["gen_len"] > 300
    assert rows["kara"]["n"] == 3 and rows["kara"]["peak_kv"] < rows["none"]["peak_kv"]


@pytest.mark.slow
def test_real_model_path_runs_a_math_jsonl(tmp_path):
    """Plumbing of the GPU path (--jsonl, boxed-answer pass@1) end to end on a tiny MATH-500-style
    file with the proxy: it cannot write \\boxed{}, so nothing is correct, but every problem is
    generated under the --max-new-tokens cap and scored by the boxed-answer checker."""
    import json

    data = tmp_path / "math.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"problem": "What is $1+1$?", "answer": "2", "unique_id": "a"},
        {"problem": "Compute $\\frac{6}{3}$.", "answer": "2", "unique_id": "b"},
        {"problem": "Unused third line", "answer": "0"},
    ]) + "\n")
    out = tmp_path / "out"
    run_bench("quality.py", "--jsonl", str(data), "--n", "2",
              "--max-new-tokens", "48", "--ratios", "0.5", "--policies", "none", "kara", "--window", "16",
              "--buffer", "4", "--fidelity-n", "0", "--out", str(out))
    rows = {r["policy"]: r for r in json.loads((out / "quality.json").read_text())}
    for policy in ("none", "kara"):
        assert rows[policy]["n"] == 2 and rows[policy]["correct"] == 0
        assert all(g <= 48 for g in rows[policy]["per_problem"]["gen_len"])


def test_real_lm_mode_smoke(tiny_llama, tmp_path):
    """bench/quality.py --real on 2 prompts (a tiny model stands in for SmolLM2): full-KV output,
    Kara and a budget-matched baseline fed that output, the table, JSON and free generations;
    then a second run on the kept record (--ref-dir) adds a row without Kara, and --merge joins
    the two runs."""
    common = ["--real", "--model-path", tiny_llama, "--n", "2", "--new-tokens", "64", "--ratios", "0.25",
              "--window", "24", "--buffer", "4", "--period", "4", "--max-running", "2", "--ref-dir", str(tmp_path / "ref")]
    run_bench("quality.py", *common, "--policies", "none", "kara", "streaming", "--show", "1", "--out", str(tmp_path))
    out = json.loads((tmp_path / "quality_real.json").read_text())
    rows = {r["policy"]: r for r in out["rows"]}
    assert set(rows) == {"kara", "streaming"}
    for r in rows.values():
        assert r["tokens"] == 2 * 64 and 0 <= r["agree"] <= 1 and r["kl"] >= 0 and r["ppl"] >= 1
    # budget matching: the baseline's peak generated KV is Kara's (within the decode step it triggers at)
    assert rows["streaming"]["peak_kv"] <= rows["kara"]["peak_kv"] + 1
    assert len(out["texts"]["none"]) == 1 and len(out["texts"]["kara_0.25"]) == 1
    real_md = (tmp_path / "quality_real.md").read_text()
    assert "| kara | 0.25 |" in real_md and "\ndate: 20" in real_md and "\nmachine: " in real_md
    # The record is reused (no second full-KV run) and Kara's peaks from the first run set the
    # baseline's budgets: the same row again, from a run without Kara.
    again = run_bench("quality.py", *common, "--policies", "none", "streaming", "--show", "0", "--out", str(tmp_path / "b"))
    assert "reusing the record" in again.stdout
    (row,) = json.loads((tmp_path / "b" / "quality_real.json").read_text())["rows"]
    assert {k: row[k] for k in ("agree", "kl", "peak_kv", "shared_prefix")} == \
        {k: rows["streaming"][k] for k in ("agree", "kl", "peak_kv", "shared_prefix")}
    # Equal mean KV (KV-token-steps): the baseline's measured mean is Kara's (the budget rule's
    # simulated trajectory is the runtime's).
    run_bench("quality.py", *common, "--policies", "none", "streaming", "--match", "mean", "--show", "0",
              "--out", str(tmp_path / "c"))
    (mean_row,) = json.loads((tmp_path / "c" / "quality_real.json").read_text())["rows"]
    assert mean_row["match"] == "mean"
    assert abs(mean_row["mean_kv"] - rows["kara"]["mean_kv"]) <= 2, (mean_row["mean_kv"], rows["kara"]["mean_kv"])
    run_bench("quality.py", "--real", "--merge", str(tmp_path / "quality_real.json"),
              str(tmp_path / "b" / "quality_real.json"), str(tmp_path / "c" / "quality_real.json"),
              "--out", str(tmp_path / "m"))
    merged = json.loads((tmp_path / "m" / "quality_real.json").read_text())["rows"]
    assert [(r["policy"], r["ratio"], r.get("match")) for r in merged] == \
        [("kara", 0.25, None), ("streaming", 0.25, None), ("streaming", 0.25, "mean")]
    assert "| streaming (mean-matched) | 0.25 |" in (tmp_path / "m" / "quality_real.md").read_text()
    # Paired comparison from the per-step files: every prompt has 64 steps, so the mean over
    # prompts of the per-prompt differences is the table's difference.
    sys.path.insert(0, os.path.join(ROOT, "bench", "quality"))
    from paired import compare

    cmp = compare(str(tmp_path / "ref"), "kara_0.25", "streaming_0.25")
    assert cmp["n"] == 2
    assert cmp["agree"][0] == pytest.approx(rows["kara"]["agree"] - rows["streaming"]["agree"], abs=1e-12)
    assert cmp["kl"][0] == pytest.approx(rows["kara"]["kl"] - rows["streaming"]["kl"], abs=1e-9)
    assert cmp["agree"][1] <= cmp["agree"][0] <= cmp["agree"][2]


@pytest.mark.slow
def test_real_lm_free_only_on_a_kept_record(tiny_llama, tmp_path):
    """--free-only: free generations alone, on a kept record (Kara's stored peaks budget the
    baseline), no rows."""
    common = ["--real", "--model-path", tiny_llama, "--n", "2", "--new-tokens", "64", "--ratios", "0.25",
              "--window", "24", "--buffer", "4", "--period", "4", "--max-running", "2", "--ref-dir", str(tmp_path / "ref")]
    run_bench("quality.py", *common, "--policies", "none", "kara", "--show", "0", "--out", str(tmp_path))
    run_bench("quality.py", *common, "--policies", "none", "kara", "streaming", "--free-only", "--show", "2",
              "--out", str(tmp_path / "f"))
    free = json.loads((tmp_path / "f" / "quality_real.json").read_text())
    assert free["rows"] == [] and [len(free["texts"][k]) for k in ("none", "kara_0.25", "streaming_0.25")] == [2, 2, 2]


def test_threshold_mean_kv_counts_the_runtime_trajectory():
    """The mean-matching budget rule: the simulated trajectory is 0, 1, .., C_max + 1, then back
    to N + 1 after each event; budget_for_mean is the smallest N reaching a mean."""
    sys.path.insert(0, os.path.join(ROOT, "bench", "quality"))
    from real_lm import budget_for_mean, threshold_mean_kv

    assert threshold_mean_kv(10**6, 5, 11) == sum(range(11)) / 11  # never triggers
    # N=2, gap=2 (C_max=4): lengths 0 1 2 3 4 5 | 3 4 5 | 3 4 5
    assert threshold_mean_kv(2, 2, 12) == (0 + 1 + 2 + 3 + 4 + 5 + 3 + 4 + 5 + 3 + 4 + 5) / 12
    for target in (100.0, 177.4, 300.0):  # above the floor's mean (76.9)
        n = budget_for_mean(target, 112, 999, 24)
        assert threshold_mean_kv(n, 112, 999) >= target > threshold_mean_kv(n - 1, 112, 999)
    assert budget_for_mean(1.0, 112, 999, 24) == 24  # the floor


def test_real_lm_teacher_forced_text_recall_and_stopping_smoke(tiny_llama, tmp_path):
    """The three workloads of --real on a tiny model, 2 items each (one policy each: budget
    matching is the other smoke test's): teacher-forced Python source (full KV reads the text:
    its forced output is the text, its row has agreement 1 and the text's PPL; the random policy
    is scored on every step), recall (scored on the recalled values only) and stopping (free
    generation with EOS allowed, compared with full KV's answers)."""
    common = ["--real", "--model-path", tiny_llama, "--n", "2", "--ratios", "0.25",
              "--window", "24", "--buffer", "4", "--period", "4", "--max-running", "2"]
    run_bench("quality.py", *common, "--new-tokens", "96", "--text", "python", "--policies", "none", "random",
              "--out", str(tmp_path / "text"))
    out = json.loads((tmp_path / "text" / "quality_real.json").read_text())
    rows = {r["policy"]: r for r in out["rows"]}
    assert set(rows) == {"none", "random"}
    assert rows["none"]["agree"] == 1 and rows["none"]["tokens"] == 2 * 96 and rows["none"]["ppl"] > 1
    r = rows["random"]
    assert r["tokens"] == 2 * 96 and 0 <= r["agree"] <= 1 and 0 <= r["hit"] <= 1 and r["ppl"] > 1
    assert 0 < r["mean_kv"] < r["peak_kv"] < 96  # compressed in Kara's windows
    assert "| none | - |" in (tmp_path / "text" / "quality_real.md").read_text()

    run_bench("quality.py", *common, "--new-tokens", "200", "--recall", "--facts", "2", "--policies", "none", "kara",
              "--out", str(tmp_path / "recall"))
    rows = {r["policy"]: r for r in json.loads((tmp_path / "recall" / "quality_real.json").read_text())["rows"]}
    sys.path.insert(0, os.path.join(ROOT, "bench", "quality"))
    from transformers import AutoTokenizer

    import workloads

    items = workloads.recall_problems(2, 200, 2, AutoTokenizer.from_pretrained(tiny_llama))
    scored = sum(len(p["score_steps"]) for p in items)
    assert scored >= 2 * 2 * 2  # every recalled code (4 digits, at least 2 tokens here)
    for p in items:  # the scored tokens are the stated values, repeated after the filler
        values = [p["target"][t] for t in p["score_steps"]]
        assert p["distance"] > 0 and all(v in p["target"][: p["score_steps"][0] - p["distance"]] for v in values)
    for r in rows.values():
        assert r["scored_tokens"] == scored and 0 <= r["hit_scored"] <= 1 and r["kl_scored"] >= 0
    assert rows["none"]["agree_scored"] == 1

    run_bench("quality.py", *common, "--stopping", "--new-tokens", "64", "--policies", "none", "kara",
              "--out", str(tmp_path / "stop"))
    rows = json.loads((tmp_path / "stop" / "quality_stopping.json").read_text())["rows"]
    assert [r["policy"] for r in rows] == ["none", "kara"]
    assert all(r["n_prompts"] == 2 for r in rows)
    full = rows[0]
    assert full["n_stop"] == 0 or (full["still_stops"] == 1 and full["length_ratio"] == 1 and full["identical"] == 1)


def test_stopping_compare_counts_against_full_kv():
    """--stopping's statistics from hand-made outputs: prompts 0-2 stop with full KV (lengths
    100, 50, 10), prompt 3 runs to the limit 200; the policy stops at 105 (with full), runs away
    on prompt 1, stops early at 5 on prompt 2."""
    sys.path.insert(0, os.path.join(ROOT, "bench", "quality"))
    from stopping import compare

    def out(n, reason, ids=None):
        return {"meta_info": {"completion_tokens": n, "finish_reason": {"type": reason}}, "output_ids": ids or [n]}

    full = [out(100, "stop"), out(50, "stop"), out(10, "stop"), out(200, "length")]
    policy = [out(105, "stop"), out(200, "length"), out(5, "stop"), out(200, "length")]
    r = compare(full, policy, 200)
    assert (r["n_stop"], r["n_prompts"]) == (3, 4)
    assert r["still_stops"] == pytest.approx(2 / 3) and r["ends_with_full"] == pytest.approx(1 / 3)
    assert r["runaway"] == pytest.approx(1 / 3) and r["runaway_all"] == 0.5
    assert r["length_ratio"] == pytest.approx((1.05 + 4 + 0.5) / 3)
    assert r["extra_tokens"] == pytest.approx((5 + 150 - 5) / 3) and r["identical"] == 0
    same = compare(full, full, 200)
    assert same["still_stops"] == same["ends_with_full"] == same["identical"] == 1 and same["runaway"] == 0
