"""Every Triton kernel of sgl_kara at serving shapes on one GPU, without SGLang.

    python bench/gpu_kernels.py --out DIR           # CUDA: Llama-3-8B, Qwen3-8B, Qwen3-0.6B shapes,
                                                    # and Qwen3-8B / Llama-3-70B ranks at TP 2 and 8
    python bench/gpu_kernels.py --small --out DIR   # tiny shapes, Triton interpreter on CPU
    python -m bench.gpu_kernels --small --reference --out DIR   # + each kernel timed against its reference

(``python bench/gpu_kernels.py`` and ``python -m bench.gpu_kernels`` are the same; the first form
runs where only torch, triton and this repository are at hand.)

Imports torch, triton and sgl_kara's kernels, policies, compaction and warm-up only (none of them
imports SGLang), so it runs in a venv that has torch and triton alone. For each shape (SHAPES: the
models served on one GPU, and one tensor-parallel rank of Qwen3-8B and Llama-3-70B at TP 2 and 8,
whose query and KV heads are the model's divided by TP, at least one KV head; bf16; Kara's
W = 512, U = 32, r = 0.25: regions of 480 keys keeping 120, and a spread part of PART_SIZE["cuda"]
= 256 queries against them; SnapKV's default threshold region; B requests per event, as many as a
quarter of the free device memory holds, at most 64) it runs the start-up warm-up
(scheduler/warm_up.py), then each kernel once against its torch reference -- compaction and slot
copies bit-exact against the kernels' documented effect, scores within the dtype's tolerance (TOL)
of the fp32 torch reference -- and times it (CUDA events, median of REPS). It reports achieved GB/s (compulsory bytes: what the kernel must read
and write) against the GPU's nominal memory bandwidth and a measured device copy, and whether any
launch after the warm-up compiled a kernel. Beside the kernels, the attention of a recompute forward
(the extend pass that recomputes a window's queries) at the shapes bench/scoring_cost.py prices
(RECOMPUTE: spread parts, whole windows), with torch's scaled_dot_product_attention standing in for
SGLang's extend attention. Results: DIR/gpu_kernels.json and DIR/gpu_kernels.md.
Exit status 1 if any check fails. ``plan()`` / ``estimate_seconds()`` bound the run time.

``--reference`` also times every kernel against its torch reference at one fixed size (serving-like
on CUDA; small on CPU, where the kernel column is Triton's interpreter: a correctness path, not a
speed, so read its ratio as orders of magnitude) and the vectorised ``select`` against the per-row
``select_ref`` loop: the table "kernel versus torch reference". With --out a run record
(bench/record.py) is written beside the results (run.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

MODELS = {
    "Llama-3-8B": dict(layers=32, q_heads=32, kv_heads=8, head_dim=128),
    "Qwen3-8B": dict(layers=36, q_heads=32, kv_heads=8, head_dim=128),
    "Qwen3-0.6B": dict(layers=28, q_heads=16, kv_heads=8, head_dim=128),
}
SMALL_MODELS = {"tiny-gqa": dict(layers=2, q_heads=4, kv_heads=2, head_dim=16)}
# Models served with tensor parallelism (their published configs) and the tensor-parallel sizes
# whose per-rank shapes run here beside MODELS (TP 1 of these is a shape of MODELS' kind: 8 KV
# heads, query heads a multiple of 16).
TP_MODELS = {
    "Qwen3-8B": dict(layers=36, q_heads=32, kv_heads=8, head_dim=128),
    "Llama-3-70B": dict(layers=80, q_heads=64, kv_heads=8, head_dim=128),
}
RANK_TPS = (2, 8)


def per_rank(spec: dict, tp: int) -> dict:
    """One tensor-parallel rank's shape: q_heads / tp query heads and max(1, kv_heads / tp) KV
    heads (SGLang replicates a KV head over the ranks when tp exceeds the KV heads)."""
    if tp < 1 or spec["q_heads"] % tp:
        raise ValueError(
            f"tp must divide the query heads ({spec['q_heads']}), got {tp}"
        )
    return dict(
        spec, q_heads=spec["q_heads"] // tp, kv_heads=max(1, spec["kv_heads"] // tp)
    )


RANK_SHAPES = {
    f"{name} TP{tp}": per_rank(spec, tp)
    for name, spec in TP_MODELS.items()
    for tp in RANK_TPS
}
SHAPES = {**MODELS, **RANK_SHAPES}  # what a CUDA run covers
KARA = dict(window=512, buffer=32, retention=0.25, period=128)
SMALL_KARA = dict(window=32, buffer=4, retention=0.25, period=8)
SNAPKV = dict(threshold=1280, budget=1024, window=32)
SMALL_SNAPKV = dict(threshold=40, budget=20, window=4)
MAX_BATCH, SMALL_BATCH = 64, 3
# The attention of a recompute forward (the extend pass that scores a window from recomputed
# queries): (requests, query tokens each, cached context each). Spread parts of 32 queries (the
# CPU's part size: a few requests' parts, the parts of one step at 256 running) and of 256 (CUDA's:
# a forward carries 292 query tokens at 64 running, 416 at 256), one whole window, the windows of
# a server due step; contexts of an H100's pool shared by 64 / 256 requests
# (bench/scoring_cost.py).
RECOMPUTE = [
    (3, 32, 6144),
    (9, 32, 1536),
    (1, 256, 6144),
    (2, 256, 1536),
    (1, 512, 6144),
    (16, 512, 6144),
]
SMALL_RECOMPUTE = [(2, 4, 40), (1, 16, 40)]
SMALL_PART = 8  # queries of a spread part at the small shapes (W = 32)
TAIL = 64  # rows per request moved by slot copies (a page-aligned tail)
REPS, SMALL_REPS = 10, 0  # 0: the first (checked) launch is the only one
# max |kernel - reference| / max |reference| per query dtype (fp32 accumulation in both).
TOL = {"float32": 1e-4, "bfloat16": 2e-3, "float16": 2e-3}
# Pessimistic rates for the time bound (an H100 does better on each).
EST_BYTES_PER_S = 0.5e12
EST_FLOPS_PER_S = 10e12
# per compiled specialisation (measured ~0.5-2 s for kernels this size); specialisations() counts
# them over the shapes
EST_COMPILE_S = 4.0
EST_START_S = 20.0  # CUDA context, imports


def kara_shape(small: bool) -> tuple[int, int, int]:
    """(query window W, region M, kept K) of the Kara policy benchmarked."""
    o = SMALL_KARA if small else KARA
    m = o["window"] - o["buffer"]
    return o["window"], m, math.ceil(round(o["retention"] * m, 6))


def snapkv_shape(small: bool) -> tuple[int, int, int]:
    """(query window w, region M, kept) at SnapKV's first due length (C_max + 1 generated)."""
    o = SMALL_SNAPKV if small else SNAPKV
    return o["window"], o["threshold"] + 1 - o["window"], o["budget"] - o["window"]


