"""GPU cost model of decode throughput for full KV vs Kara.

    python -m bench.gpu_model [--gpu rtx5090 --tp 4 --mem-util 0.5 ...] [--out DIR]

Pure Python + numpy. Three layers:
  1. Roofline step time (Kara paper App. C.1 Eq. 10-11, generalised): per decode step
     max(FLOPs / (TP * peak * compute_eff), bytes / (TP * HBM * bw_eff)) + TP all-reduces
     + a fixed per-step overhead. FLOPs = 2 * matmul params * B + attention; bytes = weights
     + KV read. `eq10_tpot` is Eq. 10 verbatim (FFN = 4D, MHA, no weights) for comparison.
  2. A step-level simulation of memory-constrained serving in the style of vLLM (paper App. B.1):
     block-paged KV budget, FCFS admission with a 1% watermark, recompute preemption of the
     newest request when a decode step cannot get a block. Policies: full KV, Kara (periodic
     window compression, App. C.4 Alg. 1) and SnapKV (threshold-triggered). The simulation
     counts steps only; times are assigned afterwards, so one trace serves every cost setting.
  3. A comparison with the paper's Table 2/3 (R1-Distill-Llama-8B, MATH-500, 4x RTX 5090),
     once as a pure roofline and once with the per-step overhead fitted to one point
     (vLLM, batch 16): printed, and with --out written to DIR/gpu_model.md with the run record
     (DIR/run.json, bench/record.py).
"""

from __future__ import annotations

import argparse
import datetime
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

    def layer_params(self, kv_proj=True):  # q, (k, v), o, gated MLP (gate, up, down)
        kv = 2 * self.hidden * self.kv_dim if kv_proj else 0
        return 2 * self.hidden * self.q_dim + kv + 3 * self.hidden * self.intermediate

    def params(self):
        return self.layers * self.layer_params() + self.vocab * self.hidden * (
            1 if self.tie_embeddings else 2
        )

    def matmul_params(
        self,
    ):  # weights multiplied per decoded token (the embedding is a lookup)
        return self.layers * self.layer_params() + self.vocab * self.hidden

    def kv_bytes_per_token(self):  # K and V, all layers, all KV heads
        return 2 * self.layers * self.kv_dim * self.dtype_bytes


