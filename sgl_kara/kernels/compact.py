"""KV pool compaction: gather kept entries into fresh slots, all layers in one launch.

Shapes and strides
    k_buffers, v_buffers  L tensors [S, H_kv, D], same shape/dtype/device, contiguous
    compact_kv:
        src_slots  [B, L, H_kv, K] int64  slot holding the t-th kept entry of (b, l, h)
        dst_slots  [B, K]          int64  fresh slots, one per kept position
        effect     K_l[dst[b, t], h] = K_l[src[b, l, h, t], h]   (same for V)
        grid       (B * L * H_kv, cdiv(K, BLOCK_T)); each program moves BLOCK_T rows of D
    copy_slots:
        src, dst   [N] int64; effect K_l[dst[i]] = K_l[src[i]] for every layer (all heads)
        grid       (L * N, cdiv(H_kv * D, BLOCK)); staged through a workspace
                   [L, N, H_kv * D] so src and dst may overlap, or, with disjoint=True
                   (e.g. old pages -> fresh pages), copied directly with no workspace.

Per-layer base pointers travel as an int64 tensor [L] and are cast back inside the
kernel. Elements move as same-width integers (int8/16/32/64), so copies are bit-exact
for every dtype (NaN payloads included).

Preconditions of compact_kv (checked when tensors are on CPU; on GPU checking would
force a host sync, pass check=True to pay for it): dst slots are unique and no dst
slot is read as a src slot in the same call (the kernel reads and writes the pool
in place, so an overlap would race).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import aligned, want_triton

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TL_INT = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


# Counts that vary per event (kept entries per window, slots copied) are not specialised and the
# block sizes are fixed: one compiled kernel per element size and head dim (warm_up.py).
BLOCK_T = 64


@triton.jit(do_not_specialize=["K"])
def _compact_kernel(
    k_table,
    v_table,
    src_ptr,
    dst_ptr,
    L,
    H,
    K,
    stride_s,
    stride_h,
    ELEM: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0)  # (b, l, h) flattened, h fastest
    h = pid % H
    layer_id = (pid // H) % L
    b = pid // (H * L)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < K
    offs_d = tl.arange(0, D)
    src = tl.load(src_ptr + pid.to(tl.int64) * K + offs_t, mask=t_ok, other=0)
    dst = tl.load(dst_ptr + b.to(tl.int64) * K + offs_t, mask=t_ok, other=0)
    src_off = src[:, None] * stride_s + h * stride_h + offs_d[None, :]
    dst_off = dst[:, None] * stride_s + h * stride_h + offs_d[None, :]
    mask = t_ok[:, None]
    k_ptr = tl.load(k_table + layer_id).to(tl.pointer_type(ELEM))
    v_ptr = tl.load(v_table + layer_id).to(tl.pointer_type(ELEM))
    tl.store(k_ptr + dst_off, tl.load(k_ptr + src_off, mask=mask), mask=mask)
    tl.store(v_ptr + dst_off, tl.load(v_ptr + src_off, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["N"])
def _copy_rows_kernel(
    k_table,
    v_table,
    src_ptr,
    dst_ptr,
    N,
    ROW,
    stride_s,
    ELEM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Pool rows dst[i] <- pool rows src[i] of layer l, directly (src and dst disjoint)."""
    pid = tl.program_id(0)  # (l, i) flattened, i fastest
    layer_id = pid // N
    i = pid % N
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < ROW
    src = tl.load(src_ptr + i)
    dst = tl.load(dst_ptr + i)
    k_ptr = tl.load(k_table + layer_id).to(tl.pointer_type(ELEM))
    v_ptr = tl.load(v_table + layer_id).to(tl.pointer_type(ELEM))
    tl.store(
        k_ptr + dst * stride_s + offs,
        tl.load(k_ptr + src * stride_s + offs, mask=ok),
        mask=ok,
    )
    tl.store(
        v_ptr + dst * stride_s + offs,
        tl.load(v_ptr + src * stride_s + offs, mask=ok),
        mask=ok,
    )