def part_size(small: bool) -> int:
    """Queries of a spread part: CUDA's (scheduler/spread.py's PART_SIZE), or SMALL_PART."""
    if small:
        return SMALL_PART
    from sgl_kara.scheduler.spread import PART_SIZE

    return PART_SIZE["cuda"]


def plan(small: bool, batch: int | None = None) -> list[dict]:
    """One row per (model, kernel): shapes, compulsory bytes and FLOPs of one launch."""
    models = SMALL_MODELS if small else SHAPES
    b = batch or (SMALL_BATCH if small else MAX_BATCH)
    w, m, k = kara_shape(small)
    part = part_size(small)
    sw, sm, _ = snapkv_shape(small)
    rows = []
    for name, s in models.items():
        L, hq, hkv, d, item = s["layers"], s["q_heads"], s["kv_heads"], s["head_dim"], 2
        row = hkv * d * item  # bytes of one slot of one layer, K or V
        rows += [
            dict(
                model=name,
                kernel="kara window scores",
                B=b,
                bytes=b * (w * hq * d * item + m * row),
                flops=2 * 2 * b * hq * w * m * d,
            ),
            dict(
                model=name,
                kernel=PART_KERNEL,
                B=b,
                bytes=b * (part * hq * d * item + m * row),
                flops=2 * 2 * b * hq * part * m * d,
            ),
            dict(
                model=name,
                kernel="kara window scores, fp16 queries / bf16 keys",
                B=b,
                bytes=b * (w * hq * d * item + m * row),
                flops=2 * 2 * b * hq * w * m * d,
            ),
            dict(
                model=name,
                kernel="snapkv scores",
                B=b,
                bytes=b * (sw * hq * d * item + sm * row),
                flops=2 * 2 * b * hq * sw * sm * d,
            ),
            dict(
                model=name,
                kernel="compact_kv",
                B=b,
                bytes=2 * 2 * L * b * k * row,
                flops=0,
            ),
            dict(
                model=name,
                kernel="copy_slots disjoint",
                B=b,
                bytes=2 * 2 * L * b * TAIL * row,
                flops=0,
            ),
            dict(
                model=name,
                kernel="copy_slots staged",
                B=b,
                bytes=2 * 4 * L * b * TAIL * row,
                flops=0,
            ),
        ]
        rows += [
            dict(
                model=name,
                kernel=recompute_kernel(r, n, ctx),
                B=r,
                bytes=r * (2 * n * hq * d * item + 2 * (ctx + n) * row),
                flops=4 * r * hq * n * (ctx + n) * d,
            )
            for r, n, ctx in (SMALL_RECOMPUTE if small else RECOMPUTE)
        ]
    return rows


