"""A policy of one's own through the benchmark harnesses, nothing else edited: a ThresholdPolicy
subclass registered with ``@register`` in one file, named by ``--policy-file``, runs in the
long-answer harness and the real-LM quality harness on the tiny Llama, matched to Kara's trajectory
(its KV equals Kara's at every decode step: every request's final, peak and mean KV is Kara's
trajectory at its length). The harnesses run as their commands, in a process of their own, so the
test's own registry never holds the policy."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from support import run_module

from bench.reasoning import gsm8k
from sgl_kara.policies.trajectory import Schedule, trajectory

# The harnesses start engines: the integration tier (docs/TESTING.md, tiers).
pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "every-other"
POLICY = textwrap.dedent(
    f'''
    """Keeps every other entry of the region (a throwaway baseline)."""

    import torch

    from sgl_kara.policies.base import ScoreInput, register
    from sgl_kara.policies.threshold import ThresholdOptions, ThresholdPolicy


    @register
    class EveryOther(ThresholdPolicy):
        name = "{NAME}"
        prefix = "every_other_"
        Options = ThresholdOptions
        needs_queries = False

        def score(self, inp: ScoreInput) -> torch.Tensor:
            b, m = inp.slots.shape
            s = (torch.arange(m, device=inp.slots.device) % 2 == 0).float()
            return s.expand(b, inp.k_buffer.shape[1], m)
    '''
)
KARA = dict(window=32, buffer=8, period=4)


def _run(args, cwd):
    return run_module(args, cwd)


def test_a_policy_file_runs_in_both_harnesses_matched_to_kara(tiny_llama, tmp_path):
    assert NAME not in __import__("sgl_kara.policies", fromlist=["names"]).names()
    policy = tmp_path / "every_other.py"
    policy.write_text(POLICY)
    flags = [x for k, v in KARA.items() for x in (f"--{k}", str(v))]

    out = tmp_path / "long"
    _run(
        [
            "bench.reasoning.long_answers",
            "--policy-file",
            str(policy),
            "--model",
            tiny_llama,
            "--dtype",
            "float32",
            "--requests",
            "2",
            "--per-request",
            "3",
            "--instances",
            "0",
            "--problems",
            "6",
            "--omp-threads",
            "1",
            "--max-new-tokens",
            "120",
            "--configs",
            NAME,
            "--out",
            str(out),
            *flags,
        ],
        ROOT,
    )
    assert (out / f"{NAME}_r0.2.json.gz").exists()  # results are stored compressed
    res = gsm8k.load_result(str(out), f"{NAME}_r0.2")
    assert res["engine_options"]["kara_policy"] == NAME
    assert res["match"] == "trajectory"
    t = trajectory(Schedule(32, 8, 0.2, 4), res["max_new_tokens"])
    assert any(r["compressions"] > 0 for r in res["requests"])
    for r in res["requests"]:
        g = r["completion_tokens"]
        assert (r["kv_final"], r["kv_peak"]) == (t.final(g), t.peak_kv(g))
        assert r["kv_mean"] == pytest.approx(t.mean(g), abs=1e-9)
    assert f"{NAME} r 0.2 (trajectory-matched)" in (out / "long_answers.md").read_text()

    q = tmp_path / "quality"
    _run(
        [
            "bench.quality",
            "--real",
            "--policy-file",
            str(policy),
            "--model-path",
            tiny_llama,
            "--n",
            "2",
            "--new-tokens",
            "96",
            "--ratios",
            "0.25",
            "--policies",
            "none",
            NAME,
            "--match",
            "trajectory",
            "--show",
            "0",
            "--max-running",
            "2",
            "--out",
            str(q),
            *flags,
        ],
        ROOT,
    )
    rows = json.loads((q / "quality_real.json").read_text())["rows"]
    (row,) = [r for r in rows if r["policy"] == NAME]
    assert row["match"] == "trajectory"
    t = trajectory(Schedule(32, 8, 0.25, 4), 96)
    # the forced output has the same 96 tokens under every policy: Kara's KV exactly
    assert row["peak_kv"] == t.peak_kv(96)
    assert row["mean_kv"] == pytest.approx(t.mean(96), abs=1e-9)
