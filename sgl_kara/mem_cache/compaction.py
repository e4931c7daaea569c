"""Compact one region of several requests' rows into fresh slots (page size 1 here; pages in
``_prepare_paged``).

For request b with row ``row_b`` (its ``req_to_token`` entries), physical length ``L_b``, and
region rows ``[a_b, a_b + M)``:

    before:  row[a : a+M]  = M old slots (compressible region)      row[a+M : L] = tail
    after:   row[a : a+K]  = K fresh slots; slot t of head h holds that head's t-th kept entry
             row[a+K : L-d] = the same tail slots, shifted down      (d = M - K)

The M old slots are freed (none of them is shared: the region lies above the protected
prefix), K are allocated, so the pool gains d per request. With K == M (retention 1.0) the
full path still runs: fresh slots, exact copy, old slots freed. Imports nothing from SGLang;
the caller passes the allocator's ``alloc`` / ``free_page_ids`` and the per-layer KV buffers.

Frees name pages, never slots to be deduplicated: compaction knows which pages it frees (with
page size 1 a page is a slot; with pages, every old page of a rewritten span is wholly the
request's and is named once, by its first slot), so the allocator's ``free_page_ids`` takes them
as they are. Its ``free(slots)`` would find the pages with ``torch.unique`` on the device, which
makes the host wait for the forward in flight (docs/GPU.md).

Two phases, so that an event can be undone (scheduler/events.py): ``prepare_compaction``
allocates the fresh slots and copies the kept K/V into them -- everything that can fail (out of
slots, a kernel, device memory) -- while every row still names its old slots; the returned
``PreparedCompaction`` then either commits (row rewrites and frees: index writes) or aborts (the
fresh slots given back, the pool as before).
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
    # [B, L_layers, H_kv, K] int64 indices in [0, M), sorted per head
    kept: torch.Tensor
    row_ids: list[int] | None = None  # ``rows`` on the host (None: read from ``rows``)
    device_starts: torch.Tensor | None = None  # ``starts`` on the device (None: copied)
    # [B, M] the regions' slots (None: gathered)
    region_slots: torch.Tensor | None = None

    @property
    def keep(self) -> int:
        return int(self.kept.shape[-1])

    @property
    def dropped(self) -> int:
        return self.region - self.keep

    def host_rows(self) -> list[int]:
        return list(self.row_ids) if self.row_ids is not None else self.rows.tolist()

    def slots_of_regions(self, req_to_token: torch.Tensor) -> torch.Tensor:
        """[B, M] int64 pool slots of the regions (the caller's, else gathered here)."""
        if self.region_slots is not None:
            return self.region_slots
        device = req_to_token.device
        starts = self.device_starts
        if starts is None:
            starts = torch.tensor(self.starts, device=device, dtype=torch.int64)
        rows = self.rows.to(device=device, dtype=torch.int64)
        offs = torch.arange(self.region, device=device)
        return req_to_token[rows[:, None], starts[:, None] + offs[None, :]].to(
            torch.int64
        )


class OutOfSlots(RuntimeError):
    pass


@dataclass
class PreparedCompaction:
    """A compaction whose kept K/V already sit in fresh slots, not yet visible to anyone: the
    rows still name their old slots. ``commit`` rewrites the rows and frees the old slots (index
    writes only: nothing there can run out of memory); ``abort`` gives the fresh slots back and
    leaves the pool as it was before ``prepare_compaction``.

        writes  [(row, p, slots)]: req_to_token[row, p : p + len(slots)] = slots at commit
        old     page ids freed at commit (the region's slots, or with pages every old page of
                [s, L)), each once
        fresh   page ids allocated by prepare (given back by abort)

    ``free_pages(page_ids)`` is the allocator's ``free_page_ids``: no deduplication, no wait.
    """

    dropped: int
    writes: list
    old: torch.Tensor
    fresh: torch.Tensor
    # per request (start, fresh slots, stop or None): rows [start, stop) (None: the whole tail)
    # replaced by the fresh slots, the rows after stop moved down -- the same change as
    # ``writes`` and ``old``, for an owner of the rows that applies it (SGLang's
    # ``kv_compaction.release_kv_tails``)
    ranges: list = None
    done: bool = False

    def released(self) -> None:
        """The change was applied by the rows' owner (ranges): nothing left to commit."""
        assert not self.done, "compaction committed or aborted twice"
        self.done = True

    def commit(self, req_to_token: torch.Tensor, free_pages) -> int:
        assert not self.done, "compaction committed or aborted twice"
        self.done = True
        for row, p, slots in self.writes:
            req_to_token[row, p : p + slots.numel()] = slots.to(req_to_token.dtype)
        if self.old.numel():
            free_pages(self.old)
        return self.dropped

    def abort(self, free_pages) -> None:
        assert not self.done, "compaction committed or aborted twice"
        self.done = True
        if self.fresh.numel():
            free_pages(self.fresh)


def page_ids(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """The pages of ``slots``, a whole number of pages each named by its slots in order (an
    allocation, or a row span from a page-aligned start, whose last page may be partly used):
    every ``page_size``-th slot's page. No ``torch.unique``, no host wait."""
    if page_size <= 1:
        return slots
    return torch.div(slots[::page_size], page_size, rounding_mode="floor")


def fresh_slots_needed(
    start: int, length: int, region: int, keep: int, page_size: int = 1
) -> int:
    """Fresh slots compacting rows [start, start + region) of a row of ``length`` to ``keep``
    entries allocates before it frees the old ones: ``keep`` with page size 1; with pages, every
    row from the region's page start to the new end, in whole pages (see _prepare_paged)."""
    if page_size <= 1:
        return keep
    s = start - start % page_size
    return -(-(length - (region - keep) - s) // page_size) * page_size


def compact_rows(
    plan: CompactionPlan,
    req_to_token: torch.Tensor,
    k_buffers,
    v_buffers,
    alloc,
    free_pages,
    page_size: int = 1,
    use_triton: bool | None = None,
    check: bool | None = None,
):
    """Apply ``plan`` at once (``prepare_compaction`` then ``commit``); returns the per-request
    drop count d (same for every request). Raises OutOfSlots (nothing changed) when the fresh
    slots cannot be allocated."""
    return prepare_compaction(
        plan,
        req_to_token,
        k_buffers,
        v_buffers,
        alloc,
        free_pages,
        page_size,
        use_triton,
        check,
    ).commit(req_to_token, free_pages)


def prepare_compaction(
    plan: CompactionPlan,
    req_to_token: torch.Tensor,
    k_buffers,
    v_buffers,
    alloc,
    free_pages,
    page_size: int = 1,
    use_triton: bool | None = None,
    check: bool | None = None,
) -> PreparedCompaction:
    """Allocate fresh slots and copy the kept K/V (and, with pages, the shifted tail) into them;
    the rows are not touched. ``alloc(n) -> LongTensor[n] | None`` and ``free_pages(page_ids)``
    are the token allocator's (``alloc`` / ``free_page_ids``). Raises OutOfSlots when the fresh
    slots cannot be allocated; on any failure the fresh slots are given back first (nothing
    changed). ``check``: the kernels verify slot
    values (kernels.compact; None: on a CPU only). Reads nothing back from the device."""
    args = (plan, req_to_token, k_buffers, v_buffers, alloc, free_pages)
    if page_size > 1:
        return _prepare_paged(*args, page_size, use_triton, check)
    return _prepare_flat(*args, use_triton, check)


def _prepare_flat(
    plan, req_to_token, k_buffers, v_buffers, alloc, free_pages, use_triton, check
) -> PreparedCompaction:
    """Page size 1: the kept entries gathered into B x K fresh slots; each row's tail keeps its
    slots, shifted down at commit."""
    B, K, M = len(plan.starts), plan.keep, plan.region
    device = req_to_token.device
    empty = torch.empty(0, dtype=torch.int64, device=device)
    if B == 0:
        return PreparedCompaction(0, [], empty, empty)
    dst = alloc(B * K)
    if dst is None:
        raise OutOfSlots(f"need {B * K} free KV slots for compaction")
    try:  # any failure before the commit gives the fresh slots back
        dst = dst.to(device=device, dtype=torch.int64).view(B, K)
        region_slots = plan.slots_of_regions(req_to_token)  # [B, M]
        # src[b, l, h, t] = region_slots[b, kept[b, l, h, t]]
        Bk, L, H, _ = plan.kept.shape
        src = torch.gather(
            region_slots[:, None, None, :].expand(B, L, H, M), 3, plan.kept.to(device)
        )
        compact_kv(k_buffers, v_buffers, src, dst, use_triton=use_triton, check=check)
        writes, ranges = [], []
        for b, (row, a, length) in enumerate(
            zip(plan.host_rows(), plan.starts, plan.lengths)
        ):
            # row[a : a+K] = fresh slots, row[a+K : L-d] = the tail's slots, shifted down
            writes.append(
                (
                    row,
                    a,
                    torch.cat(
                        [dst[b], req_to_token[row, a + M : length].to(torch.int64)]
                    ),
                )
            )
            ranges.append((a, dst[b], a + M))
    except BaseException:
        free_pages(dst.reshape(-1))
        raise
    return PreparedCompaction(
        M - K, writes, region_slots.reshape(-1), dst.reshape(-1), ranges
    )


def _prepare_paged(
    plan,
    req_to_token,
    k_buffers,
    v_buffers,
    alloc,
    free_pages,
    page: int,
    use_triton=None,
    check=None,
):
    """Page size > 1: a slot's offset in its page must equal its row position mod page, so the
    rewritten part of each row goes to fresh, page-aligned pages:

        old row:  [ s ... a | region (M) | a+M ........ L )      s = a rounded down to a page
        new row:  [ s ... a | kept (K)   | a+K .. L-d )           all rows >= s on fresh pages
                    copied    gathered     copied (tail shifted down by d)

    and every old page of rows [s, L) is freed at commit (they hold only this request's KV:
    s >= P), each named once by its first row (``page_ids``).
    """
    B, K, M = len(plan.starts), plan.keep, plan.region
    device = req_to_token.device
    empty = torch.empty(0, dtype=torch.int64, device=device)
    if B == 0:
        return PreparedCompaction(0, [], empty, empty)
    d = M - K
    spans = _paged_spans(plan, page)
    total = sum(sp[4] for sp in spans) * page
    fresh = alloc(total)
    if fresh is None:
        raise OutOfSlots(f"need {total} free KV slots (page-aligned) for compaction")
    fresh = fresh.to(device=device, dtype=torch.int64)
    fresh_pages = page_ids(fresh, page)
    try:  # any failure before the commit gives the fresh pages back
        new_rows = _paged_copy(
            plan,
            req_to_token,
            k_buffers,
            v_buffers,
            fresh,
            spans,
            page,
            use_triton,
            check,
        )
    except BaseException:
        free_pages(fresh_pages)
        raise
    writes = [(row, s, new) for row, s, new, _ in new_rows]
    old_pages = torch.cat([page_ids(old, page) for *_, old in new_rows])
    ranges = [(s, new, None) for _, s, new, _ in new_rows]
    return PreparedCompaction(d, writes, old_pages, fresh_pages, ranges)


def _paged_spans(plan, page: int) -> list[tuple[int, int, int, int, int]]:
    """Per request (s: its first rewritten row, a page start; a: the region's start; L: its
    length; the rows from s after compaction; the fresh pages they take)."""
    M, K = plan.region, plan.keep
    spans = []
    for a, length in zip(plan.starts, plan.lengths):
        s = a - a % page
        pages = fresh_slots_needed(a, length, M, K, page) // page
        spans.append((s, a, length, length - (M - K) - s, pages))
    return spans


def _paged_copy(
    plan, req_to_token, k_buffers, v_buffers, fresh, spans, page, use_triton, check
):
    """Fill the fresh pages (kept entries gathered, rows [s, a) and the tail copied); returns
    (row, s, new slots, old slots) per request. Reads the rows, writes only fresh slots."""
    B, K, M = len(plan.starts), plan.keep, plan.region
    device = req_to_token.device
    region_slots = plan.slots_of_regions(req_to_token)
    Bk, L, H, _ = plan.kept.shape
    src = torch.gather(
        region_slots[:, None, None, :].expand(B, L, H, M), 3, plan.kept.to(device)
    )

    new_rows, kept_dst, copy_src, copy_dst = [], [], [], []
    cursor = 0
    row_ids = plan.host_rows()
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
    compact_kv(
        k_buffers,
        v_buffers,
        src,
        torch.stack(kept_dst),
        use_triton=use_triton,
        check=check,
    )
    # Old pages -> fresh pages: disjoint, so no staging workspace (it would hold the whole tail).
    copy_slots(
        k_buffers,
        v_buffers,
        torch.cat(copy_src),
        torch.cat(copy_dst),
        use_triton=use_triton,
        disjoint=True,
        check=check,
    )
    return new_rows
