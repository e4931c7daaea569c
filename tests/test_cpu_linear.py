"""sgl_kara/cpu_linear.py (opt-in SGL_KARA_PACKED_CPU_LINEAR): decode-sized float32 matmuls on a
prepacked oneDNN weight equal F.linear within float rounding, everything else is F.linear itself,
and in an engine the hooks cover every weight matmul of the model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from sgl_kara import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch has no oneDNN linear")


@pytest.mark.parametrize("rows", [3, 4, 8, 13, 16, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 96, generator=g) * 0.05
    b = torch.randn(300, generator=g) if with_bias else None
    x = torch.randn(rows, 96, generator=g)
    assert cpu_linear.takes_packed(x, w)
    got, want = cpu_linear.linear(x, w, b), F.linear(x, w, b)
    assert got.shape == want.shape == (rows, 300) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_outside_the_rule_it_is_f_linear_itself():
    """1-2 rows (MKL streams the weights once already), more than 64 (prefill), other dtypes,
    3-D inputs and trainable weights take F.linear: bit-identical."""
    w = torch.randn(64, 32)
    for x in (torch.randn(1, 32), torch.randn(2, 32), torch.randn(65, 32), torch.randn(2, 4, 32)):
        assert not cpu_linear.takes_packed(x, w)
        assert torch.equal(cpu_linear.linear(x, w), F.linear(x, w))
    xb, wb = torch.randn(8, 32, dtype=torch.bfloat16), w.bfloat16()
    assert not cpu_linear.takes_packed(xb, wb) and torch.equal(cpu_linear.linear(xb, wb), F.linear(xb, wb))
    assert not cpu_linear.takes_packed(torch.randn(8, 32), torch.nn.Parameter(w))  # requires_grad
    assert cpu_linear.PACKED_ROWS == (3, 64)


def test_packed_copy_is_made_once_and_renewed_when_the_weight_changes():
    w = torch.randn(40, 16)
    first = cpu_linear.packed_weight(w)
    assert cpu_linear.packed_weight(w) is first
    x = torch.randn(4, 16)
    with torch.no_grad():
        w.mul_(2.0)  # a reload writes weights in place
    assert cpu_linear.packed_weight(w) is not first
    torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def _original(calls):
    def original(owner, *args, **kwargs):
        calls.append((args, kwargs))
        return "sglang's own"
    return original


def test_linear_apply_hook_takes_the_packed_path_only_for_its_rows():
    layer = SimpleNamespace(weight=torch.randn(48, 24))
    calls = []
    x = torch.randn(5, 24)
    bias = torch.randn(48)
    out = cpu_linear.linear_apply_hook(_original(calls), object(), layer, x, bias)
    torch.testing.assert_close(out, F.linear(x, layer.weight, bias), rtol=1e-5, atol=1e-5)
    assert calls == []
    assert cpu_linear.linear_apply_hook(_original(calls), object(), layer, torch.randn(1, 24)) == "sglang's own"
    assert len(calls) == 1


def test_lm_head_hook_takes_only_sglangs_plain_matmul_branch():
    proc = SimpleNamespace(use_fp32_lm_head=False, rl_on_policy_target=None)
    head = SimpleNamespace(weight=torch.randn(100, 24))
    h = torch.randn(6, 24)
    calls = []
    got = cpu_linear.lm_head_hook(_original(calls), proc, h, head)
    torch.testing.assert_close(got, h @ head.weight.T, rtol=1e-5, atol=1e-5)
    assert calls == []
    lora = SimpleNamespace(weight=head.weight, set_lora=None, apply_lora=None)
    for args, kwargs, p in [((h, lora), {}, proc),  # LoRA-wrapped
                            ((h, head, torch.randn(100)), {}, proc),  # embedding bias
                            ((h, head), {"out": torch.empty(6, 100)}, proc),  # caller-owned buffer
                            ((h, head), {}, SimpleNamespace(use_fp32_lm_head=True, rl_on_policy_target=None)),
                            ((h, head), {}, SimpleNamespace(use_fp32_lm_head=False, rl_on_policy_target="x")),
                            ((torch.randn(2, 24), head), {}, proc)]:  # two rows: MKL's own path
        assert cpu_linear.lm_head_hook(_original(calls), p, *args, **kwargs) == "sglang's own"
    assert len(calls) == 6


def test_engine_with_packed_linear_matches_and_packs_every_weight(tiny_llama, tmp_path):
    """One engine with SGL_KARA_PACKED_CPU_LINEAR=1, one without, the same four greedy requests
    decoded together (4 rows: the packed path): every weight matmul of the model got a packed copy
    (qkv, o, gate_up, down per layer + the lm_head; none without the flag) and the output
    log-probabilities agree within float rounding."""
    from conftest import start_engine

    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(4)]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    runs = {}
    for flag in ("1", "0"):
        trace = tmp_path / f"trace_{flag}.jsonl"
        saved = {k: os.environ.get(k) for k in ("SGL_KARA_PACKED_CPU_LINEAR", "SGL_KARA_TRACE")}
        os.environ.update(SGL_KARA_PACKED_CPU_LINEAR=flag, SGL_KARA_TRACE=str(trace))
        try:
            engine = start_engine("kara", tiny_llama, kara_policy="none", max_total_tokens=2048)
            try:
                outs = engine.generate(prompts, params, return_logprob=True)
            finally:
                engine.shutdown()
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        steps = [json.loads(line) for line in trace.read_text().splitlines()]
        runs[flag] = (outs, max(s["packed_weights"] for s in steps), max(s["running"] for s in steps))
    (packed, n_packed, running), (plain, n_plain, _) = runs["1"], runs["0"]
    layers = json.loads((Path(tiny_llama) / "config.json").read_text())["num_hidden_layers"]
    assert running == 4 and n_packed == 4 * layers + 1 and n_plain == 0
    for a, b in zip(packed, plain):
        la = [lp for lp, *_ in a["meta_info"]["output_token_logprobs"]]
        lb = [lp for lp, *_ in b["meta_info"]["output_token_logprobs"]]
        assert len(la) == len(lb) == 24
        assert a["output_ids"][:8] == b["output_ids"][:8]  # greedy: no flip this early at 1e-6
        n = next((i for i, (x, y) in enumerate(zip(a["output_ids"], b["output_ids"])) if x != y), 24)
        assert max(abs(x - y) for x, y in zip(la[:n], lb[:n])) < 1e-4