PART_KERNEL = "kara window scores, a spread part"


def recompute_kernel(requests: int, queries: int, context: int) -> str:
    return f"recompute attention {requests} x {queries} over {context} (torch sdpa)"


def pool_slots(small: bool, batch: int) -> int:
    _, m, k = kara_shape(small)
    _, sm, _ = snapkv_shape(small)
    return 16 + batch * (max(m, sm) + k + 2 * TAIL)


def pool_bytes(spec: dict, slots: int) -> int:
    return 2 * spec["layers"] * slots * spec["kv_heads"] * spec["head_dim"] * 2


def _int_class(n: int) -> str:
    """Triton's specialisation of an integer argument: equal to 1, divisible by 16, or neither."""
    return "1" if n == 1 else "16" if n % 16 == 0 else "-"


def specialisations(
    shapes, score_dtypes=(("bf16", "bf16"), ("fp16", "bf16")), slot_dtypes=("int64",)
) -> set[tuple]:
    """The kernels Triton compiles for ``shapes`` (dicts of layers, q_heads, kv_heads, head_dim;
    a bf16 pool): one per kernel, argument dtypes, constexprs and class (``_int_class``) of each
    specialised integer. Scores (``score_dtypes``: (queries, keys); ``slot_dtypes``: the region
    slots' index dtype) specialise on the query heads, the group and (the second pass) the KV
    heads; compaction on the layers and the KV heads; the slot copies on a slot's row (KV heads x
    head dim) and their block. What varies per event (window, region, kept and slot counts, their
    strides) is never specialised (``do_not_specialize``), nor are the strides that are multiples
    of the head dim (always divisible by 16)."""
    keys = set()
    for s in shapes:
        L, hq, hkv, d = s["layers"], s["q_heads"], s["kv_heads"], s["head_dim"]
        group = hq // hkv
        for qd, kd in score_dtypes:
            for sd in slot_dtypes:
                keys.add(("lse", qd, kd, sd, _int_class(hq), _int_class(group), d))
                keys.add(
                    (
                        "colsum",
                        qd,
                        kd,
                        sd,
                        _int_class(hq),
                        _int_class(hkv),
                        _int_class(group),
                        d,
                    )
                )
        keys.add(("compact", d, _int_class(L), _int_class(hkv)))
        row = hkv * d
        block = min(1024, 1 << (row - 1).bit_length())
        for kernel in ("copy_rows", "gather_rows", "scatter_rows"):
            keys.add((kernel, block, _int_class(row)))
    return keys


def estimate_seconds(small: bool = False, batch: int | None = None) -> float:
    """Upper bound of a CUDA run: start-up, per model the pool's initialisation, the references
    (a few x the kernel's bytes, FLOPs at a pessimistic fp32 rate), REPS + 2 launches per kernel,
    and every specialisation compiled once (``specialisations``: warm-up and events, plus the
    mixed-dtype scores)."""
    b = batch or MAX_BATCH
    total = EST_START_S
    models = SMALL_MODELS if small else SHAPES
    for spec in models.values():
        total += 3 * pool_bytes(spec, pool_slots(small, b)) / EST_BYTES_PER_S
    total += len(specialisations(models.values())) * EST_COMPILE_S
    for r in plan(small, b):
        total += (REPS + 2 + 4) * r["bytes"] / EST_BYTES_PER_S + (REPS + 2 + 2) * r[
            "flops"
        ] / EST_FLOPS_PER_S
    return total


# --------------------------------------------------------------------------------- running
def _setup(args):
    if args.small and not _cuda_available_quietly():
        # read when triton is first imported
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _cuda_available_quietly() -> bool:
    import torch

    return torch.cuda.is_available()


def sglang_loaded() -> bool:
    return any(
        mod is not None and (m == "sglang" or m.startswith("sglang."))
        for m, mod in list(sys.modules.items())
    )


def compiled_count() -> int | None:
    """Compiled kernels in Triton's in-process caches (None under the interpreter)."""
    from sgl_kara.kernels import compact, window_score

    kernels = [
        window_score._lse_kernel,
        window_score._colsum_kernel,
        compact._compact_kernel,
        compact._copy_rows_kernel,
        compact._gather_rows_kernel,
        compact._scatter_rows_kernel,
    ]
    total = 0
    for k in kernels:
        caches = getattr(k, "device_caches", None)
        if caches is None:
            return None
        if not all(
            isinstance(v, tuple) and isinstance(v[0], dict) for v in caches.values()
        ):
            return None  # another Triton's cache layout: not counted
        total += sum(len(v[0]) for v in caches.values())
    return total


