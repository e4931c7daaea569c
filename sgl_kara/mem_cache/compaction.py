"""Compact one region of several requests' rows into fresh slots (page size 1).

For request b with row ``row_b`` (its ``req_to_token`` entries), physical length ``L_b``, and
region rows ``[a_b, a_b + M)``:

    before:  row[a : a+M]  = M old slots (compressible region)      row[a+M : L] = tail
    after:   row[a : a+K]  = K fresh slots; slot t of head h holds that head's t-th kept entry
             row[a+K : L-d] = the same tail slots, shifted down      (d = M - K)

The M old slots are freed (none of them is shared: the region lies above the protected
prefix), K are allocated, so the pool gains d per request. With K == M (retention 1.0) the
full path still runs: fresh slots, exact copy, old slots freed. Imports nothing from SGLang;
the caller passes the allocator's ``alloc``/``free`` and the per-layer KV buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kara.kernels.compact import compact_kv, copy_slots


@dataclass
class CompactionPlan:
    rows: torch.Tensor  # [B] req_to_token row index of each request
    starts: list[int]  # a_b: first row position of the region
    lengths: list[int]  # L_b: physical length of each row before compaction
    region: int  # M: rows in the region
    kept: torch.Tensor  # [B, L_layers, H_kv, K] int64 indices in [0, M), sorted per head

    @property
    def keep(self) -> int:
        return int(self.kept.shape[-1])

    @property
    def dropped(self) -> int:
        return self.region - self.keep


class OutOfSlots(RuntimeError):
    pass


def fresh_slots_needed(start: int, length: int, region: int, keep: int, page_size: int = 1) -> int:
    """Fresh slots compacting rows [start, start + region) of a row of ``length`` to ``keep``
    entries allocates before it frees the old ones: ``keep`` with page size 1; with pages, every
    row from the region's page start to the new end, in whole pages (see _compact_rows_paged)."""
    if page_size <= 1:
        return keep
    s = start - start % page_size
    return -(-(length - (region - keep) - s) // page_size) * page_size


def compact_rows(plan: CompactionPlan, req_to_token: torch.Tensor, k_buffers, v_buffers, alloc, free, page_size: int = 1,
                 use_triton: bool | None = None):
    """Apply ``plan``; returns the per-request drop count d (same for every request).

    ``alloc(n) -> LongTensor[n] | None`` and ``free(slots)`` are the token allocator's.
    Raises OutOfSlots (nothing changed) when the fresh slots cannot be allocated.
    """
    if page_size > 1:
        return _compact_rows_paged(plan, req_to_token, k_buffers, v_buffers, alloc, free, page_size, use_triton)
    B, K, M = len(plan.starts), plan.keep, plan.region
    if B == 0:
        return 0
    device = req_to_token.device
    dst = alloc(B * K)
    if dst is None:
        raise OutOfSlots(f"need {B * K} free KV slots for compaction")
    try:  # any failure before the rows are rewritten gives the fresh slots back
        dst = dst.to(device=device, dtype=torch.int64).view(B, K)
        offs = torch.arange(M, device=device)
        starts = torch.tensor(plan.starts, device=device, dtype=torch.int64)
        rows = plan.rows.to(device=device, dtype=torch.int64)
        region_slots = req_to_token[rows[:, None], starts[:, None] + offs[None, :]].to(torch.int64)  # [B, M]
        # src[b, l, h, t] = region_slots[b, kept[b, l, h, t]]
        Bk, L, H, _ = plan.kept.shape
        src = torch.gather(region_slots[:, None, None, :].expand(B, L, H, M), 3, plan.kept.to(device))
        compact_kv(k_buffers, v_buffers, src, dst, use_triton=use_triton)
    except BaseException:
        free(dst.reshape(-1))  # rows untouched: give the fresh slots back
        raise

    d = M - K
    row_ids = rows.tolist()  # one device->host read for the group (not one per request)
    for b in range(B):
        row, a, length = row_ids[b], plan.starts[b], plan.lengths[b]
        tail = req_to_token[row, a + M : length].clone()
        req_to_token[row, a : a + K] = dst[b].to(req_to_token.dtype)
        req_to_token[row, a + K : length - d] = tail
    free(region_slots.reshape(-1))
    return d


def _compact_rows_paged(plan, req_to_token, k_buffers, v_buffers, alloc, free, page: int, use_triton=None):
    """Page size > 1: a slot's offset in its page must equal its row position mod page, so the
    rewritten part of each row goes to fresh, page-aligned pages:

        old row:  [ s ... a | region (M) | a+M ........ L )      s = a rounded down to a page
        new row:  [ s ... a | kept (K)   | a+K .. L-d )           all rows >= s on fresh pages
                    copied    gathered     copied (tail shifted down by d)

    and every old page of rows [s, L) is freed (they hold only this request's KV: s >= P).
    """
    B, K, M = len(plan.starts), plan.keep, plan.region
    if B == 0:
        return 0
    d = M - K
    device = req_to_token.device
    rows = plan.rows.to(device=device, dtype=torch.int64)
    spans = []  # (s, a, L, n_new, n_pages)
    for a, length in zip(plan.starts, plan.lengths):
        s = a - a % page
        spans.append((s, a, length, length - d - s, fresh_slots_needed(a, length, M, K, page) // page))
    total = sum(sp[4] for sp in spans) * page
    fresh = alloc(total)
    if fresh is None:
        raise OutOfSlots(f"need {total} free KV slots (page-aligned) for compaction")
    fresh = fresh.to(device=device, dtype=torch.int64)
    try:  # any failure before the rows are rewritten gives the fresh pages back
        new_rows = _paged_copy(plan, req_to_token, k_buffers, v_buffers, fresh, spans, rows, page, use_triton)
    except BaseException:
        free(fresh)  # rows untouched: give the fresh pages back
        raise
    for row, s, new, _ in new_rows:
        req_to_token[row, s : s + new.numel()] = new.to(req_to_token.dtype)
    free(torch.cat([old for *_, old in new_rows]))
    return d


def _paged_copy(plan, req_to_token, k_buffers, v_buffers, fresh, spans, rows, page, use_triton):
    """Fill the fresh pages (kept entries gathered, rows [s, a) and the tail copied); returns
    (row, s, new slots, old slots) per request. Reads the rows, writes only fresh slots."""
    B, K, M = len(plan.starts), plan.keep, plan.region
    device = req_to_token.device
    offs = torch.arange(M, device=device)
    starts = torch.tensor(plan.starts, device=device, dtype=torch.int64)
    region_slots = req_to_token[rows[:, None], starts[:, None] + offs[None, :]].to(torch.int64)
    Bk, L, H, _ = plan.kept.shape
    src = torch.gather(region_slots[:, None, None, :].expand(B, L, H, M), 3, plan.kept.to(device))

    new_rows, kept_dst, copy_src, copy_dst = [], [], [], []
    cursor = 0
    row_ids = rows.tolist()  # one device->host read for the group
    for b, (s, a, length, n_new, n_pages) in enumerate(spans):
        row = row_ids[b]
        new = fresh[cursor : cursor + n_pages * page][:n_new]
        cursor += n_pages * page
        old_row = req_to_token[row, s:length].to(torch.int64)
        head = a - s
        kept_dst.append(new[head : head + K])
        copy_src += [old_row[:head], old_row[head + M :]]
        copy_dst += [new[:head], new[head + K :]]
        new_rows.append((row, s, new, old_row))
    compact_kv(k_buffers, v_buffers, src, torch.stack(kept_dst), use_triton=use_triton)
    # Old pages -> fresh pages: disjoint, so no staging workspace (it would hold the whole tail).
    copy_slots(k_buffers, v_buffers, torch.cat(copy_src), torch.cat(copy_dst), use_triton=use_triton, disjoint=True)
    return new_rows
