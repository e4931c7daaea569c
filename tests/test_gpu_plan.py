"""The GPU suite's plan (tests/gpu_checks.py), checked without a GPU: under 10 minutes on one H100
by construction (engine starts and decode steps counted), every backend and both page sizes with
CUDA graphs on, a graphs-off run, vanilla references with the Kara run's own graph setting,
started once per configuration, and oracle margins that measure the evictions, not bf16."""

from __future__ import annotations

import types

import gpu_checks as gc
import pytest


def test_cuda_plan_fits_ten_minutes():
    checks = gc.plan(cpu=False)
    starts = sum(c[3] for c in checks)
    steps = sum(c[4] for c in checks)
    # docs/TESTING.md "The GPU checks": 7 identity checks x 2 starts + 2 oracles + 2 storms + 1
    # event-memory run; 7 x 192 + 2 x 150 + 2 x 240 + 200 decode steps.
    assert starts == 7 * 2 + 2 + 2 + 1 == 19, starts
    assert steps == 7 * 192 + 2 * 150 + 2 * 240 + 200 == 2324, steps
    bound = 19 * gc.START_S + 2324 * gc.STEP_S + 2 * gc.REFERENCE_S + gc.KERNELS_S
    assert gc.budget_seconds(checks) == pytest.approx(bound) == pytest.approx(536.48)
    assert gc.budget_seconds(checks) < 600, gc.budget_seconds(checks)
    identity = [c[2] for c in checks if c[1] == "token_identity"]
    assert {(b, p) for b, p, qs in identity if qs == "recompute"} == {
        (b, p) for b in gc.GPU_BACKENDS for p in (1, 64)
    }
    assert any(qs == "capture" for _, _, qs in identity)
    assert [c[0] for c in checks].count("kernels") == 1


class FakeEngine:
    def __init__(self, kind, opts, log):
        self.kind, self.opts = kind, opts
        graphs_off = opts.get(
            "disable_decode_cuda_graph", opts.get("kara_query_source") == "capture"
        )
        decode = types.SimpleNamespace(backend="disabled" if graphs_off else "full")
        self.server_args = types.SimpleNamespace(
            cuda_graph_config=types.SimpleNamespace(decode=decode)
        )
        log.append((kind, graphs_off, opts["attention_backend"], opts["page_size"]))

    def generate(self, prompts, params):
        meta = {"kara": {"compressions": 3}} if self.kind == "kara" else {}
        return [{"output_ids": [1, 2, 3], "meta_info": meta} for _ in prompts]

    def shutdown(self):
        pass


def test_vanilla_reference_has_the_kara_runs_graph_setting_and_starts_once(monkeypatch):
    log = []
    monkeypatch.setattr(
        gc, "start", lambda kind, model, **opts: FakeEngine(kind, opts, log)
    )
    monkeypatch.setattr(gc, "_VANILLA", {})
    for qs in ("recompute", "capture", "recompute"):
        r = gc.token_identity("m", "triton", 64, qs)
        assert r["identical"] and r["cuda_graphs"] == (qs == "recompute")
    vanilla = [e for e in log if e[0] == "sglang"]
    assert vanilla == [
        ("sglang", False, "triton", 64),
        ("sglang", True, "triton", 64),
    ], log
    assert len([e for e in log if e[0] == "kara"]) == 3


def test_oracle_margin_is_the_float32_one_and_beats_the_error():
    ok = dict(max_err=0.03, tol=0.06, margin=0.04, unmasked_control=0.5)
    assert gc._oracle_ok(ok)
    assert not gc._oracle_ok(
        {**ok, "unmasked_control": 0.05}
    )  # within twice the observed error
    assert not gc._oracle_ok({**ok, "max_err": 0.07})


def test_cuda_engines_capture_the_graph_sizes_the_start_bound_assumes(monkeypatch):
    """START_S assumes decode graphs up to 16 requests and prefill graphs up to 64 tokens
    (tests/test_gpu_resolution.py resolves these options with SGLang)."""
    monkeypatch.setattr(gc, "cuda", lambda: True)
    opts = gc.device_options("fa3", 64)
    assert opts["cuda_graph_max_bs_decode"] == gc.DECODE_GRAPH_MAX_BS == 16
    assert opts["cuda_graph_max_bs_prefill"] == gc.PREFILL_GRAPH_MAX_TOKENS == 64