class Timer:
    def __init__(self, cuda: bool):
        import torch

        self.torch, self.cuda = torch, cuda

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def once(self, fn) -> tuple[object, float]:
        self.sync()
        tic = time.perf_counter()
        out = fn()
        self.sync()
        return out, (time.perf_counter() - tic) * 1e3

    def median(self, fn, reps: int) -> float:
        if not self.cuda:
            return statistics.median(self.once(fn)[1] for _ in range(reps))
        times = []
        for _ in range(reps):
            a, b = (
                self.torch.cuda.Event(enable_timing=True),
                self.torch.cuda.Event(enable_timing=True),
            )
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)


def nominal_bandwidth() -> float | None:
    """Bytes/s from the device's memory clock and bus width (double data rate), if reported."""
    import torch

    if not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(0)
    clock, bus = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
    return 2 * clock * 1e3 * bus / 8 if clock and bus else None


def measured_copy_bandwidth(timer: Timer, nbytes: int) -> float:
    """Bytes/s of a device-to-device tensor copy (read + write counted)."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = timer.median(lambda: dst.copy_(src), 5)
    del src, dst
    return 2 * nbytes / (ms / 1e3)


def choose_batch(small: bool) -> int:
    """Requests per event: MAX_BATCH, or fewer when a quarter of the free memory cannot hold the
    largest model's pool (the references and snapshots take about as much again)."""
    import torch

    if small or not torch.cuda.is_available():
        return SMALL_BATCH if small else MAX_BATCH
    free = torch.cuda.mem_get_info()[0]
    spec = max(SHAPES.values(), key=lambda s: pool_bytes(s, 1))
    b = MAX_BATCH
    while b > 1 and pool_bytes(spec, pool_slots(False, b)) > free / 4:
        b //= 2
    return b


