"""The first-GPU check: sgl_kara's device paths on one GPU, with torch and Triton only.

One command that tells, in a few minutes on one GPU without SGLang or model weights, whether
sgl_kara's device paths do what the CPU tests say.

    python -m bench.gpu_check --out DIR            # CUDA: <= 8 minutes on an H100 / H200
    python -m bench.gpu_check --small --out DIR    # tiny shapes, Triton interpreter on CPU

Imports torch, triton and the parts of sgl_kara that import no SGLang (kernels, policies,
compaction, spread, staging, warm-up, and the sync check's module file), and bench/gpu_kernels.py's
pieces. Sections, each result printed as it comes with what it decides:

    kernels    every Triton kernel of sgl_kara.kernels at one tensor-parallel rank of Qwen3-8B and
               Llama-3-70B at TP 1, 2 and 8 (q_heads / tp query heads, max(1, kv_heads / tp) KV
               heads): window scores against a float64 softmax written here from Eq. 4, with
               int32 and int64 slots, in an ordinary pool and near the end of a 400,000-slot pool
               (a few layers; fewer slots where the device cannot hold it); compaction and slot
               copies (disjoint, staged) bit for bit against their documented effect; an int32
               index refused by the data-movement launchers
    spread     a window scored in parts (PART_SIZE["cuda"] queries, and a remainder) and added
               (spread.ScoringJob) equals the window scored whole
    select     the vectorised Kara ``select`` against the paper's per-row ``select_ref`` on the
               kernel's scores; the kept sets of kernel-scored against float64-scored windows
               (top-K and Kara's selection): the agreement, exact on every row whose decisions
               are farther from a tie than the kernel's error can move them
    staging    DeviceStaging.to_device behind a 30 ms device sleep: a step's worth of copies (64,
               more than any fixed ring holds) returns without waiting; a pageable copy, the
               control, waits; the values arrive
    step       a synthetic Kara step on the device (region slots gathered, a spread part and the
               rest scored per layer, select, prepare_compaction / commit over SGLang's free-list
               semantics, position offsets) under torch.cuda.set_sync_debug_mode("error") behind
               a one-second device sleep (on a CPU: under sgl_kara's sync check, which models a
               GPU there), at page sizes 1 and 16; every row, K/V entry, free page and offset
               checked afterwards; no kernel compiled in the step after the start-up warm-up
    bandwidth  each kernel's GB/s (and the scores' TFLOP/s) against the device's memory
               bandwidth: nominal from a table by device name, and a measured device copy

Results: DIR/gpu_check.json and DIR/gpu_check.md (written after every section, so a run cut short
keeps what it did), run.json beside them (bench/record.py). Exit status 1 if any check fails.
``--small`` runs every section at tiny shapes under TRITON_INTERPRET=1; what needs CUDA (timings,
the sleep, the sync debug mode) is reported "skipped: needs CUDA" and the rest still runs.
``estimate_seconds()`` bounds the CUDA run by construction (printed before it starts);
``--budget-s`` skips what would start past the budget.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from bench import gpu_kernels as gk

TP_SIZES = (1, 2, 8)
# TP_MODELS' published configs; the tiny models keep their ratios small enough for the interpreter
# (at TP 8 one query and one KV head).
SMALL_TP_MODELS = {
    "tiny-a": dict(layers=3, q_heads=16, kv_heads=2, head_dim=16),
    "tiny-b": dict(layers=2, q_heads=8, kv_heads=4, head_dim=16),
}
# W 512, U 32, r 0.25: 480 keys, 120 kept; alpha 16, gamma 8 (the paper's)
KARA = dict(gk.KARA)
# W 64 keeps 14 of 56 with alpha 7 and gamma 4: three Token2Chunk chunks, as the paper's two
SMALL_KARA = dict(window=64, buffer=8, retention=0.25, period=8, max_chunk=4)
BATCH, SMALL_BATCH = 16, 2  # requests per scoring launch
POOL_END, SMALL_POOL_END = 400_000, 3_000  # slots of the pool-end case (at most)
END_LAYERS = 2  # layers of the pool-end case
SMALL_PART = 16
# A window's queries split as a spread scores it: parts of the part size, and a part of the part
# size then what was decoded by the next scoring step, then the remainder.
SPLITS = ((256, 256), (256, 200, 56))
SMALL_SPLITS = ((16, 16, 16, 16), (16, 37, 11))
# Sum of parts against the whole window: only the fp32 summation order differs (a lost or doubled
# query would move the scores by ~1/W of a head's total).
SPREAD_TOL = 1e-4
TOL = gk.TOL[
    "bfloat16"
]  # kernel against the float64 reference, relative to its largest score
COPIES = 64  # staging copies of one step
SLEEP_MS = 30.0  # device sleep queued ahead of the staging copies
STEP_SLEEP_MS = 1000.0  # ... and ahead of the synthetic step
# The control's pageable copies wait: they return after at least this share of the sleep.
HOST_FRACTION = 0.5
STEP = dict(model="Qwen3-8B", tp=1, requests=8, prefix=100)
SMALL_STEP = dict(model="tiny-a", tp=1, requests=3, prefix=5)
PAGE_SIZES = (1, 16)
STEP_SCORE_LAYERS = (
    2  # layers of the step checked against float64 (the first and the last)
)
SELECT_REF_ROWS = 16  # rows of the step's selection checked against select_ref
REPS = gk.REPS
BUDGET_S = 480.0
# Memory bandwidth (TB/s) and dense bf16 tensor throughput (TFLOP/s) by device name, from NVIDIA's
# datasheets: every listed substring in the name (upper case), the first row that matches.
DEVICES = [
    (("GH200",), 4.0, 989.0),
    (("H200", "NVL"), 4.8, 835.0),
    (("H200",), 4.8, 989.0),
    (("H100", "NVL"), 3.9, 835.0),
    (("H100", "PCIE"), 2.0, 756.0),
    (("H100",), 3.35, 989.0),
    (("H800",), 3.35, 989.0),
    (("H20",), 4.0, 148.0),
    (("A100", "40GB"), 1.555, 312.0),
    (("A100", "PCIE"), 1.935, 312.0),
    (("A100",), 2.039, 312.0),
    (("B200",), 8.0, 2250.0),
    (("L40S",), 0.864, 362.0),
    (("L4",), 0.3, 121.0),
]
# The time bound (pessimistic; gpu_kernels' rates for bytes, FLOPs and compiles)
EST_FP64_FLOPS_PER_S = 1e12
EST_SELECT_REF_S = 0.02  # select_ref of one row of 480 scores (plain Python)
EST_STAGING_S = 10.0
# one synthetic step: its state, warm-up, the step, the checks (beside its sleep)
EST_STEP_S = 20.0
SECTIONS = {
    "kernels": "every Triton kernel against a float64 or exact reference",
    "spread": "spread parts add up to the whole window",
    "select": "top-K agreement",
    "staging": "the staging pool never waits",
    "step": "a synthetic Kara step makes the host wait for nothing",
    "bandwidth": "GB/s against the device's memory bandwidth",
}


# ------------------------------------------------------------------------------------ shapes
def kara_options(small: bool) -> dict:
    return SMALL_KARA if small else KARA


def kara_shape(small: bool) -> tuple[int, int, int]:
    """(W, M, K) of the Kara windows checked."""
    o = kara_options(small)
    m = o["window"] - o["buffer"]
    return o["window"], m, math.ceil(round(o["retention"] * m, 6))


def part_size(small: bool) -> int:
    return SMALL_PART if small else gk.part_size(False)


def shapes(small: bool) -> list[tuple[str, int, dict]]:
    """(model, tp, per-rank shape) of every shape the kernels are checked at."""
    models = SMALL_TP_MODELS if small else gk.TP_MODELS
    return [
        (name, tp, gk.per_rank(spec, tp))
        for name, spec in models.items()
        for tp in TP_SIZES
    ]


def shape_name(model: str, tp: int, spec: dict) -> str:
    return f"{model} TP{tp} ({spec['q_heads']} q / {spec['kv_heads']} kv heads)"


def pool_slots(small: bool, batch: int) -> int:
    """Slots of the ordinary pool: per request its region, kept destinations and two tails."""
    _, m, k = kara_shape(small)
    return 16 + batch * (m + k + 2 * gk.TAIL)


def slot_bytes(spec: dict) -> int:
    """One layer's K (or V) of one slot, bf16."""
    return spec["kv_heads"] * spec["head_dim"] * 2


