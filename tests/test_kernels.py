"""Triton kernels and their torch references, each against an independent one: window scores
against a dense float64 softmax written here from Eq. 4's definition (docs/ARCHITECTURE.md,
"Policies"), compaction and slot copies bit for bit against their documented effect.

Without a GPU the kernels run in Triton's CPU interpreter. Triton reads TRITON_INTERPRET
when it is first imported (triton.language's helpers are jitted then), so it is set here
before anything imports triton; if triton was already imported without it in this
process, the guard below fails loudly instead of skipping.
"""

import math
import os
import sys

import pytest
import torch

_TRITON_PREIMPORTED = "triton" in sys.modules
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton.language as tl  # noqa: E402

from sgl_kara.kernels import (  # noqa: E402
    compact_kv,
    compact_kv_ref,
    copy_slots,
    copy_slots_ref,
    window_scores_paged,
    window_scores_paged_ref,
)
from sgl_kara.policies import select  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# Scores are sums of up to W * G probabilities; tolerance per input dtype. Low-precision
# inputs are exact when widened to fp32 (both paths accumulate in fp32), so only the
# summation order and exp() differ: ~3e-6 measured under the interpreter; the margin is
# for GPU MMA ordering and exp2 approximations.
TOL = {
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.bfloat16: dict(rtol=5e-4, atol=5e-5),
    torch.float16: dict(rtol=5e-4, atol=5e-5),
}


@pytest.fixture(autouse=True, scope="module")
def _interpreter_guard():
    # tl.zeros is itself @triton.jit'd when triton is imported; it must be interpreted too.
    if DEV == "cpu" and type(tl.zeros).__name__ != "InterpretedFunction":
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 was set "
            f"(pre-imported: {_TRITON_PREIMPORTED}); run with TRITON_INTERPRET=1"
        )


# --------------------------------------------------------------------------- window scores


def dense_window_scores(q, k_buffer, slots, scale=None):
    """Kara's window scores from their definition (Eq. 4, docs/ARCHITECTURE.md), in float64, one
    query head at a time: A[b, h, m] = sum over the query heads i of KV head h's group (i // (H_q /
    H_kv) == h) and the W window queries w of softmax_m(q[b, w, i] . k[slots[b, m], h] * scale),
    scale 1/sqrt(D). Written here, not taken from sgl_kara."""
    b, w, hq, d = q.shape
    hkv, m = k_buffer.shape[1], slots.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(b, hkv, m, dtype=torch.float64)
    qd, kd = q.double().cpu(), k_buffer.double().cpu()
    for bi in range(b):
        keys = kd[slots[bi].long().cpu()]  # [M, H_kv, D]
        for i in range(hq):
            h = i // (hq // hkv)
            logits = qd[bi, :, i] @ keys[:, h].T * scale  # [W, M]
            out[bi, h] += torch.softmax(logits, dim=-1).sum(dim=0)
    return out.float().to(q.device)


