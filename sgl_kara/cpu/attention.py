"""torch_native attention on CPU, for every torch_native decode in a process that runs sgl_kara's
CPU kernels (``KARA_CPU_KERNELS``: on for sgl_kara's server, and for plain SGLang that opts in, so
a benchmark comparison can run the same attention on both sides; cross-attention, sliding
windows, CUDA tensors and ``KARA_FAST_CPU_DECODE=0`` take SGLang's path). SGLang 0.5.23
gathers each request's K/V per layer by advanced indexing; here the rows are read once per
forward and shared by every layer, and
one padded SDPA call per layer serves the whole batch, the GQA group folded into the query axis,
while the cost rule (PAD_RATIO, CALL_UNITS; measured in bench/results/kernels.md) says it beats the
per-request loop (``KARA_BATCHED_CPU_DECODE=0``: always the loop, bit-identical to SGLang's; the
padded call differs in float summation order). Kara's recompute pass (``run_window_extend``)
attends each request's E window queries to its L keys directly instead of SGLang's padded L x L
extend, whose work grows with L / E.

    slots   [sum(L_i)] int64: row i's slots req_to_token[r_i, :L_i], rows back to back
    bounds  [(start_i, end_i)]: request i's slice of slots (host ints, one read per forward)
    K_buf   [>= sum(L_i), H_kv, D] per (H_kv, D, dtype), grown on demand, reused by every layer

    q      [T, H_kv, g, D]          (H_q = H_kv g; query head h reads KV head h // g, as SGLang)
    K, V   [T, H_kv, L_max, D]      padded entries point at the row's first slot
    mask   [T, 1, 1, L_max] bool    True where the entry is in the row

    row pos:  0 ............ p ............ L          p = extend_prefix_len, L = p + E
    query t (row pos p + t) attends keys [0, p + t]     mask[t, j] = j <= p + t
"""

from __future__ import annotations

from functools import cached_property

import torch
from torch.nn.functional import scaled_dot_product_attention

from sgl_kara import env

_META = "_sgl_kara_decode_rows"  # per-forward metadata on the backend instance
_BUFS = "_sgl_kara_decode_bufs"


def reset_metadata_hook(result, backend, *args, **kwargs):
    """AFTER ``init_forward_metadata``: a new forward, so its rows are read anew."""
    setattr(backend, _META, None)
    return result


# When the padded call beats the loop (bench/results/kernels.md, this CPU, float32, one thread):
# per query-head x head-dim unit the padded call costs ~0.70 ns a padded entry, the loop ~0.85 ns a
# row entry plus ~18 us of per-request call overhead, so padded wins while
#     T x L_max <= PAD_RATIO x sum(L_i) + T x CALL_UNITS / (H_q x D)
PAD_RATIO = 1.2
CALL_UNITS = 25_000


class _Rows:
    """The rows of one forward, read once and shared by every layer:

    rows    [T, L_max] int64   req_to_token[r_i, :L_max]; mask [T, L_max] bool: j < L_i
    slots   [sum(L_i)] int64   row i's slots back to back; bounds [(start_i, end_i)] host ints
            (both built on first use: the loop and the window extend need them)
    padded  (idx [T * L_max], mask [T, 1, 1, L_max], L_max) for the batched decode, or None
            when padding would cost more than the loop (PAD_RATIO, CALL_UNITS); built on first use"""

    def __init__(self, req_to_token, req_pool_indices, seq_lens):
        self.seq_lens, self.req_pool_indices = seq_lens, req_pool_indices
        self.lens = seq_lens.tolist()
        self.width = max(self.lens) if self.lens else 0
        self.rows = req_to_token[req_pool_indices, : self.width].to(torch.int64)
        self.mask = (
            torch.arange(self.width, device=self.rows.device)[None, :]
            < seq_lens[:, None]
        )
        self._padded = {}

    # slots and bounds serve the loop and the window extend only: the padded decode (the default)
    # never builds them
    @cached_property
    def slots(self) -> torch.Tensor:
        return self.rows[self.mask]

    @cached_property
    def bounds(self) -> list[tuple[int, int]]:
        bounds, start = [], 0
        for n in self.lens:
            bounds.append((start, start + n))
            start += n
        return bounds

    def padded(self, head_units: int):
        """head_units = H_q x D of the layer asking (one value per model in practice)."""
        if head_units not in self._padded:
            t, width = self.rows.shape
            entry = None
            if (
                t
                and width
                and t * width
                <= PAD_RATIO * sum(self.lens) + t * CALL_UNITS / head_units
            ):
                idx = torch.where(self.mask, self.rows, self.rows[:, :1]).reshape(
                    -1
                )  # padding reads the row's own slot
                entry = (idx, self.mask[:, None, None, :], width)
            self._padded[head_units] = entry
        return self._padded[head_units]