MODELS = {
    m.name: m
    for m in [
        ModelConfig(
            "R1-Llama-8B", 32, 4096, 32, 8, 128, 14336, 128256
        ),  # Llama-3.1-8B arch
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
    mem_gib: float  # as vLLM sees it: gpu_memory_utilization multiplies this
    link_gbs: (
        float  # per-GPU all-reduce bus bandwidth GB/s (NVLink, or PCIe without P2P)
    )
    ar_latency_us: (
        float  # latency of one small all-reduce across the TP group (assumed)
    )


GPUS = {
    g.name: g
    for g in [
        GPU("rtx5090", 209.5, 1792, 32, 25, 30),  # GDDR7; PCIe 5.0, no NVLink / P2P
        GPU("h100", 989.4, 3350, 80, 450, 8),  # SXM
        GPU("h200", 989.4, 4800, 141, 450, 8),
        GPU("a100", 312.0, 2039, 80, 300, 10),  # SXM 80 GB
    ]
}


@dataclass(frozen=True)
class Cost:
    compute_eff: float = 0.5  # achieved / peak tensor FLOPs
    bw_eff: float = 0.8  # achieved / peak HBM bandwidth
    # fixed per decode step: launches, scheduler, sampling (fitted)
    step_overhead_s: float = 0.0
    event_overhead_s: float = 0.0  # fixed per compression event (launches, bookkeeping)
    cpu_event_ms: float = 0.0  # optional measured CPU cost per compressed sequence (scoring+select+compact)
    # CPU->GPU speed-up applied to cpu_event_ms (bandwidth ratio, assumed)
    cpu_gpu_factor: float = 100.0


def eq10_tpot(L, D, B, S, rho, beta):
    """Kara paper Eq. 10 verbatim: max(2L(12BD^2 + 2BSD)/rho, 4LBSD/beta) (FFN=4D, MHA, BF16 KV)."""
    return max(2 * L * (12 * B * D * D + 2 * B * S * D) / rho, 4 * L * B * S * D / beta)


def eq11_throughput(L, D, B, S, rho, beta):
    return B / eq10_tpot(L, D, B, S, rho, beta)


def allreduce_time(gpu, tp, nbytes):
    if tp <= 1:
        return 0.0 * nbytes
    return gpu.ar_latency_us * 1e-6 + 2 * (tp - 1) / tp * nbytes / (gpu.link_gbs * 1e9)


def roofline(flops, nbytes, gpu, tp, cost):
    return np.maximum(
        flops / (tp * gpu.tflops * 1e12 * cost.compute_eff),
        nbytes / (tp * gpu.hbm_gbs * 1e9 * cost.bw_eff),
    )


def step_time(
    m, gpu, tp, batch, kv_tokens, cost=Cost(), prefill_tokens=0, weights=True
):
    """Time of one decode step of `batch` sequences holding `kv_tokens` KV entries in total
    (numpy-broadcastable). Attention: QK^T and PV, 2 FLOPs each per query dim per key."""
    batch, kv_tokens = np.asarray(batch, float), np.asarray(kv_tokens, float)
    tokens = batch + prefill_tokens
    flops = 2 * m.matmul_params() * tokens + 4 * m.layers * m.q_dim * kv_tokens
    nbytes = kv_tokens * m.kv_bytes_per_token() + (
        m.matmul_params() * m.dtype_bytes if weights else 0
    )
    comm = 2 * m.layers * allreduce_time(gpu, tp, tokens * m.hidden * m.dtype_bytes)
    return roofline(flops, nbytes, gpu, tp, cost) + comm + cost.step_overhead_s


@dataclass(frozen=True)
class Policy:
    kind: str = "full"  # full | kara | snapkv
    window: int = 768  # Kara W (3 blocks, App. B.1)
    keep: int = 257  # entries kept per window (incl. buffer U)
    buffer: int = 32  # U (protected, scores only)
    period: int = 128  # delta, decode steps between events
    max_seqs: int = 30  # sequences per event
    snap_threshold: int = 1280  # SnapKV C_max
    snap_budget: int = 1025  # SnapKV N
    snap_window: int = 32  # SnapKV observation queries


def event_time(m, gpu, tp, pol, n, ctx_tokens, cost):
    """Time of compression events compressing `n` sequences whose KV before the window totals
    `ctx_tokens` (vectorised over events). Kara (App. C.2, D.6): recompute forward over W tokens
    (q/o projections + MLP, cached K/V reused, no LM head), causal attention on the cached prefix,
    bidirectional scoring W x (W-U) per head and layer, gather of the window and write of kept KV.
    SnapKV (Eq. 13): U queries scored against the whole cache and global compaction."""
    n, ctx = np.asarray(n, float), np.asarray(ctx_tokens, float)
    kvb = m.kv_bytes_per_token()
    if pol.kind == "kara":
        W, M = pol.window, pol.window - pol.buffer
        flops = (
            2 * m.layers * m.layer_params(kv_proj=False) * W * n
            + 4 * m.layers * m.q_dim * W * (ctx + n * W / 2)
            + 2 * m.layers * m.q_dim * W * M * n
        )
        nbytes = (
            m.layers * m.layer_params(False) * m.dtype_bytes
            + (ctx + n * (W + pol.keep)) * kvb
        )
        comm = 2 * m.layers * allreduce_time(gpu, tp, n * W * m.hidden * m.dtype_bytes)
    elif pol.kind == "snapkv":
        flops = 2 * m.layers * m.q_dim * pol.snap_window * ctx
        nbytes = (
            ctx + n * pol.snap_budget
        ) * kvb  # query-cache upkeep per step is ignored
        comm = 0 * n
    else:
        return 0 * n
    t = (
        roofline(flops, nbytes, gpu, tp, cost)
        + comm
        + n * cost.cpu_event_ms * 1e-3 / cost.cpu_gpu_factor
    )
    return np.where(n > 0, t + cost.event_overhead_s, 0.0)


def sample_lengths(n, mean, max_len, sigma, rng):
    """Lognormal lengths clipped to max_len, median bisected so the clipped mean is `mean`."""
    z = rng.standard_normal(n)
    lo, hi = 1.0, float(max_len)
    for _ in range(60):
        med = (lo + hi) / 2
        if np.minimum(med * np.exp(sigma * z), max_len).mean() < mean:
            lo = med
        else:
            hi = med
    return np.clip(np.round(med * np.exp(sigma * z)), 1, max_len).astype(np.int64)


@dataclass
class Trace:
    batch: np.ndarray  # per step: sequences decoded
    kv: np.ndarray  # per step: KV tokens read
    prefill: np.ndarray  # per step: tokens (re)prefilled
    ev_n: np.ndarray  # per step: sequences compressed
    ev_ctx: np.ndarray  # per step: their KV before the window
    gen: np.ndarray  # per request: tokens generated
    final_kv: np.ndarray  # per request: KV held at completion
    preemptions: int


def kv_budget_tokens(m, gpu, tp, mem_util, reserve_gib, block):
    """vLLM-style budget: per GPU mem_util * memory - reserve (activation peak, non-torch memory)
    - weights/TP, divided by the per-GPU KV bytes of a token; rounded down to whole blocks."""
    per_gpu = (
        mem_util * gpu.mem_gib - reserve_gib
    ) * 2**30 - m.params() * m.dtype_bytes / tp
    if per_gpu <= 0:
        raise ValueError(
            f"{m.name} does not fit: {per_gpu / 1e9:.2f} GB per GPU left for KV"
        )
    return int(per_gpu // (m.kv_bytes_per_token() / tp)) // block * block


def simulate(
    prompts, targets, pol, max_running, total_blocks, block=256, watermark=0.01
):
    """Step-level serving simulation; returns a Trace (steps only, no times).
    Each step: (1) running requests that cannot get a needed block preempt the newest one
    (recompute: its KV is dropped, it re-queues first and later re-prefills prompt + generated);
    (2) every running request decodes one token; (3) if nothing was preempted, waiting requests
    are admitted FCFS while max_running and the blocks (minus a watermark) allow, their prefill
    counted in this step; (4) compression; (5) finished requests leave."""
    n = len(prompts)
    prompts, targets = np.asarray(prompts, np.int64), np.asarray(targets, np.int64)
    kv, gen, unc, final_kv = (
        np.zeros(n, np.int64) for _ in range(4)
    )  # unc: generated since last event
    waiting, run = list(range(n)), np.zeros(0, np.int64)
    rec = {k: [] for k in ("batch", "kv", "prefill", "ev_n", "ev_ctx")}
    wm, step, preempt = int(watermark * total_blocks), 0, 0
    nblk = lambda t: -(-t // block)  # noqa: E731
    while waiting or run.size:
        used = int(nblk(kv[run]).sum())
        need = kv[run] % block == 0  # the next token opens a new block
        npre = 0
        while run.size and int(need.sum()) > total_blocks - used:
            v = run[-1]
            used -= int(nblk(kv[v]))
            kv[v] = unc[v] = 0
            waiting.insert(0, int(v))
            run, need, npre = run[:-1], need[:-1], npre + 1
        preempt += npre
        kv[run] += 1
        gen[run] += 1
        unc[run] += 1
        used += int(need.sum())
        rec["batch"].append(run.size)
        rec["kv"].append(int(kv[run].sum()))
        prefill, admitted = 0, []
        while not npre and waiting and run.size + len(admitted) < max_running:
            r = waiting[0]
            toks = int(prompts[r] + gen[r])
            if total_blocks - used - nblk(toks) < wm:
                break
            waiting.pop(0)
            admitted.append(r)
            kv[r], unc[r] = toks, gen[r]
            used += nblk(toks)
            prefill += toks
        if admitted:
            run = np.concatenate([run, np.array(admitted, np.int64)])
        if waiting and not run.size:
            raise ValueError("a request does not fit in the KV budget")
        ev_n = ev_ctx = 0
        if pol.kind == "kara" and (step + 1) % pol.period == 0:
            # sequences whose full trailing blocks (the partial last block excluded) hold >= W
            # uncompressed generated tokens; the max_seqs with most uncompressed tokens go first
            elig = run[unc[run] - kv[run] % block >= pol.window]
            sel = elig[np.argsort(-unc[elig], kind="stable")[: pol.max_seqs]]
            ev_n, ev_ctx = sel.size, int((kv[sel] - pol.window).sum())
            kv[sel] -= pol.window - pol.keep
            unc[sel] = 0
        elif pol.kind == "snapkv":
            sel = run[kv[run] >= pol.snap_threshold]
            ev_n, ev_ctx = sel.size, int(kv[sel].sum())
            kv[sel] = pol.snap_budget
        rec["prefill"].append(prefill)
        rec["ev_n"].append(ev_n)
        rec["ev_ctx"].append(ev_ctx)
        done = gen[run] >= targets[run]
        if done.any():
            final_kv[run[done]] = kv[run[done]]
            run = run[~done]
        step += 1
    return Trace(
        *(
            np.array(rec[k], float)
            for k in ("batch", "kv", "prefill", "ev_n", "ev_ctx")
        ),
        gen,
        final_kv,
        preempt,
    )


def summarize(tr, m, gpu, tp, pol, cost):
    """Times for a trace: latency (makespan), throughput = generated tokens / makespan,
    time-weighted mean running requests, share of time in compression events."""
    ts = step_time(m, gpu, tp, tr.batch, tr.kv, cost, tr.prefill)
    te = event_time(m, gpu, tp, pol, tr.ev_n, tr.ev_ctx, cost)
    t = ts + te
    T = float(t.sum())
    return dict(
        latency=T,
        throughput=tr.batch.sum() / T,
        running=float((tr.batch * t).sum() / T),
        overhead=float(te.sum() / T),
        steps=len(t),
        preempt=tr.preemptions,
        roof_step_ms=float(1e3 * (ts - cost.step_overhead_s).mean()),
    )


# Kara paper Table 3 (Table 2 = its batch-128/256 columns): (latency s, throughput tokens/s).
PAPER = {
    "vLLM": {
        16: (2263, 390),
        32: (1558, 707),
        64: (1155, 1457),
        128: (884, 2633),
        256: (678, 2943),
    },
    "vLLM + SnapKV": {
        16: (2255, 403),
        32: (1562, 704),
        64: (1171, 1377),
        128: (920, 2341),
        256: (738, 2556),
    },
    "KvLLM": {
        16: (2260, 393),
        32: (1569, 701),
        64: (1163, 1421),
        128: (864, 2912),
        256: (640, 3392),
    },
}
FRAMEWORK_POLICY = {"vLLM": "full", "vLLM + SnapKV": "snapkv", "KvLLM": "kara"}


def workload(a):
    """MATH-500-like: a.requests prompts (lognormal, mean ~a.prompt_mean) and generation lengths."""
    rng = np.random.default_rng(a.seed)
    gens = sample_lengths(a.requests, a.mean_gen, a.max_gen, a.gen_sigma, rng)
    prompts = np.maximum(
        8,
        np.round(a.prompt_mean * np.exp(0.4 * rng.standard_normal(a.requests) - 0.08)),
    ).astype(np.int64)
    return prompts, gens


def pct(pred, ref):
    return f"{100 * (pred - ref) / ref:+.0f}%"


def setting(a, model=None, **over):
    """(model, gpu, policy maker, cost maker, workload, KV blocks) for args `a` with overrides."""
    a = argparse.Namespace(**{**vars(a), **over})
    m, gpu = MODELS[model or a.model], GPUS[a.gpu]
    kvt = (
        int(a.kv_budget_gb * 1e9 // (m.kv_bytes_per_token() / a.tp))
        // a.block
        * a.block
        if a.kv_budget_gb
        else kv_budget_tokens(m, gpu, a.tp, a.mem_util, a.reserve_gib, a.block)
    )
    pol = lambda kind: Policy(kind, a.window, a.keep, a.buffer, a.period, a.max_seqs)  # noqa: E731
    cost = lambda ov: Cost(
        a.compute_eff,
        a.bw_eff,
        ov,
        a.event_overhead_ms * 1e-3,
        a.cpu_event_ms,
        a.cpu_gpu_factor,
    )  # noqa: E731
    return m, gpu, pol, cost, workload(a), kvt


def sim(a, kind, batch, model=None, overhead=0.0, **over):
    """Simulate one setting; returns (roofline summary, summary with `overhead`, trace, KV tokens)."""
    m, gpu, pol, cost, (prompts, gens), kvt = setting(a, model, **over)
    tr = simulate(prompts, gens, pol(kind), batch, kvt // a.block, a.block)
    return (
        summarize(tr, m, gpu, a.tp, pol(kind), cost(0.0)),
        summarize(tr, m, gpu, a.tp, pol(kind), cost(overhead)),
        tr,
        kvt,
    )


def run(a):
    """Table 3 settings. The one free parameter, a fixed per-step overhead, is fitted so that vLLM
    at the smallest batch matches its paper throughput (unless --step-overhead-ms is given)."""
    b0 = min(a.batch_sizes)
    traces = {
        (f, b): sim(a, FRAMEWORK_POLICY[f], b) for f in PAPER for b in a.batch_sizes
    }
    if a.step_overhead_ms is None:
        r0, _, tr, _ = traces[("vLLM", b0)]
        overhead = (tr.batch.sum() / PAPER["vLLM"][b0][1] - r0["latency"]) / r0["steps"]
    else:
        overhead = a.step_overhead_ms * 1e-3
    m, gpu, pol, cost, _, kvt = setting(a)
    rows = []
    for (f, b), (roof, _, tr, _) in traces.items():
        cal = summarize(tr, m, gpu, a.tp, pol(FRAMEWORK_POLICY[f]), cost(overhead))
        rows.append(
            dict(fw=f, b=b, p=PAPER[f].get(b, (np.nan, np.nan)), roof=roof, cal=cal)
        )
    return dict(
        m=m, gpu=gpu, kv_tokens=kvt, overhead=overhead, rows=rows, b0=b0, wl=workload(a)
    )


def report(a, R):
    m, gpu, ov = R["m"], R["gpu"], R["overhead"]
    L, D, B, S = m.layers, m.hidden, 128, 3000
    rho, beta = (
        a.tp * gpu.tflops * 1e12 * a.compute_eff,
        a.tp * gpu.hbm_gbs * 1e9 * a.bw_eff,
    )
    c0, (prompts, gens), bmax = (
        Cost(a.compute_eff, a.bw_eff),
        R["wl"],
        max(a.batch_sizes),
    )
    bmid = sorted(a.batch_sizes)[-2] if len(a.batch_sizes) > 1 else bmax
    flags = " ".join(
        f"--{k.replace('_', '-')} {v}"
        for k, v in sorted(vars(a).items())
        if k
        in (
            "model",
            "gpu",
            "tp",
            "mem_util",
            "reserve_gib",
            "requests",
            "mean_gen",
            "gen_sigma",
            "seed",
        )
    )
    out = [
        "## GPU cost model",
        "",
        f"Computed {datetime.date.today().isoformat()}. Command: `python -m bench.gpu_model` (defaults: {flags}). Pure numpy, no GPU used; a model, not a measurement.",
        "",
        "**Method.** Decode step time = max(FLOPs/(TP·peak·compute_eff), bytes/(TP·HBM·bw_eff)) + 2·layers all-reduces + a fixed per-step overhead; "
        "FLOPs = 2·matmul params·B + 4·layers·H·d·ΣS, bytes = weights + ΣS·KV bytes/token (real GQA configs, gated MLP). "
        "Kara event (App. C.2/D.6) = recompute forward over W tokens per sequence (q/o proj + MLP, cached K/V reused) + causal attention on the prefix "
        "+ bidirectional scoring W×(W−U) per head and layer + gather/write of window KV, through the same roofline; SnapKV = U queries × whole cache + global compaction. "
        f"Serving = vLLM-like step simulation of App. B.1: {a.requests} requests, lognormal generation lengths (σ={a.gen_sigma}) clipped to {a.max_gen}, "
        f"mean {gens.mean():.0f} ({100 * np.mean(gens >= a.max_gen):.1f}% hit the cap), prompts mean {prompts.mean():.0f}; "
        f"{m.name} on {a.tp}× {gpu.name} ({gpu.tflops} TFLOPs, {gpu.hbm_gbs} GB/s); KV budget per GPU = {a.mem_util}·{gpu.mem_gib} GiB − {a.reserve_gib} GiB reserve − weights/TP "
        f"= {R['kv_tokens']:,} tokens ({R['kv_tokens'] // a.block} blocks of {a.block}); FCFS admission with 1% watermark, recompute preemption of the newest request; "
        f"Kara W={a.window}, keep {a.keep}, U={a.buffer}, δ={a.period}, ≤{a.max_seqs} seqs/event; SnapKV 1280→1025, U=32. "
        f"Efficiencies: compute {a.compute_eff}, bandwidth {a.bw_eff}.",
        "",
        f"**Eq. 10 check** ({m.name}, B={B}, S={S}, TP={a.tp}): Eq. 10 verbatim TPOT {1e3 * eq10_tpot(L, D, B, S, rho, beta):.2f} ms "
        f"(its memory term assumes MHA: {4 * L * B * S * D / 1e9:.1f} GB of KV); generalised, without weights "
        f"{1e3 * float(step_time(m, gpu, a.tp, B, B * S, c0, weights=False)):.2f} ms (GQA: {B * S * m.kv_bytes_per_token() / 1e9:.1f} GB); "
        f"with weights and all-reduces {1e3 * float(step_time(m, gpu, a.tp, B, B * S, c0)):.2f} ms.",
        "",
        f"**Comparison with Table 3** (Table 2 = its columns 128/256). *Roofline*: no free parameter. *Fitted*: plus a fixed per-step overhead of "
        f"**{1e3 * ov:.1f} ms**, chosen so vLLM at batch {R['b0']} matches its paper throughput (that cell is 0% by construction). "
        "Throughput = generated tokens / makespan; latency = makespan; running = time-weighted mean of decoding requests.",
        "",
        "| framework | batch | paper thr | roofline thr (err) | fitted thr (err) | paper lat s | fitted lat s (err) | running | roofline step ms | compression time | preemptions |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    err = {"roof": [], "cal": [], "lat": []}
    for r in R["rows"]:
        ro, ca, (plat, pthr) = r["roof"], r["cal"], r["p"]
        err["roof"].append(abs(ro["throughput"] / pthr - 1))
        err["lat"].append(abs(ca["latency"] / plat - 1))
        if (r["fw"], r["b"]) != ("vLLM", R["b0"]):
            err["cal"].append(abs(ca["throughput"] / pthr - 1))
        out.append(
            f"| {r['fw']} | {r['b']} | {pthr:,} | {ro['throughput']:,.0f} ({pct(ro['throughput'], pthr)}) | {ca['throughput']:,.0f} ({pct(ca['throughput'], pthr)}) "
            f"| {plat:,} | {ca['latency']:,.0f} ({pct(ca['latency'], plat)}) | {ca['running']:.0f} | {ro['roof_step_ms']:.1f} | {100 * ca['overhead']:.1f}% | {ca['preempt']} |"
        )
    thr = {(r["fw"], r["b"]): r["cal"]["throughput"] for r in R["rows"]}
    gain = {
        b: (
            100 * (thr["KvLLM", b] / thr["vLLM", b] - 1),
            100 * (PAPER["KvLLM"][b][1] / PAPER["vLLM"][b][1] - 1),
        )
        for b in a.batch_sizes
    }
    out += [
        "",
        f"Mean |error| of throughput: roofline {100 * np.mean(err['roof']):.0f}% (15 cells), fitted {100 * np.mean(err['cal']):.0f}% "
        f"({len(err['cal'])} cells not used in the fit); fitted latency {100 * np.mean(err['lat']):.0f}%. "
        "KvLLM gain over vLLM, fitted model vs paper: "
        + "; ".join(f"B={b}: {p:+.1f}% vs {q:+.1f}%" for b, (p, q) in gain.items())
        + ".",
        "",
        f"**Sensitivity** (fitted overhead kept): fitted throughput at batch {bmax} and KvLLM's gain over vLLM when one assumption changes.",
        "",
        f"| change | vLLM thr (err) | KvLLM thr (err) | gain B={bmid} (paper {gain[bmid][1]:+.1f}%) | gain B={bmax} (paper {gain[bmax][1]:+.1f}%) |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, over in (
        ("none", {}),
        ("reserve 0.5 GiB", dict(reserve_gib=0.5)),
        ("reserve 2.5 GiB", dict(reserve_gib=2.5)),
        ("KV budget 8 GB/GPU", dict(kv_budget_gb=8.0)),
        ("gen σ 0.5", dict(gen_sigma=0.5)),
        ("gen σ 1.1", dict(gen_sigma=1.1)),
    ):
        (v0, k0), (v, k) = [
            [
                sim(a, kind, b, overhead=ov, **over)[1]["throughput"]
                for kind in ("full", "kara")
            ]
            for b in (bmid, bmax)
        ]
        out.append(
            f"| {label} | {v:,.0f} ({pct(v, PAPER['vLLM'][bmax][1])}) | {k:,.0f} ({pct(k, PAPER['KvLLM'][bmax][1])}) | {pct(k0, v0)} | {pct(k, v)} |"
        )
    out += [
        "",
        f"**Other configs** (batch limit {bmax}, same GPU/TP/memory rules and workload; fitted overhead reused, which is an extrapolation): tokens/s.",
        "",
        "| model | KV budget tokens | full roofline | Kara roofline (gain) | full fitted | Kara fitted (gain) | Kara compression time |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ("R1-Llama-8B", "Qwen3-8B", "Qwen3-14B"):
        try:
            (fr, fc, _, kvt), (kr, kc, _, _) = (
                sim(a, kind, bmax, model=name, overhead=ov) for kind in ("full", "kara")
            )
        except ValueError as e:
            out.append(f"| {name} | {e} | | | | | |")
            continue
        out.append(
            f"| {name} | {kvt:,} | {fr['throughput']:,.0f} | {kr['throughput']:,.0f} ({pct(kr['throughput'], fr['throughput'])}) | "
            f"{fc['throughput']:,.0f} | {kc['throughput']:,.0f} ({pct(kc['throughput'], fc['throughput'])}) | {100 * kc['overhead']:.1f}% |"
        )
    return out + [""] + ASSESSMENT.strip("\n").split("\n"), err, gain


ASSESSMENT = """
**Assessment (at the defaults).** *Pure roofline:* +93% to +611% (throughput overpredicted everywhere, worst at small batch). The paper's
vLLM at batch 16 spends 16/390 ≈ 41 ms per step where weights + KV traffic on 4 RTX 5090s take ~6 ms: consumer GPUs doing TP over PCIe
(no NVLink/P2P) with a modified, likely eager-mode vLLM are dominated by a fixed per-step cost (launches, Python scheduling, PCIe
all-reduces) that no roofline sees. Zipage (§5.2, App. F) reports the same regime: near-constant step time, throughput set by concurrency.
*With one fitted constant* (33.8 ms/step) throughput is within ±15% for B ≤ 64 (memory not binding: this tests only the constant-step
hypothesis) but 13–37% low at B = 128/256 (SnapKV at 256: +11%), while latency is 31–72% high at B ≤ 32 and within ±28% at B ≥ 64. Both cannot fit: the paper's
"average throughput" is not generated tokens / latency (their product spans 0.88M–2.33M tokens across batch sizes for the same 500
prompts; a makespan model always generates the same ~1.5M). *Kara's gain* is reproduced at B = 256 (+18% vs +15%) and at B ≤ 64
(−1…−3% vs −2.5…+0.8%: recompute cost, nothing to gain) but missed at B = 128 (−3% vs +11%): with the assumed 352k-token budget memory
barely binds at 128 (73 vLLM preemptions); at 8 GB/GPU the gain is +13%. So the KV budget (reserve, usable memory) is the assumption that
drives the error, then the assumed length distribution (lognormal, mean 3,000, cap 8,192), whose tail also sets the drain phase.
*SnapKV:* the model predicts a gain, the paper a loss caused by implementation overhead (query-cache upkeep, global compaction at nearly
every step) that has no FLOP/byte cost here (`--event-overhead-ms` adds it). Kara's compaction is counted at token granularity (blocks =
ceil(tokens/256)). The `--cpu-event-ms` CPU→GPU factor (default 100 ≈ HBM / desktop-DRAM bandwidth for memory-bound ops) is an assumption,
not a measurement; it is off by default and the roofline event cost is used.
"""


FLAGS = [  # (flag, type, default, help)
    ("model", str, "R1-Llama-8B", f"one of {list(MODELS)}"),
    ("gpu", str, "rtx5090", f"one of {list(GPUS)}"),
    ("tp", int, 4, "tensor-parallel degree"),
    ("mem-util", float, 0.5, "vLLM gpu_memory_utilization"),
    (
        "reserve-gib",
        float,
        1.5,
        "per-GPU activation peak + non-torch memory inside the budget",
    ),
    ("kv-budget-gb", float, None, "override: KV bytes per GPU (GB)"),
    ("block", int, 256, "KV block size"),
    ("requests", int, 500, "MATH-500"),
    ("mean-gen", float, 3000, "mean generation length"),
    ("max-gen", int, 8192, "generation cap"),
    ("gen-sigma", float, 0.8, "lognormal sigma of generation lengths"),
    ("prompt-mean", float, 120, "mean prompt length"),
    (
        "batch-sizes",
        lambda v: [int(x) for x in v.split(",")],
        [16, 32, 64, 128, 256],
        "max running requests",
    ),
    ("compute-eff", float, 0.5, "achieved/peak FLOPs"),
    ("bw-eff", float, 0.8, "achieved/peak HBM bandwidth"),
    (
        "step-overhead-ms",
        float,
        None,
        "fixed per-step cost; default: fitted to vLLM at the smallest batch",
    ),
    ("event-overhead-ms", float, 0.0, "fixed cost per compression event"),
    (
        "cpu-event-ms",
        float,
        0.0,
        "measured CPU cost per compressed sequence, added after / cpu-gpu-factor",
    ),
    ("cpu-gpu-factor", float, 100.0, "assumed CPU->GPU speed-up for --cpu-event-ms"),
    ("window", int, 768, "Kara W"),
    ("keep", int, 257, "entries kept per window"),
    ("buffer", int, 32, "Kara U"),
    ("period", int, 128, "delta"),
    ("max-seqs", int, 30, "sequences per event"),
    ("seed", int, 0, "workload seed"),
    (
        "out",
        str,
        None,
        "folder for gpu_model.md and the run record (default: print only)",
    ),
]


def parse(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for flag, typ, default, help_ in FLAGS:
        p.add_argument(f"--{flag}", type=typ, default=default, help=help_)
    a = p.parse_args(argv)
    if a.model not in MODELS or a.gpu not in GPUS:
        p.error(f"--model must be one of {list(MODELS)}, --gpu one of {list(GPUS)}")
    return a


def main(argv=None):
    a = parse(argv)
    lines = report(a, run(a))[0]
    print("\n".join(lines))
    if a.out:
        from bench.record import RunRecord

        record = RunRecord(a.out, argv)
        record.note(**{k: v for k, v in vars(a).items() if k != "out"})
        with open(os.path.join(a.out, "gpu_model.md"), "w") as f:
            f.write("\n".join(lines).rstrip() + "\n")
        record.finish()
        print(f"\n(written to {os.path.join(a.out, 'gpu_model.md')})")


if __name__ == "__main__":
    main()
