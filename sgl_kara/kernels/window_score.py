"""Kara window scores read straight from the paged key pool (Eq. 4).

Shapes and strides
    q        [B, W, H_q, D]   contiguous, fp32 / bf16 / fp16; queries of the window
    k_buffer [S, H_kv, D]     one layer's key pool, last dim contiguous, fp32 / bf16 / fp16
                              (may differ from q's: --kv-cache-dtype other than --dtype; the
                              dot products then run in fp32)
    slots    [B, M]           int32 / int64, pool slot of each compressible key
    lse      [B, H_q, W]      float32 workspace (pass 1 -> pass 2)
    out      [B, H_kv, M]     float32, contiguous
    H_q % H_kv == 0; query head j reads kv head j // (H_q // H_kv).
    D a power of two (64, 128, ...); W and M arbitrary (masked).

Two passes, no [W, M] matrix in global memory:
    pass 1  grid (B * H_q, cdiv(W, BLOCK_W)):  lse[b, j, w] = logsumexp_m(s[w, m])
    pass 2  grid (B * H_kv, cdiv(M, BLOCK_M)): out[b, h, m] = sum_{j in h, w} exp(s - lse)
    with s = scale * q[b, w, j] . k_buffer[slots[b, m], h].
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._dispatch import aligned, interpret_mode, want_triton

# Upper bound on the elements of one [B, H_q, w_chunk, M] logits block (torch reference).
_SCORE_BLOCK_ELEMS = 1 << 24

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# Integer arguments that vary with the region and the query span (W: a window, its buffer, or a
# spread chunk; M and the slots' row stride with a threshold policy's region) are not
# specialised, and the block sizes are fixed: one compiled kernel per dtype pair, head dim and
# GQA group, whatever the shapes an event brings (scheduler/warm_up.py compiles it at start-up).
_VARYING = ["W", "M", "stride_qb", "stride_sb"]
BLOCK_W = 32
BLOCK_M = 64


@triton.jit(do_not_specialize=_VARYING)
def _lse_kernel(
    q_ptr,
    k_ptr,
    slots_ptr,
    lse_ptr,
    W,
    M,
    H_Q,
    GROUP,
    scale,
    stride_qb,
    stride_qw,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_sb,
    FP32_DOT: tl.constexpr,
    D: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b = (pid_bh // H_Q).to(tl.int64)
    j = pid_bh % H_Q
    h = j // GROUP
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    w_ok = offs_w < W
    offs_d = tl.arange(0, D)
    q = tl.load(
        q_ptr
        + b * stride_qb
        + offs_w[:, None] * stride_qw
        + j * stride_qh
        + offs_d[None, :],
        mask=w_ok[:, None],
        other=0.0,
    )
    m_i = tl.full([BLOCK_W], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_W], tl.float32)
    slots_b = slots_ptr + b * stride_sb
    for m0 in range(0, M, BLOCK_M):
        # s [BLOCK_W, BLOCK_M] = scale * q @ K[slots[m0:m0+BLOCK_M], h]^T; masked keys -> -inf
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        slot = tl.load(slots_b + offs_m, mask=m_ok, other=0).to(tl.int64)
        k = tl.load(
            k_ptr + slot[:, None] * stride_ks + h * stride_kh + offs_d[None, :],
            mask=m_ok[:, None],
            other=0.0,
        )
        if FP32_DOT:
            s = tl.dot(
                q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee"
            )
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(m_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m_i = m_new
    lse = m_i + tl.log(l_i)
    tl.store(lse_ptr + (b * H_Q + j) * W + offs_w, lse, mask=w_ok)


@triton.jit(do_not_specialize=_VARYING)
def _colsum_kernel(
    q_ptr,
    k_ptr,
    slots_ptr,
    lse_ptr,
    out_ptr,
    W,
    M,
    H_Q,
    H_KV,
    GROUP,
    scale,
    stride_qb,
    stride_qw,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_sb,
    FP32_DOT: tl.constexpr,
    D: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b = (pid_bh // H_KV).to(tl.int64)
    h = pid_bh % H_KV
    m0 = tl.program_id(1) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    slots_b = slots_ptr + b * stride_sb
    m_ok = offs_m < M
    slot = tl.load(slots_b + offs_m, mask=m_ok, other=0).to(tl.int64)
    k = tl.load(
        k_ptr + slot[:, None] * stride_ks + h * stride_kh + offs_d[None, :],
        mask=m_ok[:, None],
        other=0.0,
    )
    kt = tl.trans(k)  # [D, BLOCK_M], loaded once, reused for every query block
    acc = tl.zeros([BLOCK_M], tl.float32)
    for g in range(0, GROUP):
        j = h * GROUP + g
        for w0 in range(0, W, BLOCK_W):
            offs_w = w0 + tl.arange(0, BLOCK_W)
            w_ok = offs_w < W
            q = tl.load(
                q_ptr
                + b * stride_qb
                + offs_w[:, None] * stride_qw
                + j * stride_qh
                + offs_d[None, :],
                mask=w_ok[:, None],
                other=0.0,
            )
            lse = tl.load(
                lse_ptr + (b * H_Q + j) * W + offs_w, mask=w_ok, other=float("inf")
            )
            if FP32_DOT:
                s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = tl.where(m_ok[None, :], s * scale, float("-inf"))
            p = tl.exp(
                s - lse[:, None]
            )  # masked rows: exp(s - inf) = 0; masked keys: exp(-inf) = 0
            acc += tl.sum(p, axis=0)
    tl.store(out_ptr + (b * H_KV + h) * M + offs_m, acc, mask=m_ok)


def window_scores(
    q: torch.Tensor, k: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Bidirectional window attention received by each compressible key (Eq. 4).

    q: [B, W, H_q, D]  queries of every window token.
    k: [B, M, H_kv, D] keys of the compressible region (M = W - U).
    Returns A: [B, H_kv, M] float32 = sum over the W queries and the H_q / H_kv
    query heads of kv head h (query head j -> kv head j // (H_q // H_kv)) of
    softmax_M(q . k * scale). No causal mask. scale defaults to 1/sqrt(D).
    """
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"q and k must be 4-D, got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    b, w, hq, d = q.shape
    bk, m, hkv, dk = k.shape
    if bk != b or dk != d:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on B or D"
        )
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"H_q ({hq}) must be a multiple of H_kv ({hkv})")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    g = hq // hkv
    out = torch.zeros(b, hkv, m, dtype=torch.float32, device=q.device)
    if m == 0 or w == 0:
        return out
    kf = k.float()
    step = max(1, _SCORE_BLOCK_ELEMS // max(1, b * hq * m))
    for w0 in range(0, w, step):
        qc = q[:, w0 : w0 + step].float().reshape(b, -1, hkv, g, d)
        logits = torch.einsum("bwhgd,bmhd->bhgwm", qc, kf) * scale
        out += torch.softmax(logits, dim=-1).sum(dim=(2, 3))
    return out


def window_scores_paged_ref(q, k_buffer, slots, scale=None):
    """Torch reference, same signature and result as `window_scores_paged`."""
    return window_scores(q, k_buffer[slots.long()], scale)


def _check(q, k_buffer, slots):
    if q.dim() != 4 or k_buffer.dim() != 3 or slots.dim() != 2:
        raise ValueError(
            f"expected q [B, W, H_q, D], k_buffer [S, H_kv, D], slots [B, M]; got "
            f"{tuple(q.shape)}, {tuple(k_buffer.shape)}, {tuple(slots.shape)}"
        )
    b, _, hq, d = q.shape
    _, hkv, dk = k_buffer.shape
    if dk != d:
        raise ValueError(f"head dim mismatch: q D={d}, k_buffer D={dk}")
    if slots.shape[0] != b:
        raise ValueError(f"slots batch {slots.shape[0]} != q batch {b}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"H_q ({hq}) must be a multiple of H_kv ({hkv})")
    if q.dtype not in _DTYPES or k_buffer.dtype not in _DTYPES:
        raise ValueError(
            f"q and k_buffer dtypes must each be one of {_DTYPES}; "
            f"got {q.dtype}, {k_buffer.dtype}"
        )
    if slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be int32 or int64, got {slots.dtype}")
    if q.device != k_buffer.device or q.device != slots.device:
        raise ValueError("q, k_buffer and slots must be on the same device")


def fp32_dot_needed(q_dtype, k_dtype, interpret: bool) -> bool:
    """Whether the scoring kernels widen both operands to fp32 before the dot."""
    return (
        q_dtype != k_dtype
        or q_dtype == torch.float32
        or (interpret and torch.bfloat16 in (q_dtype, k_dtype))
    )


def window_scores_paged(q, k_buffer, slots, scale=None, use_triton=None):
    """Kara scores [B, H_kv, M] float32 = policies.kara.window_scores(q, k_buffer[slots]).

    q [B, W, H_q, D] contiguous; k_buffer [S, H_kv, D]; slots [B, M] int32/int64.
    use_triton None: Triton on CUDA or under TRITON_INTERPRET=1, else torch reference.
    """
    _check(q, k_buffer, slots)
    if not want_triton(use_triton, q, pow2_dim=q.shape[-1], min_dim=16):
        return window_scores_paged_ref(q, k_buffer, slots, scale)
    b, w, hq, d = q.shape
    hkv = k_buffer.shape[1]
    m = slots.shape[1]
    if not q.is_contiguous():
        raise ValueError("q must be contiguous [B, W, H_q, D]")
    if k_buffer.stride(2) != 1:
        raise ValueError("k_buffer last dim must be contiguous")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.zeros(b, hkv, m, dtype=torch.float32, device=q.device)
    if b == 0 or w == 0 or m == 0:
        return out
    q, slots = aligned(q), aligned(slots)
    lse = torch.empty(b, hq, w, dtype=torch.float32, device=q.device)
    block_w, block_m = BLOCK_W, BLOCK_M
    # fp32 inputs: exact-fp32 dot (no tf32). Mixed q / key dtypes (a KV cache dtype other than the
    # model's): both widened to fp32, exact for every pair (bf16 / fp16 products are exact in
    # fp32). The CPU interpreter multiplies bf16 operands as their raw uint16 bits (triton 3.x
    # InterpreterBuilder.create_dot), so widen them there too; this only changes summation order.
    fp32_dot = fp32_dot_needed(q.dtype, k_buffer.dtype, interpret_mode())
    common = (w, m, hq)
    strides = (
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_buffer.stride(0),
        k_buffer.stride(1),
        slots.stride(0),
    )
    meta = dict(FP32_DOT=fp32_dot, D=d, BLOCK_W=block_w, BLOCK_M=block_m)
    _lse_kernel[(b * hq, triton.cdiv(w, block_w))](
        q, k_buffer, slots, lse, *common, hq // hkv, scale, *strides, **meta
    )
    _colsum_kernel[(b * hkv, triton.cdiv(m, block_m))](
        q, k_buffer, slots, lse, out, *common, hkv, hq // hkv, scale, *strides, **meta
    )
    return out