def run_model(
    name: str, spec: dict, small: bool, batch: int, timer: Timer, reps: int, dev: str
) -> list[dict]:
    import torch

    from sgl_kara.kernels.compact import compact_kv, copy_slots
    from sgl_kara.kernels.window_score import window_scores_paged_ref
    from sgl_kara.policies.base import Region, RowView, ScoreInput
    from sgl_kara.policies.kara import KaraOptions, KaraPolicy
    from sgl_kara.policies.snapkv import SnapKVOptions, SnapKVPolicy, snapkv_scores
    from sgl_kara.scheduler.state import KaraReqState
    from sgl_kara.scheduler.warm_up import warm_up_kernels

    L, hq, hkv, d = spec["layers"], spec["q_heads"], spec["kv_heads"], spec["head_dim"]
    dtype = torch.bfloat16
    w, m, k = kara_shape(small)
    sw, sm, _ = snapkv_shape(small)
    slots = pool_slots(small, batch)
    g = torch.Generator(device=dev).manual_seed(0)
    kb = [
        torch.randn(slots, hkv, d, device=dev, dtype=dtype, generator=g)
        for _ in range(L)
    ]
    vb = [
        torch.randn(slots, hkv, d, device=dev, dtype=dtype, generator=g)
        for _ in range(L)
    ]
    pool = type(
        "Pool",
        (),
        {"get_key_buffer": lambda self, layer_id: kb[layer_id], "start_layer": 0},
    )()
    kara = KaraPolicy(KaraOptions(**(SMALL_KARA if small else KARA)))
    snap = SnapKVPolicy(SnapKVOptions(**(SMALL_SNAPKV if small else SNAPKV)))
    plans = {r["kernel"]: r for r in plan(small, batch) if r["model"] == name}
    out = []

    def record(kernel: str, ok: bool, first_ms: float, ms: float, **figures):
        p = plans[kernel]
        out.append(
            dict(
                model=name,
                kernel=kernel,
                B=batch,
                ok=bool(ok),
                first_ms=round(first_ms, 3),
                ms=round(ms, 4),
                gb_s=round(p["bytes"] / (ms / 1e3) / 1e9, 1) if ms > 0 else None,
                tflop_s=round(p["flops"] / (ms / 1e3) / 1e12, 2)
                if ms > 0 and p["flops"]
                else None,
                **figures,
            )
        )

    def timed(fn, first_ms: float) -> float:
        return first_ms if reps == 0 else timer.median(fn, reps)

    compiled0 = compiled_count()
    _, warm_ms = timer.once(
        lambda: (
            warm_up_kernels(pool.get_key_buffer, list(range(L)), kara, [hq], dtype, 64),
            warm_up_kernels(pool.get_key_buffer, list(range(L)), snap, [hq], dtype, 64),
        )
    )
    compiled_warm = compiled_count()

    # Disjoint slot sets: [0, 16) padding; per request its region, kept destinations, tails.
    perm = torch.randperm(slots - 16, device=dev, generator=g) + 16
    per = max(m, sm) + k + 2 * TAIL
    blocks = perm[: batch * per].view(batch, per)
    region, dst = blocks[:, :m], blocks[:, max(m, sm) : max(m, sm) + k]
    tail_src = blocks[:, max(m, sm) + k : max(m, sm) + k + TAIL].reshape(-1)
    tail_dst = blocks[:, max(m, sm) + k + TAIL :].reshape(-1)
    state = KaraReqState(protected=0, frontier=0)

    def scores_check(policy, q, slots_, regions, ref):
        inp = ScoreInput(
            0, q, kb[0], slots_, [RowView(0, 0, 0, 0, state)] * batch, regions
        )
        got, first = timer.once(lambda: policy.score(inp))
        want = ref()
        err = float(
            ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        )
        ms = timed(lambda: policy.score(inp), first)
        return err, first, ms

    # Kara scores (bf16 queries and keys) of n queries (a window, a spread part); the fp16-query
    # case runs after the event launches.
    def kara_scores(kernel, qd, n=w):
        q = torch.randn(batch, n, hq, d, device=dev, generator=g).to(qd)
        kreg = [Region(0, m, k, 0, n)] * batch
        err, first, ms = scores_check(
            kara, q, region, kreg, lambda: window_scores_paged_ref(q, kb[0], region)
        )
        tol = TOL[str(qd).replace("torch.", "")]
        record(kernel, err <= tol, first, ms, rel_err=err, tol=tol)

    kara_scores("kara window scores", dtype)
    # A spread part: its queries against the whole region (an event launch: the warm-up's kernel).
    kara_scores(PART_KERNEL, dtype, part_size(small))
    # SnapKV scores: its observation window against its first due region.
    sregion = blocks[:, :sm]
    q = torch.randn(batch, sw, hq, d, device=dev, dtype=dtype, generator=g)
    sreg = [Region(0, sm, snapkv_shape(small)[2], sm, sw)] * batch
    err, first, ms = scores_check(
        snap,
        q,
        sregion,
        sreg,
        lambda: snapkv_scores(q, kb[0][sregion.long()], snap.options.kernel),
    )
    record(
        "snapkv scores",
        err <= TOL["bfloat16"],
        first,
        ms,
        rel_err=err,
        tol=TOL["bfloat16"],
    )
    del q

    # compact_kv: kept entries of every layer and head into fresh slots, bit-exact.
    src = kept_sources(region, L, hkv, k, g)
    want = compaction_expected(kb, vb, src)
    _, first = timer.once(lambda: compact_kv(kb, vb, src, dst))
    exact = compaction_matches(want, dst)
    del want
    # idempotent: src, dst disjoint
    ms = timed(lambda: compact_kv(kb, vb, src, dst), first)
    record("compact_kv", exact, first, ms)

    # copy_slots: tails to fresh pages (disjoint), then an overlapping shift (staged).
    want = copy_expected(kb, vb, tail_src)
    _, first = timer.once(lambda: copy_slots(kb, vb, tail_src, tail_dst, disjoint=True))
    exact = copy_matches(want, tail_dst)
    ms = timed(lambda: copy_slots(kb, vb, tail_src, tail_dst, disjoint=True), first)
    record("copy_slots disjoint", exact, first, ms)
    # Every launch so far is one an event makes: each must have found its kernel compiled by the
    # warm-up. The mixed-dtype scores and the staged copy (no event launches them) follow.
    compiled_events = compiled_count()
    out.append(
        dict(
            model=name,
            kernel="warm-up covers the event launches",
            B=batch,
            ok=None if compiled0 is None else compiled_events == compiled_warm,
            compiled_by_warm_up=None
            if compiled0 is None
            else compiled_warm - compiled0,
            compiled_after=None
            if compiled0 is None
            else compiled_events - compiled_warm,
            first_ms=round(warm_ms, 1),
            ms=None,
        )
    )
    kara_scores("kara window scores, fp16 queries / bf16 keys", torch.float16)
    shift_src, shift_dst = tail_src, torch.roll(tail_src, 1)  # dst overlaps src
    want = copy_expected(kb, vb, shift_src)
    _, first = timer.once(lambda: copy_slots(kb, vb, shift_src, shift_dst))
    exact = copy_matches(want, shift_dst)
    del want
    ms = timed(lambda: copy_slots(kb, vb, shift_src, shift_dst), first)
    record("copy_slots staged", exact, first, ms)

    for r in out:
        r["warm_up_ms"] = round(warm_ms, 1)
    del kb, vb
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------ data movement, exactly
def kept_sources(region, layers: int, hkv: int, keep: int, g):
    """[B, layers, hkv, keep] int64 source slots of a compaction: per request, layer and head,
    ``keep`` random entries of the request's ``region`` [B, M] slots, in ascending order (what
    a selection hands compaction)."""
    import torch

    b, m = region.shape
    kept = torch.sort(
        torch.rand(b, layers, hkv, m, device=region.device, generator=g).argsort(-1)[
            ..., :keep
        ],
        -1,
    ).values
    return torch.gather(
        region.long()[:, None, None, :].expand(-1, layers, hkv, -1), 3, kept
    )


