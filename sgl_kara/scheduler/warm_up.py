"""Compiling the Triton kernels at start-up with the launches an event makes, so that no event
compiles anything mid-serving.

Triton compiles one kernel per specialisation: argument dtypes, constexprs, and for integers and
pointers whether they equal 1 and are divisible by 16 (pointers: 16-byte aligned; the launchers
align index tensors, kernels/_dispatch.aligned). The kernels fix their block sizes and do not
specialise the integers that vary from event to event (window, region and chunk lengths, kept
counts, slot counts, the strides that follow them: ``do_not_specialize``), so what is left to
compile is one kernel per model shape and dtype pair: the warm-up launches with the model's query
heads per layer (the GQA group), the model's dtype for queries and the pool's for keys, the
policy's own region shapes at its first due row lengths, and slot copies (page > 1).
tests/test_warm_up.py checks that events with any per-request retention or budget, and spread
chunks of any length, launch nothing the warm-up did not.
"""

from __future__ import annotations

import torch

from sgl_kara.policies.base import Region, RowView, ScoreInput
from sgl_kara.scheduler.state import KaraReqState

SCRATCH_SLOTS = 128
COPY_COUNTS = (1, 16, 17)  # Triton's integer classes: == 1, divisible by 16, neither


def first_due_length(policy, limit: int = 1 << 26) -> int | None:
    """Smallest row length (P = f = 0) at which the policy names a region (None: none below
    ``limit``); region() is monotone in the length for every policy here."""
    state = KaraReqState(protected=0, frontier=0)

    def due(n: int) -> bool:
        return policy.region(RowView(0, 0, n, 0, state)) is not None

    hi = 1
    while not due(hi):
        hi *= 2
        if hi > limit:
            return None
    lo = hi // 2  # not due (or 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if due(mid) else (mid, hi)
    return hi


def warm_up_regions(policy) -> list[Region]:
    """The policy's regions at its first 16 due row lengths, one per distinct shape: a region
    that grows with the row (threshold policies) takes both divisibility classes."""
    first = first_due_length(policy)
    if first is None:
        return []
    state = KaraReqState(protected=0, frontier=0)
    out: dict[tuple, Region] = {}
    for n in range(first, first + 16):
        r = policy.region(RowView(0, 0, n, 0, state))
        if r is not None:
            out.setdefault(r.shape, r)
    return list(out.values())


def warm_up_kernels(
    keys_of, layer_ids, policy, q_heads: list[int], q_dtype, page_size: int = 1
) -> None:
    """Launch what an event launches on scratch tensors: the policy's scoring for each of its
    region shapes and each query-head count (``q_heads``: the attention layers' on this rank),
    compaction of all layers, slot copies (page > 1). ``keys_of(layer_id)``: the pool's keys."""
    from sgl_kara.kernels.compact import compact_kv, copy_slots

    k = keys_of(layer_ids[0])
    hkv, d, dev, kv_dtype = k.shape[1], k.shape[2], k.device, k.dtype
    scratch_k = [
        torch.zeros(SCRATCH_SLOTS, hkv, d, dtype=kv_dtype, device=dev)
        for _ in layer_ids
    ]
    scratch_v = [torch.zeros_like(t) for t in scratch_k]
    half = SCRATCH_SLOTS // 2
    state = KaraReqState(protected=0, frontier=0)
    for region in warm_up_regions(policy):
        row = RowView(0, 0, region.start + region.length, 0, state)
        slots = (torch.arange(region.length, device=dev) % half)[None]
        for hq in q_heads:
            q = None
            if policy.needs_queries:
                q = torch.zeros(1, region.query_len, hq, d, dtype=q_dtype, device=dev)
            policy.score(ScoreInput(0, q, scratch_k[0], slots, [row], [region]))
        kk = region.keep
        src = (
            (torch.arange(kk, device=dev) % half)
            .view(1, 1, 1, kk)
            .expand(1, len(layer_ids), hkv, kk)
            .contiguous()
        )
        # Scratch: repeated destinations are harmless (check=False skips the uniqueness check).
        compact_kv(
            scratch_k,
            scratch_v,
            src,
            half + (torch.arange(kk, device=dev) % half)[None],
            check=False,
        )
    if page_size > 1:
        for n in COPY_COUNTS:
            idx = torch.arange(n, device=dev) % half
            copy_slots(scratch_k, scratch_v, idx, half + idx, disjoint=True)
    warm_up_step(scratch_k, scratch_v, policy, page_size)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def warm_up_step(scratch_k, scratch_v, policy, page_size: int) -> None:
    """An event's torch operations once, on scratch rows and slots: the scores' selection, the
    region slots' gather, the fresh slots' layout and the page ids, through compaction's own
    prepare and abort. CUDA loads a kernel's module at its first launch (lazily, by default),
    and loading waits for the device: the first event of a process would wait once for the
    forward in flight (bench/gpu_check.py's step section saw it on an H200).
    ``scratch_k`` / ``scratch_v``: the warm-up's scratch buffers, one per layer (their count,
    shape and dtype: the compaction kernels specialise on the layer count, so the step runs on
    as many layers as an event, each one the same small buffer sized for the page)."""
    from sgl_kara.mem_cache.compaction import CompactionPlan, prepare_compaction

    page = max(1, page_size)
    start = page if page_size > 1 else 0
    region = 2 * page if page_size > 1 else 4
    keep = region // 2
    length = start + region + 2 * page  # a tail after the region, on its own pages
    fresh_from = -(-length // page) * page  # fresh pages after the row's own slots
    slots = fresh_from + -(-(length - start) // page) * page
    like, layers = scratch_k[0], len(scratch_k)
    k = [like.new_zeros((slots, *like.shape[1:]))] * layers
    v = [scratch_v[0].new_zeros((slots, *scratch_v[0].shape[1:]))] * layers
    free = [torch.arange(fresh_from // page, slots // page, device=like.device)]

    def alloc(n: int):
        got, free[0] = free[0][: n // page], free[0][n // page :]
        if page_size <= 1:
            return got
        return (got[:, None] * page + torch.arange(page, device=like.device)).reshape(
            -1
        )

    row = torch.arange(length, dtype=torch.int32, device=like.device)[None]
    scores = torch.zeros(1, layers, like.shape[1], region, device=like.device)
    if policy.needs_tokens:  # token id 0 throughout: the same operations as any ids
        tokens = torch.zeros(1, region, dtype=torch.int64, device=like.device)
        kept = policy.select(scores, keep, tokens=tokens)
    else:
        kept = policy.select(scores, keep)
    plan = CompactionPlan(
        rows=torch.zeros(1, dtype=torch.int64, device=like.device),
        starts=[start],
        lengths=[length],
        region=region,
        kept=kept,
        row_ids=[0],
    )
    prepare_compaction(
        plan, row, k, v, alloc, lambda pages: None, page_size, check=False
    ).abort(lambda pages: None)
