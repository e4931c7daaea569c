"""The torch_native CPU decode hook (sgl_kara/cpu_attention.py) is bit-identical to SGLang's own
``_run_sdpa_forward_decode`` on random pools, rows and lengths (GQA and MHA, float32 and
bfloat16, one request and many), reuses its slots within a forward and reads them anew after
``init_forward_metadata``; unsupported cases go to SGLang's path."""

from __future__ import annotations

import pytest
import torch

from sgl_kara.cpu_attention import reset_metadata_hook, run_sdpa_forward_decode


def _sglang_decode():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    fn = TorchNativeAttnBackend._run_sdpa_forward_decode
    return getattr(fn, "__wrapped__", fn)  # SGLang's own, whether or not the plugin hooked it


def _case(seed, batch, hq, hkv, d, dtype, max_len=300, slots=5000, rows=40):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, hkv, d, generator=g).to(dtype)
    v = torch.randn(slots, hkv, d, generator=g).to(dtype)
    req_to_token = torch.randint(1, slots, (rows, max_len + 8), generator=g, dtype=torch.int32)
    pool_idx = torch.randperm(rows, generator=g)[:batch]
    lens = torch.randint(1, max_len, (batch,), generator=g)
    q = torch.randn(batch, hq, d, generator=g).to(dtype)
    return q, k, v, req_to_token, pool_idx, lens


class _Backend:  # the instance state the hook keeps (SGLang's backend needs a model runner)
    pass


@pytest.mark.parametrize("batch, hq, hkv, d, dtype", [
    (1, 4, 4, 16, torch.float32),
    (7, 9, 3, 64, torch.float32),
    (16, 8, 2, 32, torch.bfloat16),
    (33, 4, 1, 64, torch.float32),
])
def test_bit_identical_to_sglang(batch, hq, hkv, d, dtype):
    original = _sglang_decode()
    q, k, v, rtt, idx, lens = _case(batch * 7 + d, batch, hq, hkv, d, dtype)
    kw = dict(scaling=d ** -0.5, enable_gqa=hq != hkv, causal=False)
    want = torch.empty_like(q)
    original(_Backend(), q, want, k, v, rtt, idx, lens, None, **kw)
    backend = _Backend()
    reset_metadata_hook(None, backend)
    for _ in range(3):  # layers of one forward share the slots
        got = torch.full_like(q, float("nan"))
        run_sdpa_forward_decode(original, backend, q, got, k, v, rtt, idx, lens, None, **kw)
        assert torch.equal(got, want)


def test_new_forward_reads_rows_anew():
    """After a compaction rewrites rows between steps, the next forward must not reuse slots."""
    original = _sglang_decode()
    q, k, v, rtt, idx, lens = _case(3, 5, 4, 2, 16, torch.float32)
    backend = _Backend()
    reset_metadata_hook(None, backend)
    out = torch.empty_like(q)
    run_sdpa_forward_decode(original, backend, q, out, k, v, rtt, idx, lens, None, scaling=0.25, enable_gqa=True)
    rtt[idx[0], : int(lens[0])] = torch.randint(1, k.shape[0], (int(lens[0]),), dtype=torch.int32)
    lens = lens.clone()  # SGLang hands each forward new length tensors
    reset_metadata_hook(None, backend)
    got, want = torch.empty_like(q), torch.empty_like(q)
    run_sdpa_forward_decode(original, backend, q, got, k, v, rtt, idx, lens, None, scaling=0.25, enable_gqa=True)
    original(_Backend(), q, want, k, v, rtt, idx, lens, None, scaling=0.25, enable_gqa=True, causal=False)
    assert torch.equal(got, want)


def test_unsupported_cases_take_sglang_path(monkeypatch):
    calls = []

    def original(*args, **kwargs):
        calls.append(kwargs.get("sliding_window_size"))
        return "sglang"

    q, k, v, rtt, idx, lens = _case(5, 2, 4, 2, 16, torch.float32)
    b = _Backend()
    assert run_sdpa_forward_decode(original, b, q, q, k, v, rtt, idx, lens, None, sliding_window_size=8) == "sglang"
    assert run_sdpa_forward_decode(original, b, q, q, k, v, rtt, idx, lens, lens) == "sglang"  # encoder lens
    monkeypatch.setenv("SGL_KARA_FAST_CPU_DECODE", "0")
    assert run_sdpa_forward_decode(original, b, q, q, k, v, rtt, idx, lens, None) == "sglang"
    assert len(calls) == 3