def compaction_expected(kb, vb, src) -> list:
    """What ``compact_kv(kb, vb, src, dst)`` must leave at ``dst``: per layer and buffer, each
    head's kept entries [B, H_kv, K, D], read before the launch."""
    import torch

    heads = torch.arange(src.shape[2], device=src.device)[None, :, None]
    return [
        (buf[src[:, layer_id], heads], buf)
        for layer_id in range(src.shape[1])
        for buf in (kb[layer_id], vb[layer_id])
    ]


def compaction_matches(expected: list, dst) -> bool:
    """Every buffer holds, at the destination slots [B, K], bit for bit what it should."""
    import torch

    hkv = expected[0][0].shape[1]
    heads = torch.arange(hkv, device=dst.device)[None, :, None]
    rows = dst.long()[:, None, :].expand(-1, hkv, -1)
    return all(torch.equal(buf[rows, heads], x) for x, buf in expected)


def copy_expected(kb, vb, src) -> list:
    """What ``copy_slots(kb, vb, src, dst)`` must leave at ``dst``: the rows of ``src`` of every
    buffer, read before the launch."""
    return [(buf[src].clone(), buf) for buf in (*kb, *vb)]


def copy_matches(expected: list, dst) -> bool:
    import torch

    return all(torch.equal(buf[dst], x) for x, buf in expected)


