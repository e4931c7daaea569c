"""Several retentions in one engine (``--ratios``): each request's KV follows Kara's trajectory at
its own r (the per-request retention took effect), and answers at r 0.2 asked again beside the
sweep equal those of an engine of their own (``--check-from``); the variants under trial
(bench/policies/) run through the same command at Kara's KV. On the tiny Llama, through the
harness's command."""

from __future__ import annotations

import json
import os

import pytest
from support import run_module

from bench.reasoning import gsm8k
from sgl_kara.policies.trajectory import Schedule, trajectory

pytestmark = pytest.mark.integration  # engines of their own (docs/TESTING.md, tiers)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KARA = dict(window=32, buffer=8, period=4)
VARIANTS = ("kara_redundancy.py", "kara_structure.py", "kara_global.py")


def _harness(out, *flags, configs=("kara",)):
    argv = [
        *("--dtype", "float32", "--requests", "2", "--per-request", "3"),
        *("--instances", "0", "--problems", "6", "--omp-threads", "1"),
        *("--max-new-tokens", "120", "--out", str(out)),
        *(x for k, v in KARA.items() for x in (f"--{k}", str(v))),
        *flags,
        *("--configs", *configs),
    ]
    run_module(["bench.reasoning.long_answers", *argv], ROOT)


def test_ratios_share_one_engine_and_each_follows_its_own_trajectory(
    tiny_llama, tmp_path
):
    alone, shared = tmp_path / "alone", tmp_path / "shared"
    _harness(alone, "--model", tiny_llama)
    _harness(
        shared,
        *("--model", tiny_llama, "--ratios", "0.3", "0.6"),
        *("--check-from", str(alone), "--check-requests", "2"),
    )
    for r in (0.3, 0.6):
        res = gsm8k.load_result(str(shared), f"kara_r{r:g}")
        assert res["engine_options"]["kara_retention"] == r
        t = trajectory(Schedule(32, 8, r, 4), res["max_new_tokens"])
        assert any(q["compressions"] > 0 for q in res["requests"])
        for q in res["requests"]:
            assert q["custom"] == {"retention": r}
            g = q["completion_tokens"]
            assert (q["kv_final"], q["kv_peak"]) == (t.final(g), t.peak_kv(g))
        sessions = res["sessions"]
        assert sessions and all("shared_with" in s for s in sessions)
    check = json.loads((shared / "batching-check.json").read_text())["kara_r0.2"]
    assert check["requests"] == [0, 1]
    assert check["same_text"] == [0, 1], check


@pytest.mark.slow
@pytest.mark.harness  # bench-only policies: run before recording their results
def test_the_variants_under_trial_hold_karas_kv_and_answer_alike_together(
    tiny_llama, tmp_path
):
    """Each variant in an engine of its own holds Kara's KV at every step; Kara and the variants
    that change only the region or the score, answered in one engine (``--together``), give
    each the answers of its own engine."""
    files = [os.path.join(ROOT, "bench", "policies", f) for f in VARIANTS]
    names = [f.removesuffix(".py") for f in VARIANTS]
    alone, together = tmp_path / "alone", tmp_path / "together"
    policy_files = [x for f in files for x in ("--policy-file", f)]
    _harness(
        alone,
        *("--model", tiny_llama, "--ratio", "0.3", *policy_files),
        configs=["kara", *names],
    )
    t = trajectory(Schedule(32, 8, 0.3, 4), 120)
    for name in names:
        res = gsm8k.load_result(str(alone), f"{name}_r0.3")
        assert any(q["compressions"] > 0 for q in res["requests"])
        for q in res["requests"]:
            g = q["completion_tokens"]
            assert (q["kv_final"], q["kv_peak"]) == (t.final(g), t.peak_kv(g))
    mixed = ["kara", "kara_redundancy", "kara_global"]
    _harness(
        together,
        *("--model", tiny_llama, "--ratio", "0.3", "--together", *policy_files),
        *("--check-from", str(alone), "--check-requests", "1"),
        configs=mixed,
    )
    for tag, name in enumerate(mixed):
        res = gsm8k.load_result(str(together), f"{name}_r0.3")
        assert res["engine_options"]["together"]["kara_together_variants"] == (
            "kara_redundancy,kara_global"
        )
        assert [q["custom"] for q in res["requests"]] == [
            {"retention": round(0.3 + tag * 1e-4, 6)}
        ] * 2
        mine = _answers(together, f"{name}_r0.3")
        assert mine == _answers(alone, f"{name}_r0.3"), name
        assert any(q["compressions"] > 0 for q in res["requests"])
    check = json.loads((together / "batching-check.json").read_text())["kara_r0.3"]
    assert check["same_text"] == [0], check


def _answers(out, name: str) -> dict:
    from bench.reasoning.long_answers import answer_texts

    return answer_texts(str(out), name)


@pytest.mark.slow
@pytest.mark.harness
def test_threshold_baselines_answer_alike_together(tiny_llama, tmp_path):
    """R-KV and SnapKV matched to Kara, answered in one engine (``--together``): each gives the
    answers and the KV of its own engine; the first asked at another r beside them (the batching
    check) answers as its own engine at that r."""
    alone, together = tmp_path / "alone", tmp_path / "together"
    base = ["rkv", "snapkv"]
    _harness(alone, *("--model", tiny_llama, "--ratio", "0.3"), configs=base)
    _harness(alone, *("--model", tiny_llama, "--ratio", "0.6"), configs=["rkv"])
    _harness(
        together,
        *("--model", tiny_llama, "--ratio", "0.3", "--together"),
        *("--check-from", str(alone), "--check-ratio", "0.6", "--check-requests", "1"),
        configs=base,
    )
    t = trajectory(Schedule(32, 8, 0.3, 4), 120)
    for tag, name in enumerate(base):
        res = gsm8k.load_result(str(together), f"{name}_r0.3")
        assert res["engine_options"]["together"]["kara_policy"] == "threshold_together"
        spec = [q["custom"]["match_kara"]["retention"] for q in res["requests"]]
        assert spec == [round(0.3 + tag * 1e-4, 6)] * 2
        assert _answers(together, f"{name}_r0.3") == _answers(alone, f"{name}_r0.3")
        assert any(q["compressions"] > 0 for q in res["requests"])
        for q in res["requests"]:
            g = q["completion_tokens"]
            assert (q["kv_final"], q["kv_peak"]) == (t.final(g), t.peak_kv(g))
    check = json.loads((together / "batching-check.json").read_text())["rkv_r0.6"]
    assert check["same_text"] == [0], check