def _rows(backend, req_to_token, req_pool_indices, seq_lens) -> _Rows:
    meta = getattr(backend, _META, None)
    if (
        meta is None
        or meta.seq_lens is not seq_lens
        or meta.req_pool_indices is not req_pool_indices
    ):
        meta = _Rows(req_to_token, req_pool_indices, seq_lens)
        setattr(backend, _META, meta)
    return meta


def _buffer(backend, cache: torch.Tensor, n: int, which: int) -> torch.Tensor:
    bufs = getattr(backend, _BUFS, None)
    if bufs is None:
        bufs = {}
        setattr(backend, _BUFS, bufs)
    key = (which, tuple(cache.shape[1:]), cache.dtype)
    buf = bufs.get(key)
    if buf is None or buf.shape[0] < n:
        # A normal tensor even when first needed inside the recompute pass's inference_mode: the
        # decode forward, outside it, writes into the same buffer (an inference tensor would refuse).
        with torch.inference_mode(False):
            buf = torch.empty(
                (
                    max(n, 2 * (buf.shape[0] if buf is not None else 0)),
                    *cache.shape[1:],
                ),
                dtype=cache.dtype,
                device=cache.device,
            )
        bufs[key] = buf
    return buf[:n]


def run_sdpa_forward_decode(
    original,
    backend,
    query,
    output,
    k_cache,
    v_cache,
    req_to_token,
    req_pool_indices,
    seq_lens,
    encoder_lens=None,
    scaling=None,
    enable_gqa=False,
    causal=False,
    is_cross_attn=False,
    sliding_window_size=None,
):
    """AROUND ``TorchNativeAttnBackend._run_sdpa_forward_decode`` (same arguments).

    query [T, H_q, D] (one token per request), output [T, H_q, D_v]; k_cache / v_cache
    [S, H_kv, D]; req_to_token [R, C]; req_pool_indices, seq_lens [T]."""
    plain = (
        encoder_lens is None
        and not is_cross_attn
        and query.device.type == "cpu"
        and (sliding_window_size is None or sliding_window_size <= -1)
        and env.fast_cpu_decode()
    )
    if not plain:
        return original(
            backend,
            query=query,
            output=output,
            k_cache=k_cache,
            v_cache=v_cache,
            req_to_token=req_to_token,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            encoder_lens=encoder_lens,
            scaling=scaling,
            enable_gqa=enable_gqa,
            causal=causal,
            is_cross_attn=is_cross_attn,
            sliding_window_size=sliding_window_size,
        )
    meta = _rows(backend, req_to_token, req_pool_indices, seq_lens)
    if (
        env.batched_cpu_decode()
        and not causal
        and query.shape[1] % k_cache.shape[1] == 0
    ):
        padded = meta.padded(query.shape[1] * query.shape[2])
        if padded is not None:
            return _decode_padded(
                backend, padded, query, output, k_cache, v_cache, scaling
            )
    return _decode_per_request(
        backend, meta, query, output, k_cache, v_cache, scaling, enable_gqa, causal
    )