def run_recompute(
    name: str, spec: dict, small: bool, timer: Timer, reps: int, dev: str
) -> list[dict]:
    """The attention of a recompute forward at each RECOMPUTE shape, one layer, bf16: each
    request's query tokens attend to its cached context and to the window's tokens. torch's
    scaled_dot_product_attention stands in for SGLang's extend attention (this script imports no
    SGLang), without the causal mask inside the window (it would drop at most n / (2 (S + n)) of
    the FLOPs, and a mask keeps torch off its flash kernel); checked on the first request against
    softmax(Q K^T / sqrt(D)) V in fp32."""
    import torch
    import torch.nn.functional as F

    hq, hkv, d = spec["q_heads"], spec["kv_heads"], spec["head_dim"]
    plans = {r["kernel"]: r for r in plan(small) if r["model"] == name}
    g = torch.Generator(device=dev).manual_seed(1)
    out = []
    for r, n, ctx in SMALL_RECOMPUTE if small else RECOMPUTE:
        kernel = recompute_kernel(r, n, ctx)
        q = torch.randn(r, hq, n, d, device=dev, generator=g).to(torch.bfloat16)
        k = torch.randn(r, hkv, ctx + n, d, device=dev, generator=g).to(q.dtype)
        v = torch.randn(r, hkv, ctx + n, d, device=dev, generator=g).to(q.dtype)

        def attend(q=q, k=k, v=v):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        got, first = timer.once(attend)
        kf, vf = (t[:1].float().repeat_interleave(hq // hkv, dim=1) for t in (k, v))
        want = torch.softmax(q[:1].float() @ kf.transpose(-1, -2) / d**0.5, -1) @ vf
        err = float((got[:1].float() - want).abs().max() / want.abs().max())
        ms = first if reps == 0 else timer.median(attend, reps)
        p = plans[kernel]
        out.append(
            dict(
                model=name,
                kernel=kernel,
                B=r,
                ok=err <= TOL["bfloat16"] * 10,
                first_ms=round(first, 3),
                ms=round(ms, 4),
                gb_s=round(p["bytes"] / (ms / 1e3) / 1e9, 1) if ms > 0 else None,
                tflop_s=round(p["flops"] / (ms / 1e3) / 1e12, 2) if ms > 0 else None,
                rel_err=err,
                tol=TOL["bfloat16"] * 10,
            )
        )
        del q, k, v, kf, vf, want, got
    return out


# ------------------------------------------------------------------------ kernel versus reference
def reference_sizes(cuda: bool) -> dict:
    """One fixed size per op: serving-like on CUDA (32 requests, W 512, U 64, Llama-8B-like heads,
    32 layers, bf16); small on CPU (the interpreter runs one Python step per program)."""
    import torch

    if cuda:
        return dict(
            b=32,
            w=512,
            u=64,
            hq=32,
            hkv=8,
            d=128,
            layers=32,
            dtype=torch.bfloat16,
            tail=32,
        )
    return dict(
        b=2, w=256, u=32, hq=8, hkv=2, d=128, layers=4, dtype=torch.float32, tail=16
    )


def reference_rows(timer: Timer, dev: str, repeats: int) -> list[dict]:
    """Each op timed (median of ``repeats`` after a warm-up) as its torch reference and as the
    kernel; bytes = the minimum the op must read and write."""
    import torch

    from sgl_kara.kernels import (
        compact_kv,
        compact_kv_ref,
        copy_slots,
        copy_slots_ref,
        window_scores_paged,
        window_scores_paged_ref,
    )
    from sgl_kara.policies import kept_count, select, select_ref

    c = reference_sizes(dev == "cuda")
    torch.manual_seed(0)

    def ms(fn, reps=repeats):
        fn()
        return timer.median(fn, reps) if reps else timer.once(fn)[1]

    rows = []

    def row(op, shape, nbytes, ref_ms, kernel_ms, kernel="triton"):
        rows.append(
            dict(
                op=op,
                shape=shape,
                bytes=nbytes,
                ref_ms=round(ref_ms, 3),
                kernel_ms=round(kernel_ms, 3),
                ref_gb_s=round(nbytes / ref_ms / 1e6, 3),
                kernel_gb_s=round(nbytes / kernel_ms / 1e6, 3),
                kernel_over_ref=round(kernel_ms / ref_ms, 2),
                kernel=kernel,
            )
        )

    b, w, m, hq, hkv, d, layers = (
        c["b"],
        c["w"],
        c["w"] - c["u"],
        c["hq"],
        c["hkv"],
        c["d"],
        c["layers"],
    )
    s = b * w + 64
    q = torch.randn(b, w, hq, d, device=dev).to(c["dtype"])
    kb = torch.randn(s, hkv, d, device=dev).to(c["dtype"])
    slots = torch.randperm(s, device=dev)[: b * m].view(b, m)
    row(
        "window_scores_paged",
        f"B={b} W={w} M={m} Hq={hq} Hkv={hkv} D={d} {str(c['dtype']).split('.')[-1]}",
        q.numel() * q.element_size()
        + b * m * hkv * d * kb.element_size()
        + b * hkv * m * 4,
        ms(lambda: window_scores_paged_ref(q, kb, slots)),
        ms(lambda: window_scores_paged(q, kb, slots, use_triton=True)),
    )

    n = b * layers * hkv
    a = torch.rand(n, m, device=dev)
    sample = a[: min(n, 32)].cpu()
    loop_ms = (
        ms(lambda: [select_ref(r, 0.2, 16, 8) for r in sample], 1) * n / sample.shape[0]
    )
    row(
        "select (vectorised torch; reference: the select_ref loop, timed on <= 32 rows, scaled)",
        f"N={n} M={m} r=0.2 alpha=16 gamma=8",
        a.numel() * 4,
        loop_ms,
        ms(lambda: select(a, 0.2, 16, 8)),
        kernel="torch",
    )

    k = kept_count(m, 0.2)
    s = b * m + b * k + 8
    kbs = [torch.randn(s, hkv, d, device=dev).to(c["dtype"]) for _ in range(layers)]
    vbs = [torch.randn(s, hkv, d, device=dev).to(c["dtype"]) for _ in range(layers)]
    src = torch.sort(
        torch.rand(b, layers, hkv, m, device=dev).argsort(-1)[..., :k], -1
    ).values
    src = src + (torch.arange(b, device=dev) * m).view(b, 1, 1, 1)
    dst = (b * m + torch.arange(b * k, device=dev)).view(b, k)
    row(
        "compact_kv",
        f"B={b} L={layers} Hkv={hkv} D={d} K={k}",
        2 * 2 * b * layers * hkv * k * d * kbs[0].element_size(),
        ms(lambda: compact_kv_ref(kbs, vbs, src, dst)),
        ms(lambda: compact_kv(kbs, vbs, src, dst, use_triton=True, check=False)),
    )

    n = b * c["tail"]
    s = 4 * n
    kbs = [torch.randn(s, hkv, d, device=dev).to(c["dtype"]) for _ in range(layers)]
    vbs = [torch.randn(s, hkv, d, device=dev).to(c["dtype"]) for _ in range(layers)]
    src, dst = torch.arange(n, device=dev) * 2, torch.arange(n, device=dev) * 2 + 1
    row(
        "copy_slots",
        f"L={layers} N={n} Hkv={hkv} D={d}",
        2 * 2 * layers * n * hkv * d * kbs[0].element_size(),
        ms(lambda: copy_slots_ref(kbs, vbs, src, dst)),
        ms(lambda: copy_slots(kbs, vbs, src, dst, use_triton=True)),
    )
    return rows


def reference_table(rows: list[dict], cuda: bool) -> list[str]:
    kind = "Triton (CUDA)" if cuda else "Triton interpreter (TRITON_INTERPRET=1)"
    lines = [
        "",
        "### Kernel versus torch reference",
        "",
        f"| op | shape | reference ms | ref GB/s | kernel ({kind}) ms | kernel GB/s | kernel / reference time |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['op']} | {r['shape']} | {r['ref_ms']} | {r['ref_gb_s']} | {r['kernel_ms']} | {r['kernel_gb_s']} "
        f"| {r['kernel_over_ref']}x |"
        for r in rows
    ]
    if not cuda:
        lines += [
            "",
            "No GPU: the kernel column is Triton's CPU interpreter (correctness, not speed); its ratio "
            "to torch is no GPU prediction.",
        ]
    return lines


def run_record(out: str, argv):
    """bench/record.py's run record in ``out``, or None (with a note) when this file runs as a
    script without the repository root on the import path (``python -m bench.gpu_kernels`` has it)."""
    try:
        from bench.record import RunRecord
    except ImportError:
        print(
            "no run record: bench.record is not importable (run as python -m bench.gpu_kernels from the "
            "repository root)",
            flush=True,
        )
        return None
    return RunRecord(out, argv)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--small",
        "--cpu",
        action="store_true",
        dest="small",
        help="tiny shapes; on a machine without CUDA, under the Triton interpreter",
    )
    ap.add_argument(
        "--reference",
        action="store_true",
        help="also time every kernel against its torch reference at one fixed size",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed runs per op of --reference (median)",
    )
    args = ap.parse_args(argv)
    _setup(args)
    import torch
    import triton

    cuda = torch.cuda.is_available()
    if not cuda and not args.small:
        raise SystemExit(
            "no CUDA device: run with --small (Triton interpreter, tiny shapes)"
        )
    dev = "cuda" if cuda else "cpu"
    timer = Timer(cuda)
    batch = choose_batch(args.small)
    record = run_record(args.out, argv)
    tic = time.time()
    head = dict(
        date=time.strftime("%Y-%m-%d"),
        machine=record.data["machine"]["text"] if record else platform.node(),
        device=torch.cuda.get_device_name(0) if cuda else "cpu (Triton interpreter)",
        torch=torch.__version__,
        triton=triton.__version__,
        shapes="small" if args.small else "serving",
        batch=batch,
        reps=SMALL_REPS if args.small else REPS,
        kara=SMALL_KARA if args.small else KARA,
        snapkv=SMALL_SNAPKV if args.small else SNAPKV,
        estimate_s=round(estimate_seconds(args.small, batch), 1),
        sglang_imported=sglang_loaded(),
    )
    if cuda:
        nominal = nominal_bandwidth()
        head["nominal_gb_s"] = None if nominal is None else round(nominal / 1e9)
        head["copy_gb_s"] = round(measured_copy_bandwidth(timer, 1 << 30) / 1e9)
    rows = []
    for name, spec in (SMALL_MODELS if args.small else SHAPES).items():
        try:
            rows += run_model(name, spec, args.small, batch, timer, head["reps"], dev)
            rows += run_recompute(name, spec, args.small, timer, head["reps"], dev)
        except Exception as e:  # noqa: BLE001 - recorded, the other shapes still run
            rows.append(
                dict(
                    model=name,
                    kernel="(all)",
                    ok=False,
                    error=f"{type(e).__name__}: {e}"[:500],
                )
            )
        print(
            f"{name}: {sum(r['ok'] is not False for r in rows if r['model'] == name)} / "
            f"{sum(r['model'] == name for r in rows)} ok ({time.time() - tic:.0f} s)",
            flush=True,
        )
    head["seconds"] = round(time.time() - tic, 1)
    head["sglang_imported"] = head["sglang_imported"] or sglang_loaded()
    peak = head.get("nominal_gb_s") or head.get("copy_gb_s")
    for r in rows:
        if peak and r.get("gb_s"):
            r["of_peak"] = round(r["gb_s"] / peak, 3)
    reference = reference_rows(timer, dev, args.repeats) if args.reference else []
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_kernels.json"), "w") as f:
        json.dump(
            {"head": head, "rows": rows, "reference": reference},
            f,
            indent=1,
            default=str,
        )
    cols = "model kernel B ok first_ms ms gb_s of_peak tflop_s rel_err".split()
    lines = [f"- {k}: {v}" for k, v in head.items()] + [
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        lines.append(
            "| "
            + " | ".join("-" if r.get(c) is None else str(r.get(c)) for c in cols)
            + " |"
        )
    if reference:
        lines += reference_table(reference, cuda)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "gpu_kernels.md"), "w") as f:
        f.write(text)
    print(text)
    if record is not None:
        record.finish()
    failed = [r for r in rows if r["ok"] is False] or head["sglang_imported"]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