# (B, W, M, H_q, H_kv, D, dtype): every GQA combo over {1, 2, 4, 8} x D x dtype, with W
# and M not powers of two; a few edge cases first.
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SCORE_CASES = [
    (1, 37, 37, 1, 1, 64, torch.float32),  # U = 0: M == W
    (1, 16, 1, 4, 1, 64, torch.bfloat16),  # M = 1
    (1, 1, 33, 2, 2, 64, torch.float16),  # W = 1
    (2, 50, 100, 4, 2, 128, torch.float32),  # M > W, several key blocks
] + [
    (1 + i % 2, (37, 50)[(i // 2) % 2], (29, 45, 18)[i % 3], hq, hkv, d, DTYPES[i % 3])
    for i, (hq, hkv, d) in enumerate(
        (hq, hkv, d)
        for hq in (1, 2, 4, 8)
        for hkv in (1, 2, 4, 8)
        if hkv <= hq
        for d in (64, 128)
    )
]


@pytest.mark.parametrize("b,w,m,hq,hkv,d,dtype", SCORE_CASES)
def test_window_scores_paged(b, w, m, hq, hkv, d, dtype):
    gen = torch.Generator().manual_seed(w * m + hq + d)
    s = 3 * m + 5
    q = (torch.randn(b, w, hq, d, generator=gen) * 2).to(dtype).to(DEV)
    kb = (torch.randn(s, hkv, d, generator=gen) * 2).to(dtype).to(DEV)
    slots = torch.stack([torch.randperm(s, generator=gen)[:m] for _ in range(b)]).to(
        DEV
    )
    slots = slots.to(torch.int32 if b == 2 else torch.int64)
    want = dense_window_scores(q, kb, slots)
    out = window_scores_paged(q, kb, slots, use_triton=True)
    assert out.shape == (b, hkv, m) and out.dtype == torch.float32
    torch.testing.assert_close(out, want, **TOL[dtype])
    torch.testing.assert_close(
        window_scores_paged_ref(q, kb, slots), want, **TOL[dtype]
    )
    torch.testing.assert_close(
        window_scores_paged(q, kb, slots, use_triton=False), want, **TOL[dtype]
    )
    # each query's softmax sums to 1: a KV head receives W x its group's heads in all
    totals = torch.full((b, hkv), float(w * (hq // hkv)), device=DEV)
    torch.testing.assert_close(out.sum(-1), totals, rtol=1e-4, atol=1e-4)


def test_window_scores_paged_scale_and_default_dispatch():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 20, 2, 64, generator=gen).to(DEV)
    kb = torch.randn(40, 2, 64, generator=gen).to(DEV)
    slots = torch.arange(5, 25, device=DEV).view(1, 20)
    out = window_scores_paged(
        q, kb, slots, scale=0.05
    )  # None -> Triton (interpreter / CUDA)
    tol = TOL[torch.float32]
    torch.testing.assert_close(out, dense_window_scores(q, kb, slots, 0.05), **tol)
    torch.testing.assert_close(
        window_scores_paged_ref(q, kb, slots, 0.05),
        dense_window_scores(q, kb, slots, 0.05),
        **tol,
    )
    torch.testing.assert_close(  # the path without Triton, default scale 1/sqrt(D)
        window_scores_paged(q, kb, slots, use_triton=False),
        dense_window_scores(q, kb, slots),
        **tol,
    )
    assert not torch.allclose(out, dense_window_scores(q, kb, slots), **tol)


def test_window_scores_paged_validation():
    q = torch.randn(1, 8, 4, 64)
    kb = torch.randn(16, 2, 64)
    slots = torch.arange(8).view(1, 8)
    with pytest.raises(ValueError, match="dtype"):
        window_scores_paged(q, kb.to(torch.int8), slots)
    with pytest.raises(ValueError, match="head dim"):
        window_scores_paged(q, torch.randn(16, 2, 32), slots)
    with pytest.raises(ValueError, match="multiple"):
        window_scores_paged(q, torch.randn(16, 3, 64), slots)
    with pytest.raises(ValueError, match="slots"):
        window_scores_paged(q, kb, slots.float())
    with pytest.raises(ValueError, match="batch"):
        window_scores_paged(q, kb, torch.arange(8).view(2, 4))


# --------------------------------------------------------------------------- selection


# --------------------------------------------------------------------------- compaction


def _pools(n_layers, s, h, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32}[
        torch.empty(0, dtype=dtype).element_size()
    ]
    info = torch.iinfo(bits)

    def one():  # arbitrary bit patterns, NaN payloads included
        raw = torch.randint(
            info.min, info.max, (s, h, d), generator=gen, dtype=torch.int64
        )
        return raw.to(bits).view(dtype).to(DEV)

    return [one() for _ in range(n_layers)], [one() for _ in range(n_layers)]


def _bits_equal(xs, ys):
    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(xs, ys)
    )


COMPACT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
if hasattr(torch, "float8_e4m3fn"):
    COMPACT_DTYPES.append(torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", COMPACT_DTYPES)
@pytest.mark.parametrize(
    "b,n_layers,h,d,k", [(2, 3, 2, 64, 37), (1, 2, 1, 128, 5), (3, 1, 8, 64, 70)]
)
def test_compact_kv_bit_exact(dtype, b, n_layers, h, d, k):
    old = 2 * k + 3  # slots [0, old) hold the window, fresh slots come after
    s = old + b * k + 7
    kb, vb = _pools(n_layers, s, h, d, dtype, seed=k + h)
    gen = torch.Generator().manual_seed(k)
    src = (
        torch.stack(
            [
                torch.sort(torch.randperm(old, generator=gen)[:k]).values
                for _ in range(b * n_layers * h)
            ]
        )
        .view(b, n_layers, h, k)
        .to(DEV)
    )
    dst = (old + torch.randperm(b * k, generator=gen)).view(b, k).to(DEV)
    kr, vr = [t.clone() for t in kb], [t.clone() for t in vb]
    kc, vc = [t.clone() for t in kb], [t.clone() for t in vb]
    compact_kv(kb, vb, src, dst, use_triton=True)
    compact_kv_ref(kr, vr, src, dst)
    compact_kv(
        kc, vc, src, dst, use_triton=False
    )  # the path without Triton (CPU serving)
    assert _bits_equal(kb + vb, kr + vr)
    assert _bits_equal(kc + vc, kr + vr)
    # and the reference does what the docstring says
    kb0, _ = _pools(n_layers, s, h, d, dtype, seed=k + h)
    for layer_id in range(n_layers):
        for bi in range(b):
            for hi in range(h):
                assert torch.equal(
                    kr[layer_id][dst[bi], hi].view(torch.uint8),
                    kb0[layer_id][src[bi, layer_id, hi], hi].view(torch.uint8),
                )


def test_compact_kv_preconditions():
    kb, vb = _pools(2, 32, 2, 64, torch.float16, seed=0)
    src = torch.arange(8, device=DEV).view(1, 1, 1, 8).expand(1, 2, 2, 8).contiguous()
    if DEV == "cpu":
        with pytest.raises(ValueError, match="overlap"):
            compact_kv(kb, vb, src, torch.arange(4, 12).view(1, 8))
        with pytest.raises(ValueError, match="unique"):
            compact_kv(kb, vb, src, torch.full((1, 8), 20))
        with pytest.raises(ValueError, match="outside"):
            compact_kv(kb, vb, src, torch.arange(30, 38).view(1, 8))
    with pytest.raises(ValueError, match="src_slots"):
        compact_kv(kb, vb, src[:, :1], torch.arange(16, 24, device=DEV).view(1, 8))
    with pytest.raises(ValueError, match="int64"):
        compact_kv(kb, vb, src.int(), torch.arange(16, 24, device=DEV).view(1, 8))
    with pytest.raises(ValueError, match="layers"):
        compact_kv(kb, vb[:1], src, torch.arange(16, 24, device=DEV).view(1, 8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("h,d", [(2, 64), (8, 128), (3, 64)])
def test_copy_slots_bit_exact(dtype, h, d):
    kb, vb = _pools(3, 40, h, d, dtype, seed=h * d)
    kr, vr = [t.clone() for t in kb], [t.clone() for t in vb]
    src = torch.tensor([10, 11, 12, 13, 14], device=DEV)
    dst = torch.tensor([8, 9, 10, 11, 12], device=DEV)  # page-tail shift: overlaps src
    copy_slots(kb, vb, src, dst, use_triton=True)
    copy_slots_ref(kr, vr, src, dst)
    assert _bits_equal(kb + vb, kr + vr)
    kb0, _ = _pools(3, 40, h, d, dtype, seed=h * d)
    assert torch.equal(kr[1][8:13].view(torch.uint8), kb0[1][10:15].view(torch.uint8))


# --------------------------------------------------------------------------- pipeline


def test_score_select_compact_pipeline():
    """Paged scores -> select per (layer, kv head) -> compact, vs a dense torch path."""
    gen = torch.Generator().manual_seed(11)
    b, w, u, hq, hkv, d, n_layers = 2, 40, 8, 4, 2, 64, 2
    m = w - u
    s = b * w + b * 16 + 4
    kb, vb = _pools(n_layers, s, hkv, d, torch.float32, seed=5)
    kb = [torch.randn(s, hkv, d, generator=gen).to(DEV) for _ in range(n_layers)]
    qs = [torch.randn(b, w, hq, d, generator=gen).to(DEV) for _ in range(n_layers)]
    slots = torch.arange(b * w, device=DEV).view(b, w)[:, :m]
    idx = torch.stack(
        [
            select(
                window_scores_paged(qs[layer_id], kb[layer_id], slots).reshape(-1, m),
                0.4,
                4,
                5,
            ).view(b, hkv, -1)
            for layer_id in range(n_layers)
        ],
        dim=1,
    )
    ref_idx = torch.stack(
        [
            select(dense_window_scores(qs[layer_id], kb[layer_id], slots), 0.4, 4, 5)
            for layer_id in range(n_layers)
        ],
        dim=1,
    )
    assert torch.equal(idx, ref_idx)  # scores agree closely enough to pick the same set
    src = slots[:, None, None, :].expand(b, n_layers, hkv, m).gather(3, idx)
    dst = (b * w + torch.arange(b * idx.shape[-1], device=DEV)).view(b, -1)
    expect = [
        kb[layer_id][src[:, layer_id].transpose(1, 2), torch.arange(hkv, device=DEV)]
        for layer_id in range(n_layers)
    ]
    compact_kv(kb, vb, src, dst)
    for layer_id in range(n_layers):
        assert torch.equal(kb[layer_id][dst], expect[layer_id])