def _decode_per_request(
    backend, meta, query, output, k_cache, v_cache, scaling, enable_gqa, causal
):
    """Each request's keys and values gathered once into reused buffers, one SDPA call per
    request (rows of unequal length, or the padded path off)."""
    slots, bounds = meta.slots, meta.bounds
    n = slots.numel()
    keys = torch.index_select(k_cache, 0, slots, out=_buffer(backend, k_cache, n, 0))
    values = torch.index_select(v_cache, 0, slots, out=_buffer(backend, v_cache, n, 1))
    if keys.dtype != query.dtype:  # as SGLang: SDPA wants one dtype
        keys, values = keys.to(query.dtype), values.to(query.dtype)
    q = query.movedim(0, query.dim() - 2)  # [H_q, T, D]
    for i, (a, b) in enumerate(bounds):
        out = scaled_dot_product_attention(
            q[:, i : i + 1, :].unsqueeze(0),
            keys[a:b].movedim(0, 1).unsqueeze(0),
            values[a:b].movedim(0, 1).unsqueeze(0),
            enable_gqa=enable_gqa,
            scale=scaling,
            is_causal=causal,
        )
        output[i : i + 1] = out.squeeze(0).movedim(1, 0)
    return output


def _decode_padded(backend, padded, query, output, k_cache, v_cache, scaling):
    """One SDPA for the batch (module docstring); output [T, H_q, D_v]."""
    idx, mask, width = padded
    t, hq, d = query.shape
    hkv = k_cache.shape[1]
    n = idx.numel()
    keys = torch.index_select(k_cache, 0, idx, out=_buffer(backend, k_cache, n, 2))
    values = torch.index_select(v_cache, 0, idx, out=_buffer(backend, v_cache, n, 3))
    if keys.dtype != query.dtype:
        keys, values = keys.to(query.dtype), values.to(query.dtype)
    keys = keys.view(t, width, hkv, d).transpose(1, 2)
    values = values.view(t, width, hkv, -1).transpose(1, 2)
    out = scaled_dot_product_attention(
        query.reshape(t, hkv, hq // hkv, d), keys, values, attn_mask=mask, scale=scaling
    )
    output.copy_(out.reshape(t, hq, -1))
    return output


def run_window_extend(
    backend,
    query,
    output,
    k_cache,
    v_cache,
    req_to_token,
    req_pool_indices,
    seq_lens,
    extend_prefix_lens,
    extend_seq_lens,
    scaling=None,
    enable_gqa=False,
) -> torch.Tensor:
    """Causal extend attention of the recompute pass (arguments as SGLang's
    ``_run_sdpa_forward_extend``): query [T, H_q, D], the E_i queries of request i back to back,
    at row positions [p_i, p_i + E_i) with p_i + E_i = seq_lens[i]; output [T, H_q, D_v]."""
    meta = _rows(backend, req_to_token, req_pool_indices, seq_lens)
    slots, bounds = meta.slots, meta.bounds
    prefix, extend = extend_prefix_lens.tolist(), extend_seq_lens.tolist()
    for i, (a, b) in enumerate(bounds):
        if prefix[i] + extend[i] != b - a:
            raise ValueError(
                f"extend of request {i}: prefix {prefix[i]} + extend {extend[i]} != row length {b - a}"
            )
    n = slots.numel()
    keys = torch.index_select(k_cache, 0, slots, out=_buffer(backend, k_cache, n, 0))
    values = torch.index_select(v_cache, 0, slots, out=_buffer(backend, v_cache, n, 1))
    if keys.dtype != query.dtype:
        keys, values = keys.to(query.dtype), values.to(query.dtype)
    q = query.movedim(0, query.dim() - 2)  # [H_q, T, D]
    start = 0
    masks: dict[tuple[int, int], torch.Tensor] = {}
    for i, (a, b) in enumerate(bounds):
        p, e = prefix[i], extend[i]
        mask = masks.get((p, e))
        if mask is None:
            mask = masks[(p, e)] = torch.ones(
                e, p + e, dtype=torch.bool, device=query.device
            ).tril(diagonal=p)
        out = scaled_dot_product_attention(
            q[:, start : start + e, :].unsqueeze(0),
            keys[a:b].movedim(0, 1).unsqueeze(0),
            values[a:b].movedim(0, 1).unsqueeze(0),
            attn_mask=mask,
            enable_gqa=enable_gqa,
            scale=scaling,
        )
        output[start : start + e] = out.squeeze(0).movedim(1, 0)
        start += e
    return output