def end_pool_slots(spec: dict, small: bool, free_bytes: int | None) -> int:
    """Slots of the pool-end case: POOL_END, or as many as a quarter of the free memory holds
    (K and V of END_LAYERS layers)."""
    want = SMALL_POOL_END if small else POOL_END
    if free_bytes is None:
        return want
    return min(want, int(free_bytes / 4 / (2 * END_LAYERS * slot_bytes(spec))))


def step_shape(small: bool) -> dict:
    o = SMALL_STEP if small else STEP
    models = SMALL_TP_MODELS if small else gk.TP_MODELS
    return gk.per_rank(models[o["model"]], o["tp"])


def kernel_plan(small: bool, spec: dict) -> dict:
    """Compulsory bytes and FLOPs of each timed launch at ``spec`` (bf16, BATCH requests)."""
    w, m, k = kara_shape(small)
    b = SMALL_BATCH if small else BATCH
    L, hq, d, row = spec["layers"], spec["q_heads"], spec["head_dim"], slot_bytes(spec)
    n = b * gk.TAIL
    return {
        "window scores": dict(
            bytes=b * (w * hq * d * 2 + m * row) + b * spec["kv_heads"] * m * 4,
            flops=2 * 2 * b * hq * w * m * d,
        ),
        "compact_kv": dict(bytes=2 * 2 * L * b * k * row, flops=0),
        "copy_slots disjoint": dict(bytes=2 * 2 * L * n * row, flops=0),
        "copy_slots staged": dict(bytes=2 * 4 * L * n * row, flops=0),
    }


def estimate_seconds(small: bool = False) -> float:
    """Upper bound of a CUDA run at these shapes: start-up; every kernel specialisation compiled
    once (gpu_kernels.specialisations: bf16, int32 and int64 slots); per shape the pools'
    initialisation (3 x their bytes), every launch (REPS + 4 x its bytes and FLOPs at the
    pessimistic rates, the parts and the pool-end case as many again), the float64 references
    and select_ref's rows; the staging probe; per page size two synthetic steps with their
    sleeps; the device copy."""
    w, m, k = kara_shape(small)
    b = SMALL_BATCH if small else BATCH
    total = gk.EST_START_S
    specs = [spec for _, _, spec in shapes(small)] + [step_shape(small)]
    total += gk.EST_COMPILE_S * len(
        gk.specialisations(
            specs, score_dtypes=(("bf16", "bf16"),), slot_dtypes=("int64", "int32")
        )
    )
    for spec in specs[:-1]:
        pools = 2 * spec["layers"] * pool_slots(small, b) * slot_bytes(spec)
        pools += 2 * END_LAYERS * end_pool_slots(spec, small, None) * slot_bytes(spec)
        total += 3 * pools / gk.EST_BYTES_PER_S
        for p in kernel_plan(small, spec).values():
            total += (
                2
                * (REPS + 4)
                * (p["bytes"] / gk.EST_BYTES_PER_S + p["flops"] / gk.EST_FLOPS_PER_S)
            )
        # two float64 references (ordinary pool, pool end) and the spread splits' launches
        ref_flops = 2 * b * spec["q_heads"] * w * m * spec["head_dim"]
        total += 2 * 3 * ref_flops / EST_FP64_FLOPS_PER_S
        total += b * spec["kv_heads"] * EST_SELECT_REF_S
    total += EST_STAGING_S
    spec = step_shape(small)
    step_ref = (
        STEP_SCORE_LAYERS
        * 2
        * (SMALL_STEP if small else STEP)["requests"]
        * spec["q_heads"]
        * w
        * m
        * spec["head_dim"]
    )
    total += (
        len(PAGE_SIZES)
        * 2
        * (
            STEP_SLEEP_MS / 1e3
            + EST_STEP_S
            + 3 * step_ref / EST_FP64_FLOPS_PER_S
            + SELECT_REF_ROWS * EST_SELECT_REF_S
        )
    )
    # the device copy, 6 times read and written
    total += 12 * (1 << 30) / gk.EST_BYTES_PER_S
    return total


# -------------------------------------------------------------------------------- reporting
class Report:
    """Results as they come: printed with their decision, and written (JSON, markdown) after
    every section."""

    def __init__(self, out: str, head: dict):
        self.out, self.head, self.results = out, head, []
        os.makedirs(out, exist_ok=True)

    def add(self, section, check, status, decision, shape=None, **figures):
        assert section in SECTIONS and status in ("pass", "fail", "skipped", "figure")
        r = dict(
            section=section,
            check=check,
            shape=shape,
            status=status,
            decision=decision,
            figures={k: _round(v) for k, v in figures.items()},
        )
        self.results.append(r)
        where = f" [{shape}]" if shape else ""
        print(f"[{section}] {status.upper()}: {check}{where}: {decision}", flush=True)
        return r

    def sections(self) -> dict:
        out = {}
        for name, title in SECTIONS.items():
            mine = [r for r in self.results if r["section"] == name]
            out[name] = dict(
                title=title,
                **{s: sum(r["status"] == s for r in mine) for s in STATUSES},
            )
        return out

    def passed(self) -> bool:
        return not any(
            r["status"] == "fail" for r in self.results
        ) and not self.head.get("sglang_imported")

    def write(self) -> None:
        data = dict(
            head=self.head,
            sections=self.sections(),
            results=self.results,
            passed=self.passed(),
        )
        Path(self.out, "gpu_check.json").write_text(
            json.dumps(data, indent=1, default=str)
        )
        Path(self.out, "gpu_check.md").write_text(markdown(data))


STATUSES = ("pass", "fail", "skipped", "figure")


def _round(v):
    if isinstance(v, float):
        return float(f"{v:.4g}")
    return v