@triton.jit(do_not_specialize=["N"])
def _gather_rows_kernel(
    k_table,
    v_table,
    src_ptr,
    k_ws,
    v_ws,
    N,
    ROW,
    stride_s,
    ELEM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Workspace [L, N, ROW] <- pool rows src[i] of layer l (pass 1 of copy_slots)."""
    pid = tl.program_id(0)  # (l, i) flattened, i fastest
    layer_id = pid // N
    i = pid % N
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < ROW
    src = tl.load(src_ptr + i)
    k_ptr = tl.load(k_table + layer_id).to(tl.pointer_type(ELEM))
    v_ptr = tl.load(v_table + layer_id).to(tl.pointer_type(ELEM))
    ws = pid.to(tl.int64) * ROW + offs
    tl.store(k_ws + ws, tl.load(k_ptr + src * stride_s + offs, mask=ok), mask=ok)
    tl.store(v_ws + ws, tl.load(v_ptr + src * stride_s + offs, mask=ok), mask=ok)


@triton.jit(do_not_specialize=["N"])
def _scatter_rows_kernel(
    k_table,
    v_table,
    dst_ptr,
    k_ws,
    v_ws,
    N,
    ROW,
    stride_s,
    ELEM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Pool rows dst[i] of layer l <- workspace [L, N, ROW] (pass 2 of copy_slots)."""
    pid = tl.program_id(0)
    layer_id = pid // N
    i = pid % N
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < ROW
    dst = tl.load(dst_ptr + i)
    k_ptr = tl.load(k_table + layer_id).to(tl.pointer_type(ELEM))
    v_ptr = tl.load(v_table + layer_id).to(tl.pointer_type(ELEM))
    ws = pid.to(tl.int64) * ROW + offs
    tl.store(k_ptr + dst * stride_s + offs, tl.load(k_ws + ws, mask=ok), mask=ok)
    tl.store(v_ptr + dst * stride_s + offs, tl.load(v_ws + ws, mask=ok), mask=ok)


def compact_kv_ref(k_buffers, v_buffers, src_slots, dst_slots):
    """Torch reference of `compact_kv` (reads all sources before writing)."""
    b, n_layers, h, k = src_slots.shape
    dst = dst_slots[:, None, :].expand(b, h, k)
    heads = torch.arange(h, device=src_slots.device)[None, :, None].expand(b, h, k)
    for layer_id in range(n_layers):
        src = src_slots[:, layer_id]  # [B, H, K]
        for buf in (k_buffers[layer_id], v_buffers[layer_id]):
            buf[dst, heads] = buf[src, heads]


def _compact_kv_rows(k_buffers, v_buffers, src_slots, dst_slots):
    """``compact_kv`` without Triton (the CPU path): each buffer viewed as ``[S * H_kv, D]`` rows
    (slot s, head h at row s * H_kv + h), one ``index_select`` (every source read first) and one
    ``index_copy_`` per buffer. The same writes as ``compact_kv_ref``, whose two-index assignment
    is several times slower on a CPU."""
    b, n_layers, h, k = src_slots.shape
    heads = torch.arange(h, device=src_slots.device)[None, :, None]
    dst = (dst_slots[:, None, :] * h + heads).reshape(-1)  # [B * H * K]
    for layer_id in range(n_layers):
        src = (src_slots[:, layer_id] * h + heads).reshape(-1)
        for buf in (k_buffers[layer_id], v_buffers[layer_id]):
            rows = buf.view(_INT_VIEW[buf.element_size()]).view(
                -1, buf.shape[-1]
            )  # bits (fp8 too)
            rows.index_copy_(0, dst, rows.index_select(0, src))


def copy_slots_ref(k_buffers, v_buffers, src, dst):
    """Torch reference of `copy_slots`."""
    for buf in (*k_buffers, *v_buffers):
        buf[dst] = buf[src]


def _check_buffers(k_buffers, v_buffers):
    if len(k_buffers) == 0 or len(k_buffers) != len(v_buffers):
        raise ValueError(
            f"need the same non-zero number of k and v layers, got "
            f"{len(k_buffers)} and {len(v_buffers)}"
        )
    ref = k_buffers[0]
    if ref.dim() != 3:
        raise ValueError(f"pool buffers must be [S, H_kv, D], got {tuple(ref.shape)}")
    for t in (*k_buffers, *v_buffers):
        if t.shape != ref.shape or t.dtype != ref.dtype or t.device != ref.device:
            raise ValueError("all k/v buffers must share shape, dtype and device")
        if not t.is_contiguous():
            raise ValueError("pool buffers must be contiguous")
    if ref.element_size() not in _INT_VIEW:
        raise ValueError(f"unsupported element size {ref.element_size()}")
    return ref


# Pointer tables of the buffer lists kernels were launched on, by their addresses: a KV pool's
# buffers never move, so its table is built once (``pointer_table`` at start-up) and an event
# copies nothing from the host for it.
_TABLES: dict[tuple, torch.Tensor] = {}
MAX_TABLES = 64


def pointer_table(bufs) -> torch.Tensor:
    """[L] int64 on the buffers' device: each buffer's address (built once per buffer list)."""
    key = (str(bufs[0].device), *(t.data_ptr() for t in bufs))
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= MAX_TABLES:  # scratch buffers of tests and warm-ups
            _TABLES.pop(next(iter(_TABLES)))
        table = torch.tensor(
            [t.data_ptr() for t in bufs], dtype=torch.int64, device=bufs[0].device
        )
        _TABLES[key] = table
    return table


def _validate(check, device) -> bool:
    """Check values too (reads them on the host: on a GPU that waits for the stream)? ``check``
    None: on a CPU only."""
    return bool(check) if check is not None else device.type == "cpu"


def _check_slots(name, t, device, size, values: bool):
    if t.dtype != torch.int64:
        raise ValueError(f"{name} must be int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if values and t.numel() and (t.min() < 0 or t.max() >= size):
        raise ValueError(f"{name} has slots outside [0, {size})")


def compact_kv(k_buffers, v_buffers, src_slots, dst_slots, use_triton=None, check=None):
    """K_l[dst[b, t], h] = K_l[src[b, l, h, t], h] (and V) for all b, l, h, t, in place.

    k_buffers, v_buffers: lists of L tensors [S, H_kv, D]; src_slots [B, L, H_kv, K]
    int64; dst_slots [B, K] int64. check: verify the slots' values (in range, destinations
    unique and apart from the sources); None: on a CPU only (reading them waits on a GPU).
    """
    ref = _check_buffers(k_buffers, v_buffers)
    s, h, d = ref.shape
    if src_slots.dim() != 4 or tuple(src_slots.shape[1:3]) != (len(k_buffers), h):
        raise ValueError(
            f"src_slots must be [B, L={len(k_buffers)}, H_kv={h}, K], "
            f"got {tuple(src_slots.shape)}"
        )
    b, _, _, k = src_slots.shape
    if tuple(dst_slots.shape) != (b, k):
        raise ValueError(
            f"dst_slots must be [B={b}, K={k}], got {tuple(dst_slots.shape)}"
        )
    values = _validate(check, ref.device)
    _check_slots("src_slots", src_slots, ref.device, s, values)
    _check_slots("dst_slots", dst_slots, ref.device, s, values)
    if values:
        if dst_slots.unique().numel() != dst_slots.numel():
            raise ValueError("dst_slots must be unique")
        if torch.isin(dst_slots, src_slots).any():
            raise ValueError(
                "dst_slots overlap src_slots; compaction is in place and would race"
            )
    if src_slots.numel() == 0:
        return
    if not want_triton(use_triton, ref, pow2_dim=d):
        return _compact_kv_rows(k_buffers, v_buffers, src_slots, dst_slots)
    n = ref.element_size()
    k_views = [t.view(_INT_VIEW[n]) for t in k_buffers]
    v_views = [t.view(_INT_VIEW[n]) for t in v_buffers]
    block_t = BLOCK_T
    grid = (b * len(k_buffers) * h, triton.cdiv(k, block_t))
    _compact_kernel[grid](
        pointer_table(k_views),
        pointer_table(v_views),
        aligned(src_slots),
        aligned(dst_slots),
        len(k_buffers),
        h,
        k,
        ref.stride(0),
        ref.stride(1),
        ELEM=_TL_INT[n],
        D=d,
        BLOCK_T=block_t,
    )


def copy_slots(
    k_buffers, v_buffers, src, dst, use_triton=None, disjoint=False, check=None
):
    """K_l[dst[i]] = K_l[src[i]] (all heads, and V) for every layer; src, dst [N] int64.

    src and dst may overlap (sources are staged in a workspace); dst must be unique. With
    ``disjoint=True`` the caller guarantees no dst slot is a src slot (checked on CPU) and rows
    are copied directly, without the [L, N, H_kv * D] workspace.
    """
    ref = _check_buffers(k_buffers, v_buffers)
    s, h, d = ref.shape
    if src.dim() != 1 or src.shape != dst.shape:
        raise ValueError(
            f"src and dst must be [N], got {tuple(src.shape)}, {tuple(dst.shape)}"
        )
    values = _validate(check, ref.device)
    _check_slots("src", src, ref.device, s, values)
    _check_slots("dst", dst, ref.device, s, values)
    if disjoint and values and torch.isin(dst, src).any():
        raise ValueError("copy_slots(disjoint=True): dst overlaps src")
    if src.numel() == 0:
        return
    if not want_triton(use_triton, ref):
        return copy_slots_ref(k_buffers, v_buffers, src, dst)
    n_layers, n, row = len(k_buffers), src.numel(), h * d
    es = ref.element_size()
    k_tab = pointer_table([t.view(_INT_VIEW[es]) for t in k_buffers])
    v_tab = pointer_table([t.view(_INT_VIEW[es]) for t in v_buffers])
    block = min(1024, triton.next_power_of_2(row))
    grid = (n_layers * n, triton.cdiv(row, block))
    args = (n, row, ref.stride(0))
    meta = dict(ELEM=_TL_INT[es], BLOCK=block)
    if disjoint:
        _copy_rows_kernel[grid](k_tab, v_tab, aligned(src), aligned(dst), *args, **meta)
        return
    k_ws = torch.empty(n_layers, n, row, dtype=_INT_VIEW[es], device=ref.device)
    v_ws = torch.empty_like(k_ws)
    _gather_rows_kernel[grid](k_tab, v_tab, aligned(src), k_ws, v_ws, *args, **meta)
    _scatter_rows_kernel[grid](k_tab, v_tab, aligned(dst), k_ws, v_ws, *args, **meta)
