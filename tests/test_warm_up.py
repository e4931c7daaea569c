"""Start-up warm-up (scheduler/warm_up.py) compiles every Triton specialisation an event can
launch, whatever a request brings: a per-request retention or budget (another kept count), a
spread chunk of any length (another query span), a threshold policy's growing region.

Triton keys a compiled kernel on its constexprs and on each other argument's type and, unless
the kernel lists it in ``do_not_specialize``, on whether an integer equals 1 or is divisible by 16
(pointers: 16-byte alignment). The recorder below computes that key for every launch (Triton's
own ``native_specialize_impl``, honouring each kernel's ``do_not_specialize``) under the CPU
interpreter, so a launch the warm-up did not make is a compile mid-serving on a GPU.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from sgl_kara.mem_cache.compaction import CompactionPlan, compact_rows
from sgl_kara.policies.base import RowView, ScoreInput
from sgl_kara.policies.kara import KaraOptions, KaraPolicy
from sgl_kara.policies.snapkv import SnapKVOptions, SnapKVPolicy
from sgl_kara.scheduler.state import KaraReqState
from sgl_kara.scheduler.warm_up import warm_up_kernels

LAYERS, HQ, HKV, D = 2, 4, 2, 16
KERNELS = {"sgl_kara.kernels.window_score": ("_lse_kernel", "_colsum_kernel"),
           "sgl_kara.kernels.compact": ("_compact_kernel", "_copy_rows_kernel", "_gather_rows_kernel",
                                        "_scatter_rows_kernel")}


class Launches:
    """Every launch of the launchers' Triton kernels, keyed as Triton keys its compiled kernels."""

    def __init__(self, monkeypatch):
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        self.keys: set = set()
        log = self

        class Recorded:
            def __init__(self, name, kernel):
                self.name, self.kernel = name, kernel
                self.arg_names = list(kernel.arg_names)
                self.fixed = set(kernel.kwargs.get("do_not_specialize") or ())

            def __getitem__(self, grid):
                launch = self.kernel[grid]

                def run(*args, **kw):
                    key = tuple(native_specialize_impl(BaseBackend, a, False, name not in self.fixed, True)
                                for name, a in zip(self.arg_names, args))
                    log.keys.add((self.name, key, tuple(sorted((k, repr(v)) for k, v in kw.items()))))
                    return launch(*args, **kw)

                return run

        for mod_name, names in KERNELS.items():
            mod = importlib.import_module(mod_name)
            for name in names:
                monkeypatch.setattr(mod, name, Recorded(name, getattr(mod, name)))

    def take(self) -> set:
        out, self.keys = self.keys, set()
        return out


class Pool:
    def __init__(self, dtype, slots=2048):
        g = torch.Generator().manual_seed(0)
        self.k = [torch.randn(slots, HKV, D, generator=g).to(dtype) for _ in range(LAYERS)]
        self.v = [torch.randn(slots, HKV, D, generator=g).to(dtype) for _ in range(LAYERS)]
        self.start_layer, self.layer_num = 0, LAYERS

    def get_key_buffer(self, layer):
        return self.k[layer]

    def get_value_buffer(self, layer):
        return self.v[layer]


class Allocator:
    """SGLang's free list: each allocation a slice of what is left, at any offset."""

    def __init__(self, size: int, page: int):
        self.page = page
        self.free_pages = torch.arange(1, size // page)

    def alloc(self, n: int):
        pages = -(-n // self.page)
        got, self.free_pages = self.free_pages[:pages], self.free_pages[pages:]
        if self.page == 1:
            return got
        return (got[:, None] * self.page + torch.arange(self.page)).reshape(-1)

    def free(self, slots):
        pass


def event_launches(policy, pool, q_dtype, page, rows: list[tuple[int, KaraReqState]], spans=()):
    """One request per (row length, state): its region scored by its whole query window and by
    each span length in ``spans`` (spread chunks), then compacted (one batch per region shape)."""
    alloc = Allocator(pool.k[0].shape[0], page)
    alloc.alloc(3 * page)  # an odd offset into the free list, as after earlier allocations
    req_to_token = torch.zeros(len(rows) + 1, 512, dtype=torch.int32)
    jobs = []
    for i, (n, state) in enumerate(rows):
        req_to_token[i + 1, : -(-n // page) * page] = alloc.alloc(n).to(torch.int32)
        region = policy.region(RowView(state.protected, state.frontier, n, 0, state))
        assert region is not None, (n, state)
        jobs.append((i + 1, n, region))
    for row, n, region in jobs:
        slots = req_to_token[row, region.start : region.start + region.length].to(torch.int64)[None]
        for width in (region.query_len, *spans):
            if policy.needs_queries and not 0 < width <= region.query_len:
                continue
            q = torch.randn(1, width, HQ, D).to(q_dtype) if policy.needs_queries else None
            for lid in range(LAYERS):
                policy.score(ScoreInput(lid, q, pool.k[lid], slots, [None], [region]))
            if not policy.needs_queries:
                break
    shapes: dict = {}
    for row, n, region in jobs:
        shapes.setdefault(region.shape, []).append((row, n, region))
    for group in shapes.values():
        regs = [r for *_, r in group]
        kept = policy.select(torch.rand(len(group), LAYERS, HKV, regs[0].length), regs[0].keep)
        plan = CompactionPlan(rows=torch.tensor([row for row, *_ in group]), starts=[r.start for r in regs],
                              lengths=[n for _, n, _ in group], region=regs[0].length, kept=kept,
                              row_ids=[row for row, *_ in group])
        compact_rows(plan, req_to_token, pool.k, pool.v, alloc.alloc, alloc.free, page)


def states(protected: int, **fields):
    return KaraReqState(protected=protected, frontier=protected, **fields)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("q_dtype, kv_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)])
def test_kara_events_with_any_retention_and_spread_chunk_compile_nothing_new(monkeypatch, page, q_dtype, kv_dtype):
    policy = KaraPolicy(KaraOptions(window=32, buffer=4, period=8))
    log = Launches(monkeypatch)
    pool = Pool(kv_dtype)
    warm_up_kernels(pool, list(range(LAYERS)), policy, [HQ], q_dtype, page)
    warm = log.take()
    p = 16
    rows = [(p + 32 + t, states(p, retention=r)) for t, r in ((0, None), (3, 0.5), (5, 0.13), (7, 1.0), (9, 0.9))]
    event_launches(policy, pool, q_dtype, page, rows, spans=(1, 2, 3, 15, 16, 17, 31))
    event = log.take()
    assert event and event <= warm, sorted(event - warm)


@pytest.mark.parametrize("page", [1, 16])
def test_threshold_events_with_any_budget_compile_nothing_new(monkeypatch, page):
    policy = SnapKVPolicy(SnapKVOptions(threshold=40, budget=20, window=4))
    log = Launches(monkeypatch)
    pool = Pool(torch.float32)
    warm_up_kernels(pool, list(range(LAYERS)), policy, [HQ], torch.float32, page)
    warm = log.take()
    p = 16
    rows = [(p + 41 + t, states(p, budget=b)) for t, b in ((0, None), (6, 7), (13, 33), (20, 21), (37, 2))]
    event_launches(policy, pool, torch.float32, page, rows)
    event = log.take()
    assert event and event <= warm, sorted(event - warm)