def markdown(data: dict) -> str:
    lines = ["# The first-GPU check", ""]
    lines += [f"- {k}: {v}" for k, v in data["head"].items()]
    lines += [f"- passed: {data['passed']}", "", "| section | " + " | ".join(STATUSES)]
    lines[-1] += " |"
    lines += ["|---|" + "---:|" * len(STATUSES)]
    for name, s in data["sections"].items():
        lines.append(f"| {name} | " + " | ".join(str(s[k]) for k in STATUSES) + " |")
    lines += [
        "",
        "| section | check | shape | result | figures | decision |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["results"]:
        figures = ", ".join(f"{k} {v}" for k, v in r["figures"].items())
        cells = [
            r["section"],
            r["check"],
            r["shape"] or "-",
            r["status"],
            figures or "-",
            r["decision"],
        ]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ the context
class Context:
    """What every section shares: the device, the timer, the run's mode and its time budget."""

    def __init__(self, small: bool, cuda: bool, budget_s: float):
        import torch

        self.torch, self.small, self.cuda = torch, small, cuda
        self.dev = "cuda" if cuda else "cpu"
        self.timer = gk.Timer(cuda)
        self.reps = 0 if small or not cuda else REPS
        self.batch = SMALL_BATCH if small else BATCH
        self.w, self.m, self.k = kara_shape(small)
        self.part = part_size(small)
        self.splits = SMALL_SPLITS if small else SPLITS
        self.start = time.time()
        self.budget_s = budget_s
        self.timings: list[
            dict
        ] = []  # (kernel, shape, ms, bytes, flops) for "bandwidth"
        self.cycles_per_ms: float | None = None

    def elapsed(self) -> float:
        return time.time() - self.start

    def over_budget(self, need_s: float) -> bool:
        return self.elapsed() + need_s > self.budget_s

    def free_bytes(self) -> int | None:
        return self.torch.cuda.mem_get_info()[0] if self.cuda else None

    def release(self) -> None:
        """The caching allocator's free blocks back to the device (after a failed check too:
        a device fault there is already reported)."""
        if self.cuda:
            try:
                self.torch.cuda.synchronize()
                self.torch.cuda.empty_cache()
            except RuntimeError:
                pass

    def time_launch(self, kernel, shape, fn, nbytes, flops, first_ms) -> None:
        """Median time of ``fn`` (CUDA events, REPS) recorded for the bandwidth section."""
        if not self.cuda:
            return
        ms = self.timer.median(fn, self.reps) if self.reps else first_ms
        self.timings.append(
            dict(kernel=kernel, shape=shape, ms=ms, bytes=nbytes, flops=flops)
        )

    def kv_layer(self, slots: int, hkv: int, d: int, g):
        """One layer's K (or V) [slots, hkv, d] bf16: Gaussian entries, each slot scaled by
        exp(N(0, 1) / 2), so that keys draw attention unevenly (attention concentrates as in
        a model) and scores are rarely near ties."""
        torch = self.torch
        x = torch.randn(
            slots, hkv, d, device=self.dev, dtype=torch.bfloat16, generator=g
        )
        scale = torch.randn(slots, 1, 1, device=self.dev, generator=g).mul_(0.5).exp_()
        return x.mul_(scale.to(torch.bfloat16))


def rel_err(got, want) -> float:
    """max |got - want| / max |want| (float64)."""
    want = want.double()
    return float(
        ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()
    )


def scores_fp64(q, k_buffer, slots):
    """Eq. 4 in float64, one request at a time: [B, H_kv, M] = sum over the window's queries and
    each KV head's query heads of softmax over the region's keys of q . k / sqrt(D)."""
    import torch

    b, w, hq, d = q.shape
    hkv = k_buffer.shape[1]
    out = torch.empty(b, hkv, slots.shape[1], dtype=torch.float64, device=q.device)
    for i in range(b):
        k = k_buffer[slots[i].long()].double()  # [M, H_kv, D]
        qi = q[i].double().view(w, hkv, hq // hkv, d)
        logits = torch.einsum("wkgd,mkd->kgwm", qi, k) / math.sqrt(d)
        out[i] = torch.softmax(logits, dim=-1).sum(dim=(1, 2))
    return out


# ---------------------------------------------------------------- kernels, spread, select
def check_shape(
    rep: Report, ctx: Context, model: str, tp: int, spec: dict, first: bool
):
    """Sections kernels, spread and select at one per-rank shape."""
    torch, dev = ctx.torch, ctx.dev
    from sgl_kara.kernels.compact import compact_kv, copy_slots
    from sgl_kara.kernels.window_score import window_scores_paged

    L, hq, hkv, d = spec["layers"], spec["q_heads"], spec["kv_heads"], spec["head_dim"]
    w, m, k, b = ctx.w, ctx.m, ctx.k, ctx.batch
    name = shape_name(model, tp, spec)
    plan = kernel_plan(ctx.small, spec)
    g = torch.Generator(device=dev).manual_seed(1000 * tp + len(model))

    def scores(q, kbuf, slots):
        return window_scores_paged(q, kbuf, slots, use_triton=True)

    # The ordinary pool: every layer; slots [16, S) handed out at random.
    s = pool_slots(ctx.small, b)
    kb = [ctx.kv_layer(s, hkv, d, g) for _ in range(L)]
    vb = [ctx.kv_layer(s, hkv, d, g) for _ in range(L)]
    per = m + k + 2 * gk.TAIL
    blocks = (torch.randperm(s - 16, device=dev, generator=g) + 16)[: b * per]
    blocks = blocks.view(b, per)
    region, dst = blocks[:, :m], blocks[:, m : m + k]
    tail_src = blocks[:, m + k : m + k + gk.TAIL].reshape(-1)
    tail_dst = blocks[:, m + k + gk.TAIL :].reshape(-1)
    q = torch.randn(b, w, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
    ref = scores_fp64(q, kb[0], region)

    # (a) window scores: int64 and int32 slots, against float64
    whole = None
    for idx in (torch.int64, torch.int32):
        slots = region.to(idx)
        got, first_ms = ctx.timer.once(lambda slots=slots: scores(q, kb[0], slots))
        err = rel_err(got, ref)
        label = str(idx).replace("torch.", "")
        rep.add(
            "kernels",
            f"window scores, {label} slots",
            "pass" if err <= TOL else "fail",
            f"max error {err:.2g} of the largest score (tolerance {TOL:g}) -> "
            + (
                f"the kernel scores {label} slots as Eq. 4 does"
                if err <= TOL
                else f"the kernel's scores are wrong with {label} slots"
            ),
            shape=name,
            rel_err=err,
            tol=TOL,
        )
        if idx == torch.int64:
            whole = got
            ctx.time_launch(
                "window scores",
                name,
                lambda: scores(q, kb[0], region),
                plan["window scores"]["bytes"],
                plan["window scores"]["flops"],
                first_ms,
            )

    # (a) compaction and slot copies, bit for bit
    src = gk.kept_sources(region, L, hkv, k, g)
    want = gk.compaction_expected(kb, vb, src)
    _, first_ms = ctx.timer.once(lambda: compact_kv(kb, vb, src, dst, use_triton=True))
    exact = gk.compaction_matches(want, dst)
    del want
    rep.add(
        "kernels",
        "compact_kv, every layer",
        "pass" if exact else "fail",
        "the kept entries of every layer and head sit at the fresh slots, bit for bit"
        if exact
        else "compaction moved the wrong entries",
        shape=name,
        layers=L,
    )
    ctx.time_launch(
        "compact_kv",
        name,
        lambda: compact_kv(kb, vb, src, dst, use_triton=True),
        plan["compact_kv"]["bytes"],
        0,
        first_ms,
    )
    for label, s_src, s_dst, disjoint in (
        ("copy_slots disjoint", tail_src, tail_dst, True),
        ("copy_slots staged", tail_src, torch.roll(tail_src, 1), False),
    ):
        want = gk.copy_expected(kb, vb, s_src)
        _, first_ms = ctx.timer.once(
            lambda s_src=s_src, s_dst=s_dst, disjoint=disjoint: copy_slots(
                kb, vb, s_src, s_dst, use_triton=True, disjoint=disjoint
            )
        )
        exact = gk.copy_matches(want, s_dst)
        del want
        rep.add(
            "kernels",
            f"{label}, every layer",
            "pass" if exact else "fail",
            ("the rows arrive bit for bit" if exact else "the copy is wrong")
            + (
                ""
                if disjoint
                else " (destinations overlap the sources: staged through the workspace)"
            ),
            shape=name,
        )
        ctx.time_launch(
            label,
            name,
            lambda s_src=s_src, s_dst=s_dst, disjoint=disjoint: copy_slots(
                kb, vb, s_src, s_dst, use_triton=True, disjoint=disjoint
            ),
            plan[label]["bytes"],
            0,
            first_ms,
        )

    if first:  # the launchers' contract: data movement takes int64 slots only
        refused = []
        for label, fn in (
            (
                "compact_kv",
                lambda: compact_kv(kb, vb, src.int(), dst.int(), use_triton=True),
            ),
            (
                "copy_slots",
                lambda: copy_slots(
                    kb, vb, tail_src.int(), tail_dst.int(), use_triton=True
                ),
            ),
        ):
            try:
                fn()
                refused.append(f"{label}: accepted")
            except ValueError as e:
                if "int64" not in str(e):
                    refused.append(f"{label}: {e}")
        rep.add(
            "kernels",
            "int32 slots to the data-movement launchers",
            "fail" if refused else "pass",
            "; ".join(refused)
            if refused
            else "refused with an error naming int64 -> compaction's int64 indices are the "
            "only ones they take (no index is narrowed)",
            shape=name,
        )

    # (b) spread: the window in parts, added, against the window whole
    from sgl_kara.policies.base import Region
    from sgl_kara.scheduler.spread import ScoringJob

    for split in ctx.splits:
        job = ScoringJob(Region(0, m, k, 0, w))
        for n in split:
            lo = job.done
            job.add(scores(q[:, lo : lo + n].contiguous(), kb[0], region), n)
        err = rel_err(job.scores, whole)
        err64 = rel_err(job.scores, ref)
        ok = job.done == w and err <= SPREAD_TOL and err64 <= TOL
        rep.add(
            "spread",
            "parts " + " + ".join(map(str, split)) + f" of a {w}-query window",
            "pass" if ok else "fail",
            f"the parts' sum is the whole window's scores within {err:.2g} "
            f"(tolerance {SPREAD_TOL:g}), float64's within {err64:.2g} -> "
            + (
                "a window scored in spread parts is the window scored at once"
                if ok
                else "spread parts do not add up to the window"
            ),
            shape=name,
            rel_err_whole=err,
            rel_err_fp64=err64,
        )

    check_select(rep, ctx, name, whole, ref)

    # (a) near the end of a large pool: END_LAYERS layers, the last slots handed out
    se = end_pool_slots(spec, ctx.small, ctx.free_bytes())
    kb = vb = None  # the ordinary pool's memory back before the large one
    ctx.release()
    ke = [ctx.kv_layer(se, hkv, d, g) for _ in range(END_LAYERS)]
    ve = [ctx.kv_layer(se, hkv, d, g) for _ in range(END_LAYERS)]
    n_end = b * (m + k)
    end = se - n_end + torch.randperm(n_end, device=dev, generator=g)
    region_e, dst_e = end[: b * m].view(b, m), end[b * m :].view(b, k)
    ref_e = scores_fp64(q, ke[0], region_e)
    for idx in (torch.int64, torch.int32):
        label = str(idx).replace("torch.", "")
        err = rel_err(scores(q, ke[0], region_e.to(idx)), ref_e)
        rep.add(
            "kernels",
            f"window scores, {label} slots near the end of a {se:,}-slot pool",
            "pass" if err <= TOL else "fail",
            f"max error {err:.2g} (tolerance {TOL:g}), slots up to {se - 1:,} -> "
            + (
                "slot offsets do not overflow"
                if err <= TOL
                else "keys read from the wrong place near the pool's end"
            ),
            shape=name,
            rel_err=err,
            pool_slots=se,
        )
    src_e = gk.kept_sources(region_e, END_LAYERS, hkv, k, g)
    want = gk.compaction_expected(ke, ve, src_e)
    compact_kv(ke, ve, src_e, dst_e, use_triton=True)
    exact = gk.compaction_matches(want, dst_e)
    del want
    rep.add(
        "kernels",
        f"compact_kv near the end of a {se:,}-slot pool",
        "pass" if exact else "fail",
        "bit for bit" if exact else "compaction is wrong near the pool's end",
        shape=name,
        layers=END_LAYERS,
    )
    n_copy = min(b * gk.TAIL, b * k)
    c_src, c_dst = region_e.reshape(-1)[:n_copy], dst_e.reshape(-1)[:n_copy]
    for label, s_src, s_dst, disjoint in (
        ("copy_slots disjoint", c_src, c_dst, True),
        ("copy_slots staged", c_src, torch.roll(c_src, 1), False),
    ):
        want = gk.copy_expected(ke, ve, s_src)
        copy_slots(ke, ve, s_src, s_dst, use_triton=True, disjoint=disjoint)
        exact = gk.copy_matches(want, s_dst)
        del want
        rep.add(
            "kernels",
            f"{label} near the end of a {se:,}-slot pool",
            "pass" if exact else "fail",
            "bit for bit" if exact else "the copy is wrong near the pool's end",
            shape=name,
        )
    ke = ve = None
    ctx.release()


def near_tie_free(ref, eps, keep: int, alpha: int, gamma: int):
    """Rows of ``ref`` [N, M] (float64, on the host) whose kept sets no score error up to ``eps``
    [N] can change: (top-K rows, Kara rows). Top-K: the K-th and (K+1)-th scores more than 2 eps
    apart. Kara's selection (select_ref: the top K0 = K - alpha, Token2Chunk's chunks, the fill in
    score order) reads the ranking at ranks K0 - 1 ... K only (the fill takes at most alpha
    entries, all ranked in [K0, K)): every gap there more than 2 eps; and of the chunks, whose
    R = (A[left] + A[right]) (gap - 1) moves by at most 2 eps (gamma - 2), the ones taken
    differ from the next candidate by more than 4 eps (gamma - 2)."""
    import torch

    n, m = ref.shape
    if keep >= m:
        ones = torch.ones(n, dtype=torch.bool)
        return ones, ones
    vals, order = torch.sort(ref, dim=1, descending=True, stable=True)
    gaps = vals[:, :-1] - vals[:, 1:]  # gap i: rank i against rank i + 1
    topk = gaps[:, keep - 1] > 2 * eps
    k0 = keep - alpha
    kara = (gaps[:, k0 - 1 : keep] > 2 * eps[:, None]).all(dim=1)
    n_chunks = min(alpha // (gamma - 2), k0 - 1) if alpha else 0
    if n_chunks > 0:
        for i in range(n):
            idx = sorted(order[i, :k0].tolist())
            a = ref[i].tolist()
            r = sorted(
                (
                    (a[lo] + a[hi]) * (hi - lo - 1)
                    for lo, hi in zip(idx, idx[1:])
                    if 1 < hi - lo < gamma
                ),
                reverse=True,
            )
            if len(r) > n_chunks and not (
                r[n_chunks - 1] - r[n_chunks] > 4 * float(eps[i]) * (gamma - 2)
            ):
                kara[i] = False
    return topk, kara


def agreement(a, b, m: int):
    """Per row, the share of ``a``'s kept indices [N, K] that ``b`` keeps too."""
    import torch

    n, k = a.shape
    ma = torch.zeros(n, m, dtype=torch.bool).scatter_(1, a, True)
    mb = torch.zeros(n, m, dtype=torch.bool).scatter_(1, b, True)
    return (ma & mb).sum(dim=1).double() / k


def check_select(rep: Report, ctx: Context, name: str, kernel_scores, ref) -> None:
    """Section select at one shape: select against select_ref, kernel against float64."""
    from sgl_kara.policies.kara import KaraOptions, KaraPolicy, select, select_ref

    m, k = ctx.m, ctx.k
    policy = KaraPolicy(KaraOptions(**kara_options(ctx.small)))
    alpha, gamma = min(policy.options.chunk_budget, k - 1), policy.options.max_chunk
    rows_k = kernel_scores.reshape(-1, m)
    rows_r = ref.reshape(-1, m)
    sel_k = policy.select(rows_k, k).cpu()
    host_k = rows_k.cpu()
    loop = [select_ref(row, k / m, alpha, gamma) for row in host_k]
    same = sum(sel_k[i].tolist() == loop[i] for i in range(len(loop)))
    rep.add(
        "select",
        "select = select_ref on the kernel's scores",
        "pass" if same == len(loop) else "fail",
        f"{same} / {len(loop)} rows keep the same {k} of {m} -> "
        + (
            "the vectorised selection on the device is the paper's"
            if same == len(loop)
            else "the vectorised selection differs from the paper's loop"
        ),
        shape=name,
        rows=len(loop),
        same=same,
    )
    host_r = rows_r.cpu()
    eps = (host_k.double() - host_r).abs().max(dim=1).values
    stable_topk, stable_kara = near_tie_free(host_r, eps, k, alpha, gamma)
    for label, chunk, stable in (
        ("top-K", 0, stable_topk),
        ("Kara select", alpha, stable_kara),
    ):
        kept_k = select(host_k, k / m, chunk, gamma)
        kept_r = select(host_r, k / m, chunk, gamma)
        agree = agreement(kept_k, kept_r, m)
        exact = int((agree[stable] == 1).sum())
        n_stable = int(stable.sum())
        ok = n_stable > 0 and exact == n_stable
        rep.add(
            "select",
            f"{label} of kernel scores against float64 scores",
            "pass" if ok else "fail",
            f"kept sets agree on {float(agree.mean()):.4f} of entries (lowest row "
            f"{float(agree.min()):.4f}); {exact} / {n_stable} rows away from near ties "
            "identical -> "
            + (
                "the kernel's error changes a kept set only at a near tie"
                if ok
                else (
                    "no row is far enough from a tie to judge"
                    if n_stable == 0
                    else "the kernel's error changes kept sets beyond near ties"
                )
            ),
            shape=name,
            rows=len(agree),
            stable_rows=n_stable,
            exact_stable=exact,
            mean_agreement=float(agree.mean()),
            min_agreement=float(agree.min()),
        )


# ---------------------------------------------------------------------------- staging
def sleep_cycles(ctx: Context, ms: float) -> int:
    """``torch.cuda._sleep`` cycles for ``ms`` milliseconds, calibrated once with CUDA events
    (the SM clock varies with boost; the calibration measures it)."""
    torch = ctx.torch
    if ctx.cycles_per_ms is None:
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        n = 5_000_000
        times = []
        for _ in range(3):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(n)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        ctx.cycles_per_ms = n / statistics.median(times)
    return int(ctx.cycles_per_ms * ms)


def sleep_ahead(ctx: Context, ms: float):
    """Queue a ``ms`` device sleep on the current stream; (start, end) events around it."""
    torch = ctx.torch
    cycles = sleep_cycles(ctx, ms)
    torch.cuda.synchronize()
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(cycles)
    b.record()
    return a, b


def staging_values(n: int) -> list[list[int]]:
    """The index lists of one step (rows, starts, job indices, token ids ...): varied lengths."""
    return [list(range(i * 7, i * 7 + 1 + (i * 37) % 300)) for i in range(n)]


def check_staging(rep: Report, ctx: Context) -> None:
    torch = ctx.torch
    from sgl_kara.scheduler.staging import DeviceStaging

    values = staging_values(COPIES)
    staging = DeviceStaging(torch.device(ctx.dev))
    if not ctx.cuda:
        outs = [staging.to_device(v) for v in values]
        ok = all(o.tolist() == v for o, v in zip(outs, values))
        rep.add(
            "staging",
            f"{COPIES} copies' values",
            "pass" if ok else "fail",
            "on a CPU the host tensor is the device tensor: values as given",
        )
        for check in (
            f"{COPIES} copies behind a {SLEEP_MS:g} ms device sleep",
            "control: a pageable copy behind the sleep",
        ):
            rep.add("staging", check, "skipped", "skipped: needs CUDA")
        return
    if hasattr(torch.cuda.get_device_properties(0), "clock_rate"):
        clock = torch.cuda.get_device_properties(0).clock_rate  # kHz: cycles per ms
    else:
        clock = None
    for round_ in ("a cold pool", "a warm pool"):
        start, end = sleep_ahead(ctx, SLEEP_MS)
        tic = time.perf_counter()
        outs = [staging.to_device(v) for v in values]
        host_ms = (time.perf_counter() - tic) * 1e3
        busy = not end.query()
        torch.cuda.synchronize()
        sleep_ms = start.elapsed_time(end)
        values_ok = all(o.cpu().tolist() == v for o, v in zip(outs, values))
        # The copies are queued behind the sleep: a host that waited for any of them waited
        # for the sleep, so it is over when they return. Still running: nothing waited.
        ok = busy and values_ok
        rep.add(
            "staging",
            f"{COPIES} copies behind a {SLEEP_MS:g} ms device sleep, {round_}",
            "pass" if ok else "fail",
            f"the step's copies returned in {host_ms:.2f} ms with a {sleep_ms:.1f} ms sleep "
            f"queued ahead, the sleep {'still running' if busy else 'over'} then; "
            f"{staging.buffers} pinned buffers; values "
            + ("right" if values_ok else "WRONG")
            + " -> "
            + (
                "the host does not wait on the device"
                if ok
                else "the values are wrong"
                if busy
                else "inconclusive: the copies' host work outlasted the sleep"
                if host_ms >= sleep_ms
                else "the host waited for the device"
            ),
            host_ms=host_ms,
            sleep_ms=sleep_ms,
            buffers=staging.buffers,
            cycles_per_ms=ctx.cycles_per_ms,
            clock_khz=clock,
        )
    grew = staging.buffers > COPIES
    rep.add(
        "staging",
        "the pool after two steps",
        "fail" if grew else "pass",
        f"{staging.buffers} buffers for {COPIES} copies a step -> "
        + (
            "the pool grows past the busiest step"
            if grew
            else "idle buffers are reused: the pool holds what the busiest step needed"
        ),
        buffers=staging.buffers,
    )
    start, end = sleep_ahead(ctx, SLEEP_MS)
    tic = time.perf_counter()
    for v in values[:4]:
        torch.tensor(v, device="cuda")
    host_ms = (time.perf_counter() - tic) * 1e3
    busy = not end.query()
    torch.cuda.synchronize()
    sleep_ms = start.elapsed_time(end)
    waited = not busy and host_ms >= HOST_FRACTION * sleep_ms
    rep.add(
        "staging",
        "control: a pageable copy behind the sleep",
        "pass" if waited else "fail",
        f"torch.tensor(values, device='cuda') returned in {host_ms:.1f} ms with a "
        f"{sleep_ms:.1f} ms sleep ahead -> "
        + (
            "an ordinary copy waits: the probe sees a wait where there is one"
            if waited
            else "an ordinary copy did not wait either: the probe cannot tell waits here"
        ),
        host_ms=host_ms,
        sleep_ms=sleep_ms,
    )


# ----------------------------------------------------------------------- the synthetic step
class FreeList:
    """The KV pool's free pages as SGLang 0.5.23's allocators keep them (without ``need_sort``):
    ``alloc(n)`` takes the first n / page_size pages of a device tensor (a slice: no copy, no
    wait) and returns their slots (page p holds slots p * page_size ...); ``free_page_ids(pages)``
    puts the pages back by concatenation (the token allocator at page size 1 behind the list,
    the paged allocator in front). No ``torch.unique``, no host read."""

    def __init__(self, pages, page_size: int):
        self.free_pages, self.page_size = pages, page_size

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc(self, need: int):
        import torch

        if need % self.page_size:
            raise ValueError(
                f"need ({need}) must be a multiple of the page size {self.page_size}"
            )
        n = need // self.page_size
        if n > len(self.free_pages):
            return None
        out, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        if self.page_size == 1:
            return out
        offs = torch.arange(self.page_size, device=out.device)
        return (out[:, None] * self.page_size + offs).reshape(-1)

    def free_page_ids(self, pages) -> None:
        import torch

        if pages.numel() == 0:
            return
        if self.page_size == 1:
            self.free_pages = torch.cat((self.free_pages, pages))
        else:
            self.free_pages = torch.cat((pages, self.free_pages))


class StepState:
    """A pool with requests whose oldest window is due: rows in a req_to_token table (int32, as
    SGLang's), each row's slots allocated from the free list (shuffled pages, as after serving
    a while), queries per layer, the device position offsets, and a snapshot of every row's K/V."""

    def __init__(self, ctx: Context, page: int, g):
        import torch

        o = SMALL_STEP if ctx.small else STEP
        spec = step_shape(ctx.small)
        self.spec, self.page = spec, page
        L, hq, hkv, d = (
            spec["layers"],
            spec["q_heads"],
            spec["kv_heads"],
            spec["head_dim"],
        )
        w, m, k = ctx.w, ctx.m, ctx.k
        n = o["requests"]
        self.starts = [
            o["prefix"] + 3 * i for i in range(n)
        ]  # the frontier: not page-aligned
        self.lengths = [a + w + (7 * i) % 41 for i, a in enumerate(self.starts)]
        self.rows = [(2 * i + 1) % (n + 3) for i in range(n)]
        from sgl_kara.mem_cache.compaction import fresh_slots_needed

        held = sum(-(-length // page) for length in self.lengths)
        fresh = sum(
            fresh_slots_needed(a, length, m, k, page) // page
            for a, length in zip(self.starts, self.lengths)
        )
        self.num_pages = 2 * (held + fresh) + 8
        self.free = FreeList(
            1 + torch.randperm(self.num_pages, device=ctx.dev, generator=g), page
        )
        slots = (self.num_pages + 1) * page  # page 0: SGLang's padding page
        self.kb = [ctx.kv_layer(slots, hkv, d, g) for _ in range(L)]
        self.vb = [ctx.kv_layer(slots, hkv, d, g) for _ in range(L)]
        self.req_to_token = torch.zeros(
            n + 3, max(self.lengths) + 64, dtype=torch.int32, device=ctx.dev
        )
        for row, length in zip(self.rows, self.lengths):
            got = self.free.alloc(-(-length // page) * page)
            self.req_to_token[row, :length] = got[:length].to(torch.int32)
        self.offsets = torch.zeros(n + 3, dtype=torch.int64, device=ctx.dev)
        self.q = [
            torch.randn(n, w, hq, d, device=ctx.dev, dtype=torch.bfloat16, generator=g)
            for _ in range(L)
        ]
        self.old_slots = [
            self.req_to_token[row, :length].long()
            for row, length in zip(self.rows, self.lengths)
        ]
        self.old_k = [[buf[s] for s in self.old_slots] for buf in self.kb]
        self.old_v = [[buf[s] for s in self.old_slots] for buf in self.vb]
        self.free_before = len(self.free.free_pages)

    def device_tensors(self) -> list:
        return [
            *self.kb,
            *self.vb,
            self.req_to_token,
            self.offsets,
            self.free.free_pages,
            *self.q,
        ]


def kara_step(ctx: Context, st: StepState, staging, policy, mark=None) -> dict:
    """One Kara step on ``st``: the rows and region starts staged to the device, the regions'
    slots gathered, the first spread part scored (a step ahead of the event, spread.ScoringJob)
    and the rest at the event, per layer with the Triton kernel; select; prepare_compaction and
    commit with the free list's alloc / free_page_ids; lengths and position offsets. Reads
    nothing back. ``mark(phase)`` is called after each phase (STEP_PHASES)."""
    torch = ctx.torch
    mark = mark or (lambda phase: None)
    from sgl_kara.mem_cache.compaction import CompactionPlan, prepare_compaction
    from sgl_kara.policies.base import Region, RowView, ScoreInput
    from sgl_kara.scheduler.spread import ScoringJob
    from sgl_kara.scheduler.state import KaraReqState

    w, m, k, part = ctx.w, ctx.m, ctx.k, ctx.part
    n, L = len(st.rows), st.spec["layers"]
    rows = staging.to_device(st.rows)
    starts = staging.to_device(st.starts)
    offs = torch.arange(m, device=rows.device)
    region_slots = st.req_to_token[rows[:, None], starts[:, None] + offs[None, :]].to(
        torch.int64
    )
    mark(STEP_PHASES[0])
    state = KaraReqState(protected=0, frontier=0)
    views = [
        RowView(0, a, length, 0, state) for a, length in zip(st.starts, st.lengths)
    ]
    region = Region(0, m, k, 0, w)

    def layer_scores(lo: int, hi: int):
        out = torch.empty(n, L, st.spec["kv_heads"], m, device=rows.device)
        for layer in range(L):
            q = st.q[layer][:, lo:hi].contiguous()
            inp = ScoreInput(layer, q, st.kb[layer], region_slots, views, [region] * n)
            out[:, layer] = policy.score(inp)
        return out

    job = ScoringJob(region)
    job.add(layer_scores(0, part), part)  # a spread part, a step ahead
    mark(STEP_PHASES[1])
    job.add(layer_scores(part, w), w - part)  # the rest at the event
    mark(STEP_PHASES[2])
    kept = policy.select(job.scores, k)
    mark(STEP_PHASES[3])
    plan = CompactionPlan(
        rows=rows,
        starts=list(st.starts),
        lengths=list(st.lengths),
        region=m,
        kept=kept,
        row_ids=list(st.rows),
        device_starts=starts,
        region_slots=region_slots,
    )
    prepared = prepare_compaction(
        plan,
        st.req_to_token,
        st.kb,
        st.vb,
        st.free.alloc,
        st.free.free_page_ids,
        st.page,
        check=False,
    )
    mark(STEP_PHASES[4])
    dropped = prepared.commit(st.req_to_token, st.free.free_page_ids)
    mark(STEP_PHASES[5])
    st.offsets[rows] += dropped
    lengths = staging.to_device([length - dropped for length in st.lengths])
    positions = lengths + st.offsets[rows]  # the next decode token's logical position
    mark(STEP_PHASES[6])
    return dict(scores=job.scores, kept=kept, dropped=dropped, positions=positions)


# The step's two runs at each page size, each on a fresh state: the first in the process at that
# page size, then the same step again (what a server's later events do).
STEP_RUNS = (
    "under set_sync_debug_mode('error') behind a device sleep, first run",
    "under set_sync_debug_mode('error') behind a device sleep, again",
)
STEP_PHASES = (
    "rows staged, region slots gathered",
    "a spread part scored",
    "the rest of the window scored",
    "select",
    "prepare_compaction (alloc, K/V copies)",
    "commit (rows rewritten, pages freed)",
    "lengths and position offsets",
)


class WaitProbe:
    """Which phases of a step made the host wait for the device: a device sleep is queued
    before the step (and again after any phase that waited); a phase that ends with the sleep
    already over, in far less host time than the sleep, waited for it. Queuing a sleep and
    asking an event waits for nothing."""

    def __init__(self, ctx: Context, ms: float):
        self.ctx, self.ms = ctx, ms
        self.waited: list[tuple[str, float]] = []  # (phase, host ms since the sleep)
        self.sleeps: list[float] = []  # device ms of each sleep (read after the step)
        self._events: list = []
        self.arm()

    def arm(self) -> None:
        torch = self.ctx.torch
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        cycles = sleep_cycles(self.ctx, self.ms)
        a.record()
        torch.cuda._sleep(cycles)
        b.record()
        self._events.append((a, b))
        self.end, self.tic = b, time.perf_counter()

    def __call__(self, phase: str) -> None:
        if self.end.query():
            self.waited.append((phase, (time.perf_counter() - self.tic) * 1e3))
            self.arm()

    def busy(self) -> bool:
        """Is the last sleep still running (nothing waited since it was queued)?"""
        return not self.end.query()

    def finish(self) -> None:
        """After a synchronize: the sleeps' device times."""
        self.sleeps = [a.elapsed_time(b) for a, b in self._events]


def verify_step(ctx: Context, st: StepState, out: dict) -> list[str]:
    """What is wrong after the step (empty: nothing), read back on the host: every row's new
    slots and their K/V against the snapshot and the kept indices, page alignment, the rows
    below the rewritten span untouched, the free list plus the rows' pages exactly the pool's
    pages, the offsets and positions, and the scores and selection against float64 and
    select_ref."""
    torch = ctx.torch
    from sgl_kara.policies.kara import KaraOptions, KaraPolicy, select_ref

    if ctx.cuda:
        torch.cuda.synchronize()
    m, k, page = ctx.m, ctx.k, st.page
    d = m - k
    problems = []
    if out["dropped"] != d:
        problems.append(f"dropped {out['dropped']}, not {d}")
    kept = out["kept"]
    held = [torch.zeros(1, dtype=torch.int64, device=ctx.dev)]  # page 0: padding
    for b, (row, a, length) in enumerate(zip(st.rows, st.starts, st.lengths)):
        new_len = length - d
        new = st.req_to_token[row, :new_len].long()
        s = a - a % page
        if not torch.equal(new[:s], st.old_slots[b][:s]):
            problems.append(f"row {row}: slots below {s} changed")
        if page > 1 and not torch.equal(
            new % page, torch.arange(new_len, device=new.device) % page
        ):
            problems.append(f"row {row}: a slot off its page position")
        held.append(torch.unique(torch.div(new, page, rounding_mode="floor")))
        for layer in range(st.spec["layers"]):
            for buf, old in (
                (st.kb[layer], st.old_k[layer][b]),
                (st.vb[layer], st.old_v[layer][b]),
            ):
                region = old[a : a + m].transpose(0, 1)  # [H_kv, M, D]
                idx = kept[b, layer][:, :, None].expand(-1, -1, region.shape[-1])
                want = torch.cat(
                    [
                        old[:a],
                        torch.gather(region, 1, idx).transpose(0, 1),
                        old[a + m : length],
                    ]
                )
                if not torch.equal(buf[new], want):
                    problems.append(f"row {row} layer {layer}: K/V not as selected")
                    break
    everything = torch.cat([st.free.free_pages, *held]).sort().values
    if not torch.equal(
        everything, torch.arange(st.num_pages + 1, device=everything.device)
    ):
        problems.append(
            f"free pages ({len(st.free.free_pages)}) and the rows' pages are not the pool's "
            f"{st.num_pages + 1} pages, each once"
        )
    rows = torch.tensor(st.rows, device=st.offsets.device)
    if not bool((st.offsets[rows] == d).all()) or int(st.offsets.sum()) != d * len(
        st.rows
    ):
        problems.append("position offsets not the drop count on every compacted row")
    if out["positions"].tolist() != list(st.lengths):
        problems.append(
            f"positions {out['positions'].tolist()} are not the logical lengths {st.lengths}"
        )
    # scores: the first and the last layer against float64 from the snapshot
    scores = out["scores"]
    n = len(st.rows)
    hkv = st.spec["kv_heads"]
    for layer in sorted({0, st.spec["layers"] - 1})[:STEP_SCORE_LAYERS]:
        keys = torch.stack(
            [st.old_k[layer][b][a : a + m] for b, a in enumerate(st.starts)]
        ).reshape(n * m, hkv, -1)
        slots = torch.arange(n * m, device=keys.device).view(n, m)
        err = rel_err(scores[:, layer], scores_fp64(st.q[layer], keys, slots))
        if err > TOL:
            problems.append(f"layer {layer}: scores off float64 by {err:.2g}")
    policy = KaraPolicy(KaraOptions(**kara_options(ctx.small)))
    alpha, gamma = min(policy.options.chunk_budget, k - 1), policy.options.max_chunk
    flat_s = scores.reshape(-1, m).cpu()
    flat_k = kept.reshape(-1, k).cpu()
    for i in range(0, flat_s.shape[0], max(1, flat_s.shape[0] // SELECT_REF_ROWS)):
        if flat_k[i].tolist() != select_ref(flat_s[i], k / m, alpha, gamma):
            problems.append(f"score row {i}: kept set is not select_ref's")
            break
    return problems


def load_sync_check():
    """sgl_kara/diagnostics/sync_check.py loaded from its file: the checker alone (it
    imports torch only), without the step observers its package registers."""
    import sgl_kara

    path = Path(sgl_kara.__file__).parent / "diagnostics" / "sync_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check_sync_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check_step(rep: Report, ctx: Context, page: int) -> None:
    """Section step at one page size: on CUDA the step under the sync debug mode behind a sleep;
    on a CPU under sgl_kara's sync check (KARA_CHECK_SYNC's, a GPU modelled)."""
    torch = ctx.torch
    from sgl_kara.kernels.compact import pointer_table
    from sgl_kara.policies.kara import KaraOptions, KaraPolicy
    from sgl_kara.scheduler.observers import Observers
    from sgl_kara.scheduler.staging import DeviceStaging
    from sgl_kara.scheduler.warm_up import warm_up_kernels

    o = SMALL_STEP if ctx.small else STEP
    spec = step_shape(ctx.small)
    where = f"{shape_name(o['model'], o['tp'], spec)}, page {page}"
    policy = KaraPolicy(KaraOptions(**kara_options(ctx.small)))

    def prepared(seed: int):
        g = torch.Generator(device=ctx.dev).manual_seed(seed)
        st = StepState(ctx, page, g)
        # start-up, as the runtime's warm-up: compile the kernels, build the pool's pointer tables
        warm_up_kernels(
            lambda i: st.kb[i],
            list(range(spec["layers"])),
            policy,
            [spec["q_heads"]],
            torch.bfloat16,
            page,
        )
        pointer_table(st.kb)
        pointer_table(st.vb)
        if ctx.cuda:
            torch.cuda.synchronize()
        return st

    if not ctx.cuda:
        for label in STEP_RUNS:
            rep.add("step", label, "skipped", "skipped: needs CUDA", shape=where)
    else:
        # the mode is live: a device read raises under it
        torch.cuda.set_sync_debug_mode("error")
        try:
            torch.zeros(1, device="cuda").item()
            live = False
        except RuntimeError:
            live = True
        finally:
            torch.cuda.set_sync_debug_mode(0)
        loading = os.environ.get("CUDA_MODULE_LOADING", "unset")
        runs = []
        for i, label in enumerate(STEP_RUNS):
            st = prepared(10 * page + i)
            staging = DeviceStaging(torch.device("cuda"))
            compiled0 = gk.compiled_count()
            probe = WaitProbe(ctx, STEP_SLEEP_MS)
            error = out = None
            torch.cuda.set_sync_debug_mode("error")
            tic = time.perf_counter()
            try:
                out = kara_step(ctx, st, staging, policy, mark=probe)
            except RuntimeError as e:
                error = f"{type(e).__name__}: {e}"[:300]
            finally:
                host_ms = (time.perf_counter() - tic) * 1e3
                torch.cuda.set_sync_debug_mode(0)
            busy = probe.busy()
            torch.cuda.synchronize()
            probe.finish()
            compiled = gk.compiled_count()
            problems = verify_step(ctx, st, out) if out is not None else []
            runs.append(
                dict(
                    label=label,
                    error=error,
                    host_ms=host_ms,
                    waited=probe.waited,
                    busy=busy,
                    sleep_ms=probe.sleeps[0],
                    problems=problems,
                    buffers=staging.buffers,
                    compiled=None
                    if compiled0 is None or compiled is None
                    else compiled - compiled0,
                )
            )
            del st
            ctx.release()
        for i, r in enumerate(runs):
            waited = "; ".join(
                f"{phase} ({ms:.0f} ms after the sleep was queued)"
                for phase, ms in r["waited"]
            )
            ok = live and r["error"] is None and not r["waited"] and not r["problems"]
            clean = live and r["error"] is None and not r["problems"]
            first_use = clean and i == 0 and r["waited"] and not runs[-1]["waited"]
            status = "pass" if ok else "figure" if first_use else "fail"
            if ok:
                verdict = (
                    "a Kara step makes the host wait for nothing, and leaves rows, pages "
                    "and offsets right"
                )
            elif first_use:
                verdict = (
                    "a one-time wait: the first launch in this process of a kernel the phase "
                    f"uses loads its module (CUDA_MODULE_LOADING={loading}; lazy unless EAGER), "
                    "and loading waits for the device; the same step again waited nowhere. "
                    "The start-up warm-up compiles the Triton kernels but runs none of the "
                    "step's torch operations: a server's first event waits once unless SGLang's "
                    "own work has launched the same kernels before"
                )
            else:
                verdict = "the step waits for the device or leaves the pool wrong"
            rep.add(
                "step",
                r["label"],
                status,
                (
                    f"the step ran in {r['host_ms']:.1f} ms of host time behind a "
                    f"{r['sleep_ms']:.0f} ms device sleep, "
                    + (
                        f"the host waited in: {waited}"
                        if r["waited"]
                        else "the sleep still running when it returned"
                    )
                    + "; no synchronizing call raised"
                    if r["error"] is None
                    else f"a synchronizing call raised: {r['error']}"
                )
                + (
                    f"; wrong after it: {'; '.join(r['problems'][:3])}"
                    if r["problems"]
                    else ""
                )
                + (
                    ""
                    if live
                    else "; the debug mode did not raise on .item(): not live"
                )
                + f" -> {verdict}",
                shape=where,
                host_ms=r["host_ms"],
                sleep_ms=r["sleep_ms"],
                waits=len(r["waited"]),
                staging_buffers=r["buffers"],
            )
        compiled = [r["compiled"] for r in runs]
        if None not in compiled:
            rep.add(
                "step",
                "nothing compiled in the steps after the warm-up",
                "pass" if not any(compiled) else "fail",
                f"{sum(compiled)} kernels compiled during the steps -> "
                + (
                    "the start-up warm-up covers the step's launches"
                    if not any(compiled)
                    else "a step compiled a kernel the warm-up missed"
                ),
                shape=where,
            )
        rep.add(
            "step",
            "under sgl_kara's sync check (KARA_CHECK_SYNC's)",
            "skipped",
            "not on CUDA: the device's own sync debug mode judged the step above (the sync "
            "check models a GPU on a CPU; on CUDA it would count DeviceStaging's pinned copy, "
            "which it is told of on the CPU path only)",
            shape=where,
        )
        return

    sync = load_sync_check()
    st = prepared(page + 1)
    check = sync.SyncCheck(st.device_tensors())
    check.fenced()  # the whole step counts as after the fence
    staging = DeviceStaging(torch.device(ctx.dev), Observers([check]))
    with check:
        out = kara_step(ctx, st, staging, policy)
    problems = verify_step(ctx, st, out)
    # the check counts: a device value read in sgl_kara's code is a violation
    control = sync.SyncCheck([st.req_to_token])
    from sgl_kara.mem_cache.compaction import CompactionPlan

    with control:
        CompactionPlan(
            rows=st.req_to_token[:, 0],
            starts=[],
            lengths=[],
            region=0,
            kept=out["kept"],
        ).host_rows()
    ok = check.violations == 0 and not problems and control.violations == 1
    rep.add(
        "step",
        "under sgl_kara's sync check (KARA_CHECK_SYNC's)",
        "pass" if ok else "fail",
        f"{check.violations} host waits counted"
        + (f" ({'; '.join(check.examples[:3])})" if check.examples else "")
        + f"; the control (rows read back in sgl_kara) counted {control.violations}"
        + (f"; wrong after it: {'; '.join(problems[:3])}" if problems else "")
        + " -> "
        + (
            "no synchronizing call in sgl_kara's code of the step, and the step's values right"
            if ok
            else "the step has a host wait in sgl_kara's code, or wrong values"
        ),
        shape=where,
        violations=check.violations,
    )
    del st
    ctx.release()


# ---------------------------------------------------------------------------- bandwidth
def nominal(name: str) -> tuple[float, float, str] | None:
    """(bytes/s, bf16 FLOP/s, the row matched) of a device name in DEVICES, or None."""
    upper = name.upper()
    for keys, tb_s, tflops in DEVICES:
        if all(key in upper for key in keys):
            return tb_s * 1e12, tflops * 1e12, " ".join(keys)
    return None


def check_bandwidth(rep: Report, ctx: Context, head: dict) -> None:
    if not ctx.cuda:
        rep.add(
            "bandwidth",
            "device copy and every kernel's GB/s",
            "skipped",
            "skipped: needs CUDA (the interpreter's times are no GPU's)",
        )
        return
    bw, copy = head.get("nominal_gb_s"), head.get("copy_gb_s")
    if bw:
        share = copy / bw
        ok = 0.4 <= share <= 1.05
        rep.add(
            "bandwidth",
            "device-to-device copy against the nominal bandwidth",
            "pass" if ok else "fail",
            f"{copy:,.0f} GB/s measured, {share:.0%} of {bw:,.0f} GB/s ({head['nominal_source']}) "
            "-> "
            + (
                "the table describes this device; kernels are judged against the copy"
                if ok
                else "the table's figure does not fit this device (a partition, or another model)"
            ),
            copy_gb_s=copy,
            nominal_gb_s=bw,
        )
    else:
        rep.add(
            "bandwidth",
            "device-to-device copy",
            "figure",
            f"{copy:,.0f} GB/s measured; the device is not in the table",
            copy_gb_s=copy,
        )
    peak_tflops = head.get("nominal_bf16_tflops")
    for t in ctx.timings:
        gb_s = t["bytes"] / (t["ms"] / 1e3) / 1e9
        of_copy = gb_s / copy
        figures = dict(ms=t["ms"], gb_s=gb_s, of_copy=of_copy)
        if bw:
            figures["of_nominal"] = gb_s / bw
        if t["flops"]:
            tflops = t["flops"] / (t["ms"] / 1e3) / 1e12
            intensity = t["flops"] / t["bytes"]
            figures.update(tflops=tflops, flop_per_byte=intensity)
            ridge = peak_tflops * 1e3 / bw if peak_tflops and bw else None
            decision = f"{tflops:.0f} TFLOP/s" + (
                f" = {tflops / peak_tflops:.0%} of the dense bf16 peak; {intensity:.0f} FLOP "
                f"per byte against the ridge's {ridge:.0f} -> "
                + (
                    "compute-bound: its GB/s is not its limit"
                    if intensity > ridge
                    else "memory-bound"
                )
                if ridge
                else ""
            )
        else:
            decision = f"{gb_s:,.0f} GB/s = {of_copy:.0%} of the measured copy -> " + (
                "memory-bound at the copy's rate"
                if of_copy >= 0.5
                else "short of the copy's rate at this size (launch or latency-bound: "
                f"{t['bytes'] / 1e6:.1f} MB in {t['ms'] * 1e3:.0f} us)"
            )
        rep.add(
            "bandwidth", t["kernel"], "figure", decision, shape=t["shape"], **figures
        )


# ------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for gpu_check.json / .md")
    ap.add_argument(
        "--small",
        action="store_true",
        help="tiny shapes; on a machine without CUDA, under the Triton interpreter",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=BUDGET_S,
        help=f"skip what would start past this many seconds (default {BUDGET_S:g})",
    )
    args = ap.parse_args(argv)
    if args.budget_s <= 0:
        ap.error(f"--budget-s must be > 0, got {args.budget_s}")
    gk._setup(args)
    import torch
    import triton

    cuda = torch.cuda.is_available()
    if not cuda and not args.small:
        raise SystemExit(
            "no CUDA device: run with --small (Triton interpreter, tiny shapes)"
        )
    estimate = estimate_seconds(args.small)
    estimate_full = estimate_seconds(False)
    print(
        f"estimate: at most {estimate_full:.0f} s for the full run on an H100"
        + (
            f"; this run: {estimate:.0f} s"
            if cuda
            else "; this run: tiny shapes, interpreted"
        ),
        flush=True,
    )
    record = gk.run_record(args.out, argv)
    device = torch.cuda.get_device_name(0) if cuda else "cpu (Triton interpreter)"
    head = dict(
        date=time.strftime("%Y-%m-%d"),
        machine=record.data["machine"]["text"] if record else platform.node(),
        device=device,
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        command="python -m bench.gpu_check "
        + " ".join(sys.argv[1:] if argv is None else argv),
        shapes="small" if args.small else "serving",
        kara=kara_options(args.small),
        batch=SMALL_BATCH if args.small else BATCH,
        estimate_full_s=round(estimate_full, 1),
        estimate_s=round(estimate, 1),
        budget_s=args.budget_s,
        sglang_imported=gk.sglang_loaded(),
    )
    ctx = Context(args.small, cuda, args.budget_s)
    if cuda:
        found = nominal(device)
        if found:
            head["nominal_gb_s"] = round(found[0] / 1e9)
            head["nominal_bf16_tflops"] = round(found[1] / 1e12)
            head["nominal_source"] = f"table: {found[2]}"
        clock_bw = gk.nominal_bandwidth()
        head["clock_gb_s"] = None if clock_bw is None else round(clock_bw / 1e9)
        if not found and clock_bw:
            head["nominal_gb_s"] = round(clock_bw / 1e9)
            head["nominal_source"] = "memory clock x bus width"
        head["copy_gb_s"] = round(gk.measured_copy_bandwidth(ctx.timer, 1 << 30) / 1e9)
    rep = Report(args.out, head)
    rep.write()

    def guarded(section: str, label: str, need_s: float, fn, *a) -> None:
        if ctx.over_budget(need_s):
            rep.add(
                section,
                label,
                "skipped",
                f"skipped: past the {args.budget_s:g} s budget",
            )
            return
        try:
            fn(*a)
        except Exception as e:  # noqa: BLE001 - recorded; the other checks still run
            rep.add(section, label, "fail", f"raised {type(e).__name__}: {e}"[:500])
            ctx.release()
        rep.write()

    per_shape = (estimate - gk.EST_START_S) / (len(shapes(args.small)) + 4)
    for i, (model, tp, spec) in enumerate(shapes(args.small)):
        guarded(
            "kernels",
            f"every kernel at {shape_name(model, tp, spec)}",
            per_shape,
            check_shape,
            rep,
            ctx,
            model,
            tp,
            spec,
            i == 0,
        )
    guarded("staging", "the staging probe", EST_STAGING_S, check_staging, rep, ctx)
    for page in PAGE_SIZES:
        guarded(
            "step",
            f"the synthetic step at page {page}",
            2 * (EST_STEP_S + STEP_SLEEP_MS / 1e3),
            check_step,
            rep,
            ctx,
            page,
        )
    guarded("bandwidth", "GB/s", 1.0, check_bandwidth, rep, ctx, head)
    head["seconds"] = round(ctx.elapsed(), 1)
    head["sglang_imported"] = head["sglang_imported"] or gk.sglang_loaded()
    rep.write()
    counts = rep.sections()
    print(
        "\n".join(
            f"{name}: " + ", ".join(f"{s[k]} {k}" for k in STATUSES if s[k])
            for name, s in counts.items()
        ),
        flush=True,
    )
    print(
        f"{'PASSED' if rep.passed() else 'FAILED'} in {head['seconds']:.0f} s"
        + (f" (estimate {estimate:.0f} s)" if cuda else "")
        + f": {args.out}/gpu_check.md",
        flush=True,
    )
    if record is not None:
        record.finish()
    return 0 if rep.passed() else 1


if __name__ == "__main__":
    raise SystemExit(main())
