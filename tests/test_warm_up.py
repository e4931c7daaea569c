"""Start-up warm-up (scheduler/warm_up.py) compiles every Triton specialisation an event can
launch, whatever a request brings: a per-request retention or budget (another kept count), a
spread chunk of any length (another query span), a threshold policy's growing region.

Each launch is recorded under the key Triton compiles it by (tests/kernel_launches.py), under the
CPU interpreter, so a launch the warm-up did not make is a compile mid-serving on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from kernel_launches import Allocator, Launches, Pool

from sgl_kara.mem_cache.compaction import CompactionPlan, compact_rows
from sgl_kara.policies.base import RowView, ScoreInput
from sgl_kara.policies.kara import KaraOptions, KaraPolicy
from sgl_kara.policies.snapkv import SnapKVOptions, SnapKVPolicy
from sgl_kara.scheduler.state import KaraReqState
from sgl_kara.scheduler.warm_up import warm_up_kernels

LAYERS, HQ, HKV, D = 2, 4, 2, 16


def event_launches(
    policy, pool, q_dtype, page, rows: list[tuple[int, KaraReqState]], spans=()
):
    """One request per (row length, state): its region scored by its whole query window and by
    each span length in ``spans`` (spread chunks), then compacted (one batch per region shape)."""
    alloc = Allocator(pool.k[0].shape[0], page)
    alloc.alloc(
        3 * page
    )  # an odd offset into the free list, as after earlier allocations
    req_to_token = torch.zeros(len(rows) + 1, 512, dtype=torch.int32)
    jobs = []
    for i, (n, state) in enumerate(rows):
        req_to_token[i + 1, : -(-n // page) * page] = alloc.alloc(n).to(torch.int32)
        region = policy.region(RowView(state.protected, state.frontier, n, 0, state))
        assert region is not None, (n, state)
        jobs.append((i + 1, n, region))
    for row, _n, region in jobs:
        slots = req_to_token[row, region.start : region.start + region.length].to(
            torch.int64
        )[None]
        for width in (region.query_len, *spans):
            if policy.needs_queries and not 0 < width <= region.query_len:
                continue
            q = (
                torch.randn(1, width, HQ, D).to(q_dtype)
                if policy.needs_queries
                else None
            )
            for lid in range(LAYERS):
                policy.score(ScoreInput(lid, q, pool.k[lid], slots, [None], [region]))
            if not policy.needs_queries:
                break
    shapes: dict = {}
    for row, n, region in jobs:
        shapes.setdefault(region.shape, []).append((row, n, region))
    for group in shapes.values():
        regs = [r for *_, r in group]
        kept = policy.select(
            torch.rand(len(group), LAYERS, HKV, regs[0].length), regs[0].keep
        )
        plan = CompactionPlan(
            rows=torch.tensor([row for row, *_ in group]),
            starts=[r.start for r in regs],
            lengths=[n for _, n, _ in group],
            region=regs[0].length,
            kept=kept,
            row_ids=[row for row, *_ in group],
        )
        compact_rows(
            plan, req_to_token, pool.k, pool.v, alloc.alloc, alloc.free_page_ids, page
        )


def states(protected: int, **request):
    return KaraReqState(protected=protected, frontier=protected, request=request)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize(
    "q_dtype, kv_dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)],
)
def test_kara_events_with_any_retention_and_spread_chunk_compile_nothing_new(
    monkeypatch, page, q_dtype, kv_dtype
):
    policy = KaraPolicy(KaraOptions(window=32, buffer=4, period=8))
    log = Launches(monkeypatch)
    pool = Pool(kv_dtype, slots=2048, layers=LAYERS, kv_heads=HKV, head_dim=D)
    warm_up_kernels(
        pool.get_key_buffer, list(range(LAYERS)), policy, [HQ], q_dtype, page
    )
    warm = log.take()
    p = 16
    rows = [
        (p + 32 + t, states(p, retention=r))
        for t, r in ((0, None), (3, 0.5), (5, 0.13), (7, 1.0), (9, 0.9))
    ]
    event_launches(policy, pool, q_dtype, page, rows, spans=(1, 2, 3, 15, 16, 17, 31))
    event = log.take()
    assert event and event <= warm, sorted(event - warm)


@pytest.mark.parametrize("page", [1, 16])
def test_threshold_events_with_any_budget_compile_nothing_new(monkeypatch, page):
    policy = SnapKVPolicy(SnapKVOptions(threshold=40, budget=20, window=4))
    log = Launches(monkeypatch)
    pool = Pool(torch.float32, slots=2048, layers=LAYERS, kv_heads=HKV, head_dim=D)
    warm_up_kernels(
        pool.get_key_buffer, list(range(LAYERS)), policy, [HQ], torch.float32, page
    )
    warm = log.take()
    p = 16
    rows = [
        (p + 41 + t, states(p, budget=b))
        for t, b in ((0, None), (6, 7), (13, 33), (20, 21), (37, 2))
    ]
    event_launches(policy, pool, torch.float32, page, rows)
    event = log.take()
    assert event and event <= warm, sorted(event - warm)
