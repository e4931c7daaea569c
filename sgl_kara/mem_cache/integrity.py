"""Integrity of the KV rows Kara rewrites: pure checks on tensors (no SGLang), called by the
runtime at every event under ``KARA_CHECK_INTEGRITY=1`` and by the compaction fuzz after
every operation.

    protected prefix   rows [0, P) of a request: the same slots holding the same K/V bytes as
                       when P was fixed (Kara never writes or frees them)
    row ownership      the request-owned slots [P, L) of all running rows: each named by one row
                       only, and none in the allocator's free list
"""

from __future__ import annotations

import torch


class IntegrityError(AssertionError):
    pass


def check_prefix_unchanged(
    rid,
    slots: torch.Tensor,
    kv: list,
    ref_slots: torch.Tensor,
    ref_kv: list,
    protected: int,
) -> None:
    """``slots`` [P] and ``kv`` (K/V rows of some layers at those slots) now vs at snapshot."""
    if not torch.equal(slots, ref_slots):
        raise IntegrityError(
            f"Kara integrity: protected prefix slots of {rid} changed: "
            f"{slots.tolist()} vs {ref_slots.tolist()}"
        )
    bad = [i for i, (a, b) in enumerate(zip(kv, ref_kv)) if not torch.equal(a, b)]
    if bad:
        rows = [
            (kv[i] != ref_kv[i]).flatten(1).any(1).nonzero().flatten().tolist()
            for i in bad
        ]
        raise IntegrityError(
            f"Kara integrity: protected prefix K/V bytes of {rid} changed "
            f"(tensors {bad}, rows {rows}, P={protected}, slots {slots.tolist()})"
        )


def check_row_ownership(
    owned: list[torch.Tensor], free_pages: torch.Tensor, page_size: int
) -> None:
    """``owned``: per running row, the slots of its own rows [P, L)."""
    if not owned:
        return
    own = torch.cat([o.to(torch.int64) for o in owned])
    if torch.unique(own).numel() != own.numel():
        raise IntegrityError("Kara integrity: a request-owned slot appears in two rows")
    if torch.isin(own // page_size, free_pages.to(own.device, torch.int64)).any():
        raise IntegrityError("Kara integrity: a request-owned slot is in the free list")
