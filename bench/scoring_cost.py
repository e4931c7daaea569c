"""What scoring Kara's windows costs per decode step on a GPU, for each way of getting the queries.

    python -m bench.scoring_cost [--gpu h100 --models Qwen3-8B,R1-Llama-8B --batches 64,256]
                                 [--context TOKENS] [--out DIR]

A model, not a measurement: a roofline (time = max(FLOPs / (peak * compute_eff), bytes /
(HBM * bw_eff)), on one GPU, the models' real GQA configurations with a gated MLP) applied to the
passes a scoring schedule adds to decoding. Kara scores every window of W queries against its
W - U region keys, so a request scores W / (W - U) queries per step on average whatever the
schedule; the schedules differ in how those queries are batched into passes, each with a fixed
cost besides its FLOPs:

    (a) spread parts, recompute    every window in parts of ``part`` queries on steps staggered
                                   per request: one eager extend forward of the due parts,
                                   stopped at the last layer's attention, outside any CUDA graph
    (b) whole window, recompute    all W queries at the window's due step, the windows due then
                                   in one forward (request or server phase)
    (c) capture                    the decode forward writes its queries to a ring (an eager
                                   decode); scoring reads the ring: the scoring kernels alone
    (d) parts in the decode        (a)'s parts inside the decode forward, one eager mixed batch
                                   (not built; the bound)

A recompute forward reads the weights once (less what it never reaches), does 2 FLOPs per weight
per token, reads its requests' context KV once per layer and launches ``ops_per_layer`` kernels
per layer at ``launch_us`` each, host time that the overlap scheduler hides behind the previous
step's GPU work where shorter. The scoring kernels run in every schedule; the decode step is a
CUDA-graph replay (its roofline alone); compaction, the same for all, is not counted. The context
per request defaults to the batch's share of SGLang's H100 KV pool (the pool full).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ModelConfig:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2
    tie_embeddings: bool = False

    @property
    def q_dim(self):
        return self.heads * self.head_dim

    @property
    def kv_dim(self):
        return self.kv_heads * self.head_dim

    def layer_params(self):  # q, k, v, o, gated MLP (gate, up, down)
        kv = 2 * self.hidden * self.kv_dim
        return 2 * self.hidden * self.q_dim + kv + 3 * self.hidden * self.intermediate

    def params(self):
        return self.layers * self.layer_params() + self.vocab * self.hidden * (
            1 if self.tie_embeddings else 2
        )

    # weights multiplied per decoded token (embedding: a lookup)
    def matmul_params(self):
        return self.layers * self.layer_params() + self.vocab * self.hidden

    def kv_bytes_per_token(self):  # K and V, all layers, all KV heads
        return 2 * self.layers * self.kv_dim * self.dtype_bytes


MODELS = {
    m.name: m
    for m in [
        ModelConfig("R1-Llama-8B", 32, 4096, 32, 8, 128, 14336, 128256),  # Llama-3.1-8B
        ModelConfig("Qwen3-8B", 36, 4096, 32, 8, 128, 12288, 151936),
        ModelConfig("Qwen3-14B", 40, 5120, 40, 8, 128, 17408, 151936),
        ModelConfig(
            "Qwen3-4B", 36, 2560, 32, 8, 128, 9728, 151936, tie_embeddings=True
        ),
    ]
}


@dataclass(frozen=True)
class GPU:
    name: str
    tflops: float  # dense BF16 tensor TFLOPs (FP32 accumulate), datasheet
    hbm_gbs: float  # memory bandwidth GB/s
    mem_gib: float  # device memory


GPUS = {
    g.name: g
    for g in [
        GPU("rtx5090", 209.5, 1792, 32),  # GDDR7
        GPU("h100", 989.4, 3350, 80),  # SXM
        GPU("h200", 989.4, 4800, 141),
        GPU("a100", 312.0, 2039, 80),  # SXM 80 GB
    ]
}


@dataclass(frozen=True)
class Cost:
    compute_eff: float = 0.5  # achieved / peak tensor FLOPs
    bw_eff: float = 0.8  # achieved / peak HBM bandwidth


def roofline(flops, nbytes, gpu, cost):
    return np.maximum(
        flops / (gpu.tflops * 1e12 * cost.compute_eff),
        nbytes / (gpu.hbm_gbs * 1e9 * cost.bw_eff),
    )


def decode_step(m, gpu, batch, kv_tokens, cost=Cost()):
    """Time of one decode step of ``batch`` sequences holding ``kv_tokens`` KV entries in total
    (numpy-broadcastable): the weights and the KV read once; attention QK^T and PV, 2 FLOPs each
    per query dim per key."""
    batch, kv_tokens = np.asarray(batch, float), np.asarray(kv_tokens, float)
    flops = 2 * m.matmul_params() * batch + 4 * m.layers * m.q_dim * kv_tokens
    nbytes = kv_tokens * m.kv_bytes_per_token() + m.matmul_params() * m.dtype_bytes
    return roofline(flops, nbytes, gpu, cost)


# SGLang 0.5.23 on an 80 GB GPU (server_args memory hook): chunked_prefill_size 8192 and decode
# graphs up to 256 requests, so 13.4 GB held back for activations and graph buffers:
# mem_fraction_static = (81.6 - 13.4) / 81.6 GB.
MEM_FRACTION = 0.835
# sgl_kara's recompute forwards take at most SGLang's chunked-prefill size in query tokens.
CHUNKED_PREFILL = 8192


@dataclass(frozen=True)
class Schedule:
    window: int = 512  # W
    buffer: int = 32  # U
    period: int = 128  # decode steps between a request's due steps
    # queries of one request in a spread part (scheduler/spread.py MIN_CHUNK)
    part: int = 32
    recompute_tokens: int = CHUNKED_PREFILL
    # Kernels an eager decoder layer launches: SGLang's Llama / Qwen3 layer (norms, QKV, q/k
    # norm, RoPE, attention and its metadata, o-proj, gate-up, activation, down) plus the scoring
    # pass per layer (query copy, workspace and output allocation, two kernels, the store).
    ops_per_layer: int = 16
    # capture's scoring per layer: the ring read (a gather), allocations, two kernels, the store
    capture_ops_per_layer: int = 6
    # an eager decode layer (capture turns decode graphs off), the ring write included
    decode_ops_per_layer: int = 12
    # host time per launched op: PyTorch dispatch + cudaLaunchKernel
    launch_us: float = 10.0

    @property
    def region(self) -> int:
        return self.window - self.buffer

    @property
    def ring_queries(self) -> int:
        """Queries per request a capture ring holds (policies/kara.py query_capacity, R = 0)."""
        return self.window + self.period


def pool_tokens(m: ModelConfig, gpu, mem_fraction: float = MEM_FRACTION) -> int:
    """KV tokens of the pool on one GPU: mem_fraction of its memory, less the weights."""
    free = mem_fraction * gpu.mem_gib * 2**30 - m.params() * m.dtype_bytes
    if free <= 0:
        raise ValueError(f"{m.name} does not fit on {gpu.name}")
    return int(free // m.kv_bytes_per_token())


def forward_params(m: ModelConfig) -> int:
    """Weights a recompute forward multiplies: every layer but the last's o-projection and MLP
    (it stops once the last layer's queries are scored), no LM head."""
    tail = m.hidden * m.q_dim + 3 * m.hidden * m.intermediate
    return m.layers * m.layer_params() - tail


def ridge_tokens(m: ModelConfig, gpu, cost: Cost = Cost()) -> float:
    """Query tokens from which a recompute forward's weight FLOPs (2 per weight per token) take
    as long as reading the weights once: below, a forward costs its weight read, whatever it
    carries."""
    compute = gpu.tflops * 1e12 * cost.compute_eff
    return compute * m.dtype_bytes / (2 * gpu.hbm_gbs * 1e9 * cost.bw_eff)


def weight_read(m: ModelConfig, gpu, cost: Cost = Cost()) -> float:
    """Seconds a recompute forward spends reading its weights."""
    return forward_params(m) * m.dtype_bytes / (gpu.hbm_gbs * 1e9 * cost.bw_eff)


def recompute_forward(m, gpu, tokens, requests, context, cost, s: Schedule):
    """(GPU seconds, host seconds) of one eager extend forward of ``tokens`` query tokens from
    ``requests`` requests, each attending to ``context`` cached tokens of its own."""
    tokens, requests = np.asarray(tokens, float), np.asarray(requests, float)
    flops = 2 * forward_params(m) * tokens + 4 * m.layers * m.q_dim * tokens * context
    nbytes = (
        forward_params(m) * m.dtype_bytes
        + requests * context * m.kv_bytes_per_token()
        + 2 * tokens * m.hidden * m.dtype_bytes * m.layers  # activations in and out
    )
    gpu_s = roofline(flops, nbytes, gpu, cost)
    host_s = m.layers * s.ops_per_layer * s.launch_us * 1e-6
    return np.where(tokens > 0, gpu_s, 0.0), np.where(tokens > 0, host_s, 0.0)


def score_kernels(m, gpu, requests, queries, cost, s: Schedule):
    """GPU seconds of the scoring kernels over every layer: ``requests`` regions of W - U keys,
    ``queries`` queries each (pass 1 and pass 2 both form Q K^T)."""
    requests = np.asarray(requests, float)
    M, item = s.region, m.dtype_bytes
    flops = 2 * 2 * m.heads * queries * M * m.head_dim * m.layers * requests
    nbytes = (
        m.layers
        * requests
        * (2 * queries * m.q_dim * item + 2 * M * m.kv_dim * item + 4 * m.kv_heads * M)
    )
    return roofline(flops, nbytes, gpu, cost)


def added(gpu_s, host_s, decode_s):
    """Time a pass adds to the step it runs in: its GPU time, plus the part of its host issue
    that the previous decode step's GPU work does not cover."""
    return gpu_s + np.maximum(0.0, host_s - decode_s)


def carrying(rate):
    """Steps carrying at least one of ``rate`` Poisson events per step, and the mean count on
    those steps (requests staggered independently)."""
    rate = np.asarray(rate, float)
    share = -np.expm1(-rate)
    return share, np.where(share > 0, rate / np.where(share > 0, share, 1), 0.0)


def estimate(
    m: ModelConfig,
    gpu,
    batch: int,
    context: float | None = None,
    s: Schedule = Schedule(),
    cost: Cost = Cost(),
) -> dict:
    """Seconds each schedule adds per decode step (``<schedule>_step``: averaged over steps),
    what one step carrying it adds (``_stall``) and on which share of steps (``_share``), beside
    the decode step itself (``decode``); schedules ``part`` (a), ``window`` (b), ``server``
    (b'), ``capture`` (c), ``fused`` (d). ``context``: KV tokens per request (default: the pool
    shared by the batch)."""
    ctx = pool_tokens(m, gpu) / batch if context is None else float(context)
    decode = float(decode_step(m, gpu, batch, batch * ctx, cost))
    windows = batch / s.region  # windows scored per step, whatever the schedule
    out = dict(
        model=m.name,
        gpu=gpu.name,
        batch=batch,
        context=ctx,
        decode=decode,
        queries_per_step=windows * s.window,
        part_size=s.part,
    )

    def put(name, stall, share, **more):
        out.update(
            {
                f"{name}_stall": float(stall),
                f"{name}_share": float(share),
                f"{name}_step": float(stall * share),
            },
            **{f"{name}_{k}": float(v) for k, v in more.items()},
        )

    # (a) a window's ceil(W / part) parts fall on distinct steps, staggered per request
    share, reqs = carrying(windows * math.ceil(s.window / s.part))
    tokens = reqs * s.part
    g, h = recompute_forward(m, gpu, tokens, reqs, ctx, cost, s)
    g = g + score_kernels(m, gpu, reqs, s.part, cost, s)
    put("part", added(g, h, decode), share, tokens=tokens)

    # (d) the same parts inside the decode forward: weights read once for both
    flops = (
        2 * m.matmul_params() * batch
        + 4 * m.layers * m.q_dim * batch * ctx
        + 2 * forward_params(m) * tokens
        + 4 * m.layers * m.q_dim * tokens * ctx
    )
    nbytes = (
        m.matmul_params() * m.dtype_bytes
        + (batch + reqs) * ctx * m.kv_bytes_per_token()
        + 2 * tokens * m.hidden * m.dtype_bytes * m.layers
    )
    mixed = roofline(flops, nbytes, gpu, cost)
    mixed = mixed + score_kernels(m, gpu, reqs, s.part, cost, s)
    # eager: the host issue is its own
    put("fused", added(mixed, h, mixed) - decode, share)

    # (b) whole windows at their due step, those due at one step in one batch
    def whole(name, n_windows, share):
        tokens = n_windows * s.window
        forwards = max(1, math.ceil(tokens / s.recompute_tokens))
        g, h = recompute_forward(m, gpu, tokens, n_windows, ctx, cost, s)
        # each further forward reads the weights again; its host issue overlaps the GPU work
        # of the one before
        g = g + (forwards - 1) * weight_read(m, gpu, cost)
        g = g + score_kernels(m, gpu, n_windows, s.window, cost, s)
        put(name, added(g, h, decode), share, tokens=tokens)

    share, n = carrying(windows)
    whole("window", n, share)  # request phase: each request due at its own steps
    whole("server", windows * s.period, 1 / s.period)  # every request due together

    # (c) capture: the decode step eager (its attention hook writes the ring), the scoring
    # kernels read the ring at the due step
    g = score_kernels(m, gpu, n, s.window, cost, s)
    h = m.layers * s.capture_ops_per_layer * s.launch_us * 1e-6
    write = (
        batch * m.layers * m.q_dim * m.dtype_bytes / (gpu.hbm_gbs * 1e9 * cost.bw_eff)
    )
    eager = m.layers * s.decode_ops_per_layer * s.launch_us * 1e-6
    put("capture", added(g, h, decode), share)
    out["capture_step"] += write + max(0.0, eager - decode)
    ring = batch * s.ring_queries * m.layers * m.q_dim * m.dtype_bytes
    out.update(
        ring_bytes=float(ring),
        ring_of_pool=ring / (pool_tokens(m, gpu) * m.kv_bytes_per_token()),
    )
    return out


def _ms(x: float) -> str:
    return f"{1e3 * x:.1f}" if x >= 0.01 else f"{1e3 * x:.2f}"


COLUMNS = (
    ("part", "(a) spread parts"),
    ("window", "(b) whole window, request phase"),
    ("server", "(b') whole window, server phase"),
    ("capture", "(c) capture, decode eager"),
    ("fused", "(d) parts inside the decode forward"),
)


def averages(rows: list[dict]) -> list[str]:
    """Markdown: what each schedule adds per decode step, averaged over steps."""
    part = f"(a) spread parts of {rows[0]['part_size']}"
    out = [
        "| model | running | context / request | decode step ms | "
        + " | ".join(part if k == "part" else label for k, label in COLUMNS)
        + " |",
        "|---|---:|---:|---:|" + "---:|" * len(COLUMNS),
    ]
    for r in rows:
        cells = [
            f"{_ms(r[k + '_step'])} ms ({100 * r[k + '_step'] / r['decode']:.0f}%)"
            for k, _ in COLUMNS
        ]
        out.append(
            f"| {r['model']} | {r['batch']} | {r['context']:,.0f} | {_ms(r['decode'])} | "
            + " | ".join(cells)
            + " |"
        )
    return out


def stalls(rows: list[dict]) -> list[str]:
    """Markdown: what one step carrying the pass adds to it, and on which share of steps."""
    out = [
        f"| model | running | (a) parts of {rows[0]['part_size']}: query tokens, ms, "
        "share of steps | "
        "(b) window: tokens, ms, share | (b') due step: tokens, ms, every | "
        "(c) capture: ms, share | (d) fused part: ms, share | "
        "capture ring GB (of the pool) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['batch']} "
            f"| {r['part_tokens']:,.0f}, {_ms(r['part_stall'])}, {100 * r['part_share']:.0f}% "
            f"| {r['window_tokens']:,.0f}, {_ms(r['window_stall'])}, "
            f"{100 * r['window_share']:.0f}% "
            f"| {r['server_tokens']:,.0f}, {_ms(r['server_stall'])}, "
            f"{round(1 / r['server_share'])} steps "
            f"| {_ms(r['capture_stall'])}, {100 * r['capture_share']:.0f}% "
            f"| {_ms(r['fused_stall'])}, {100 * r['fused_share']:.0f}% "
            f"| {r['ring_bytes'] / 1e9:.1f} ({100 * r['ring_of_pool']:.0f}%) |"
        )
    return out


def report(a) -> list[str]:
    gpu, cost = GPUS[a.gpu], Cost(a.compute_eff, a.bw_eff)
    keys = "window buffer period part recompute_tokens ops_per_layer launch_us"
    s = Schedule(**{k: getattr(a, k) for k in keys.split()})
    rows = [
        estimate(MODELS[name], gpu, b, a.context, s, cost)
        for name in a.models
        for b in a.batches
    ]
    flags = (
        f"--gpu {a.gpu} --models {','.join(a.models)} "
        f"--batches {','.join(map(str, a.batches))}"
        + (f" --context {a.context}" if a.context else "")
    )
    return [
        "## Scoring cost on a GPU (model)",
        "",
        f"Computed {datetime.date.today().isoformat()}: `python -m bench.scoring_cost {flags}`. "
        f"{gpu.name}: {gpu.tflops} TFLOP/s bf16 dense at {a.compute_eff} of peak, "
        f"{gpu.hbm_gbs} GB/s at {a.bw_eff}; W = {s.window}, U = {s.buffer}, period {s.period}, "
        f"parts of {s.part} queries, recompute forwards of at most {s.recompute_tokens} "
        f"tokens, {s.ops_per_layer} launches per layer at {s.launch_us} us (host). Context: "
        + (
            f"{a.context} tokens per request."
            if a.context
            else f"the KV pool (mem_fraction_static {MEM_FRACTION}) shared by the running "
            "requests."
        ),
        "",
        "Per decode step, averaged over steps (share of the decode step):",
        "",
        *averages(rows),
        "",
        "What a step carrying the pass adds to it, and how often:",
        "",
        *stalls(rows),
        "",
        "A recompute forward costs its FLOPs from "
        f"{ridge_tokens(MODELS[a.models[0]], gpu, cost):.0f} query tokens on; below, its weight "
        "read ("
        + ", ".join(
            f"{n}: {_ms(weight_read(MODELS[n], gpu, cost))} ms" for n in a.models
        )
        + ").",
    ]


def parse(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    arg = p.add_argument
    d = Schedule()
    arg("--gpu", default="h100", choices=list(GPUS))
    arg(
        "--models",
        type=lambda v: v.split(","),
        default=["Qwen3-8B", "R1-Llama-8B"],
        help=f"comma-separated, of {list(MODELS)}",
    )
    arg("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[64, 256])
    h = "KV tokens per request (default: the pool shared by the running requests)"
    arg("--context", type=int, default=None, help=h)
    arg("--compute-eff", type=float, default=Cost().compute_eff)
    arg("--bw-eff", type=float, default=Cost().bw_eff)
    for name in "window buffer period part recompute_tokens ops_per_layer".split():
        arg("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    arg("--launch-us", type=float, default=d.launch_us)
    arg("--out", default=None, help="folder for scoring_cost.md and run.json")
    a = p.parse_args(argv)
    bad = [n for n in a.models if n not in MODELS]
    if bad:
        p.error(f"unknown model(s) {bad}: one of {list(MODELS)}")
    return a


def main(argv=None):
    a = parse(argv)
    lines = report(a)
    print("\n".join(lines))
    if a.out:
        from bench.record import RunRecord

        record = RunRecord(a.out, argv)
        record.note(**{k: v for k, v in vars(a).items() if k != "out"})
        with open(os.path.join(a.out, "scoring_cost.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        record.finish()


if __name__ == "__main__":
    main()
