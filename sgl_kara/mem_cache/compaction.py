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

from sgl_kara.kernels.compact import compact_kv


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


def compact_rows(plan: CompactionPlan, req_to_token: torch.Tensor, k_buffers, v_buffers, alloc, free):
    """Apply ``plan``; returns the per-request drop count d (same for every request).

    ``alloc(n) -> LongTensor[n] | None`` and ``free(slots)`` are the token allocator's.
    Raises OutOfSlots (nothing changed) when the K * B fresh slots cannot be allocated.
    """
    B, K, M = len(plan.starts), plan.keep, plan.region
    if B == 0:
        return 0
    device = req_to_token.device
    dst = alloc(B * K)
    if dst is None:
        raise OutOfSlots(f"need {B * K} free KV slots for compaction")
    dst = dst.to(device=device, dtype=torch.int64).view(B, K)

    offs = torch.arange(M, device=device)
    starts = torch.tensor(plan.starts, device=device, dtype=torch.int64)
    rows = plan.rows.to(device=device, dtype=torch.int64)
    region_slots = req_to_token[rows[:, None], starts[:, None] + offs[None, :]].to(torch.int64)  # [B, M]
    # src[b, l, h, t] = region_slots[b, kept[b, l, h, t]]
    Bk, L, H, _ = plan.kept.shape
    src = torch.gather(
        region_slots[:, None, None, :].expand(B, L, H, M), 3, plan.kept.to(device)
    )
    compact_kv(k_buffers, v_buffers, src, dst)

    d = M - K
    for b in range(B):
        row, a, length = int(rows[b]), plan.starts[b], plan.lengths[b]
        tail = req_to_token[row, a + M : length].clone()
        req_to_token[row, a : a + K] = dst[b].to(req_to_token.dtype)
        req_to_token[row, a + K : length - d] = tail
    free(region_slots.reshape(-1))
    return d
