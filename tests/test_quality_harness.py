"""Smoke run of the quality harness: a few proxy problems through the real runtime."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_last_boxed():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from quality import last_boxed

    assert last_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed("no answer") is None


def test_harness_smoke(tiny_llama, tmp_path):
    """Plumbing only: a random tiny model answers nothing right, but every policy runs, budgets
    are matched per sequence, and the table is written."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "quality.py"), "--model-path", tiny_llama, "--n", "3",
         "--ratios", "0.25", "--size-min", "5", "--size-max", "6", "--policies", "none", "kara", "snapkv", "--window", "48", "--buffer", "8",
         "--chunk-budget", "4", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "quality.md").read_text()
    for policy in ("none", "kara", "snapkv"):
        assert f"| {policy} |" in table
    assert "/3 |" in table
    import json

    rows = {r["policy"]: r for r in json.loads((tmp_path / "quality.json").read_text())}
    # --match peak (default): the baseline never holds more generated KV than Kara's peak
    assert rows["snapkv"]["peak_kv"] <= rows["kara"]["peak_kv"] + 1


def test_proxy_model_solves_problems_with_full_kv(tmp_path):
    """The committed proxy, served by sgl_kara.Engine with full KV, answers held-out problems
    (regression check of the weights, its word-level tokenizer and the CPU serving path), and a
    compressing policy runs on it and reports the KV it kept."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "quality.py"), "--n", "3", "--size-min", "21",
         "--size-max", "23", "--ratios", "0.25", "--policies", "none", "kara", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    rows = {r["policy"]: r for r in json.loads((tmp_path / "quality.json").read_text())}
    assert rows["none"]["correct"] == 3 and rows["none"]["gen_len"] > 300
    assert rows["kara"]["n"] == 3 and rows["kara"]["peak_kv"] < rows["none"]["peak_kv"]
