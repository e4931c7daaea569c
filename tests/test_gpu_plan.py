"""The GPU suite's plan (tests/gpu_checks.py), checked without a GPU: under 10 minutes on one H100
by construction (engine starts and decode steps counted), every backend and both page sizes with
CUDA graphs on, a graphs-off run, vanilla references with the Kara run's own graph setting,
started once per configuration, and oracle margins that measure the evictions, not bf16."""

from __future__ import annotations

import types

import gpu_checks as gc


def test_cuda_plan_fits_ten_minutes():
    checks = gc.plan(cpu=False)
    starts = sum(c[3] for c in checks)
    assert starts == 19, starts
    assert gc.budget_seconds(checks) < 600, gc.budget_seconds(checks)
    identity = [c[2] for c in checks if c[1] == "token_identity"]
    assert {(b, p) for b, p, qs in identity if qs == "recompute"} == {(b, p) for b in gc.GPU_BACKENDS for p in (1, 64)}
    assert any(qs == "capture" for _, _, qs in identity)
    assert [c[0] for c in checks].count("kernels") == 1


class FakeEngine:
    def __init__(self, kind, opts, log):
        self.kind, self.opts = kind, opts
        graphs_off = opts.get("disable_cuda_graph", opts.get("kara_query_source") == "capture")
        self.server_args = types.SimpleNamespace(disable_cuda_graph=graphs_off)
        log.append((kind, graphs_off, opts["attention_backend"], opts["page_size"]))

    def generate(self, prompts, params):
        meta = {"kara": {"compressions": 3}} if self.kind == "kara" else {}
        return [{"output_ids": [1, 2, 3], "meta_info": meta} for _ in prompts]

    def shutdown(self):
        pass


def test_vanilla_reference_has_the_kara_runs_graph_setting_and_starts_once(monkeypatch):
    log = []
    monkeypatch.setattr(gc, "start", lambda kind, model, **opts: FakeEngine(kind, opts, log))
    monkeypatch.setattr(gc, "_VANILLA", {})
    for qs in ("recompute", "capture", "recompute"):
        r = gc.token_identity("m", "triton", 64, qs)
        assert r["identical"] and r["cuda_graphs"] == (qs == "recompute")
    vanilla = [e for e in log if e[0] == "sglang"]
    assert vanilla == [("sglang", False, "triton", 64), ("sglang", True, "triton", 64)], log
    assert len([e for e in log if e[0] == "kara"]) == 3


def test_oracle_margin_is_the_float32_one_and_beats_the_error():
    ok = dict(max_err=0.03, tol=0.06, margin=0.04, unmasked_control=0.5)
    assert gc._oracle_ok(ok)
    assert not gc._oracle_ok({**ok, "unmasked_control": 0.05})  # within twice the observed error
    assert not gc._oracle_ok({**ok, "max_err": 0.07})
