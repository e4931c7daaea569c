"""Why does a selection lose the full-KV output? Per-event analysis on a real LM, offline.

Runs the Hugging Face model (transformers, float32, no SGLang) with the masking of
tests/oracle.py: a query at position t does not see the entries evicted by events that ran before
t, per layer and KV head. tests/test_oracle.py shows that this is exactly what sgl_kara computes
(capture queries included: row t is computed under the evictions in force at t), so a selection
rule can be studied here without building it into the runtime first.

For each prompt: the full-KV greedy output (EOS suppressed for --new-tokens, cached in --cache),
then Kara's schedule (window W, buffer U, period delta, compress the oldest uncompressed window
[g, g+W) when it is full, at decode steps multiple of delta). Two measurements:

1. **Matched events** (one trajectory, driven by ``--driver``): at each of its events every
   method selects from the same region under the same context, keeping the same count K, and we
   measure how much full attention the next ``--future`` queries would put on what it drops
   (mass_dropped, averaged over heads, queries and layers) -- StreamingLLM and SnapKV here drop the
   same number D of *generated* entries at the same moments (matched event time and peak KV).
2. **Fidelity** (one trajectory per method, its own evictions): next-token agreement with full KV
   (argmax), KL(full || method), first disagreement (= shared prefix of free greedy decoding), on
   all tokens and on the tokens before the full-KV output's first repetition loop.

    python -m bench.quality.event_analysis --n 12 --new-tokens 600 --window 128 --buffer 16 \
        --period 16 --retention 0.25 --out bench/results/2026-11-23-default-model/event_analysis_w128

Writes event_analysis.json and event_analysis.md, with the run record (run.json, bench/record.py),
under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from bench.quality.real_lm import first_loop
from sgl_kara.policies.kara import (
    default_chunk_budget,
    kept_count,
    select,
    window_scores,
)
from sgl_kara.policies.snapkv import snapkv_pool
from tests.oracle import visibility  # the exactness oracle's masking, shared on purpose

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

ATTN = "sgl_kara_event_analysis"


# ----------------------------------------------------------------------------------------- model
class Probe:
    """Per forward: post-RoPE q/k of every layer and the attention of a few query rows."""

    def __init__(self):
        self.vis = None  # [layers, H_kv, T, T]
        self.q, self.k = {}, {}
        self.rows = None  # (a, b): keep attention probabilities of query rows [a, b)
        self.probs = {}


PROBE = Probe()


def _attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    layer_id = module.layer_idx
    hq, hkv = query.shape[1], key.shape[1]
    g = hq // hkv
    PROBE.q[layer_id], PROBE.k[layer_id] = query[0].detach(), key[0].detach()
    scores = (
        torch.matmul(query.float(), key.repeat_interleave(g, 1).float().transpose(2, 3))
        * scaling
    )
    allowed = PROBE.vis[layer_id].repeat_interleave(g, dim=0)[None]
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    if PROBE.rows is not None:
        a, b = PROBE.rows
        PROBE.probs[layer_id] = probs[0, :, a:b].detach()
    out = torch.matmul(probs, value.repeat_interleave(g, 1).float()).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def load(model_path):
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    AttentionInterface.register(ATTN, _attention)
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation=ATTN
    ).eval()
    return model, AutoTokenizer.from_pretrained(model_path)


@torch.no_grad()
def forward(model, tokens, events, rows=None):
    """Log-probs [T, V] under ``events``; fills PROBE.q / .k / .probs."""
    cfg = model.config
    PROBE.vis = visibility(
        events, len(tokens), cfg.num_hidden_layers, cfg.num_key_value_heads
    )
    PROBE.rows, PROBE.probs = rows, {}
    logits = model(
        input_ids=torch.tensor([tokens]), position_ids=torch.arange(len(tokens))[None]
    ).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@torch.no_grad()
def full_output(model, tok, prompt, n_new, cache_dir):
    import hashlib

    key = hashlib.sha256(f"{model.name_or_path}|{prompt}|{n_new}".encode()).hexdigest()[
        :16
    ]
    path = os.path.join(cache_dir, f"full_{key}.json") if cache_dir else None
    if path and os.path.exists(path):
        return json.load(open(path))
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_tensors="pt",
    )
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    PROBE.vis = None
    from transformers import AutoModelForCausalLM

    plain = getattr(full_output, "_plain", None)
    if plain is None:
        plain = full_output._plain = AutoModelForCausalLM.from_pretrained(
            model.name_or_path, dtype=torch.float32
        ).eval()
    out = plain.generate(
        ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False
    )[0].tolist()
    rec = {"prompt_ids": ids[0].tolist(), "output_ids": out[ids.shape[1] :]}
    if path:
        json.dump(rec, open(path, "w"))
    return rec


# ------------------------------------------------------------------------------------- selection
def window_qk(g, W, M, kv_heads):
    """q [L, B=1, W, H_q, D] of window rows, k [L, 1, M, H_kv, D] of region rows, per layer list."""
    qs, ks = [], []
    for layer_id in sorted(PROBE.q):
        qs.append(
            PROBE.q[layer_id][:, g : g + W].transpose(0, 1)[None]
        )  # [1, W, H_q, D]
        ks.append(PROBE.k[layer_id][:, g : g + M].transpose(0, 1)[None])
    return qs, ks


def global_scores(g, W, M, vis):
    """Bidirectional window scores normalised over the whole visible context: for window query i,
    softmax over every key it can see before the window plus all W window keys; summed over the
    region keys. [L, H_kv, M]."""
    out = []
    for layer_id in sorted(PROBE.q):
        q, k = (
            PROBE.q[layer_id][:, g : g + W],
            PROBE.k[layer_id][:, : g + W],
        )  # [H_q, W, D], [H_kv, g+W, D]
        hq, hkv = q.shape[0], k.shape[0]
        grp = hq // hkv
        s = torch.matmul(
            q.float(), k.repeat_interleave(grp, 0).float().transpose(1, 2)
        ) / math.sqrt(q.shape[-1])
        seen = torch.ones(hkv, W, g + W, dtype=torch.bool)
        seen[:, :, :g] = vis[layer_id][
            :, g : g + W, :g
        ]  # what each window query sees before the window
        p = torch.softmax(
            s.masked_fill(~seen.repeat_interleave(grp, 0), float("-inf")), dim=-1
        )
        out.append(p[:, :, g : g + M].sum(1).reshape(hkv, grp, M).sum(1))
    return torch.stack(out)


def kara_select(scores, K, M, alpha, gamma):
    return select(
        scores, K / M, min(alpha, K - 1), gamma
    )  # [L, H, K] indices into the region


def region_methods(args):
    """name -> fn(ctx) returning kept indices [L, H_kv, K] into the region [g, g+M)."""

    def kara(ctx, alpha=None, rows=slice(None), agg="sum", norm="window"):
        if norm == "global":
            a = global_scores(ctx["g"], ctx["W"], ctx["M"], ctx["vis"])
        else:
            a = torch.stack(
                [
                    window_scores(q[:, rows], k)[0]
                    if agg == "sum"
                    else _max_agg(q[:, rows], k)
                    for q, k in zip(ctx["qs"], ctx["ks"])
                ]
            )
        return kara_select(
            a,
            ctx["K"],
            ctx["M"],
            args.chunk_budget if alpha is None else alpha,
            args.max_chunk,
        )

    def kara_sinks(ctx):
        """Kara, and the first ``--sinks`` generated entries are never dropped (StreamingLLM's
        attention sinks, applied to the request's own output: only its first window holds them)."""
        a = torch.stack([window_scores(q, k)[0] for q, k in zip(ctx["qs"], ctx["ks"])])
        if ctx["g"] == ctx["P"]:
            a[..., : min(args.sinks, ctx["K"] - 1)] = a.amax(-1, keepdim=True) + 1.0
        return kara_select(a, ctx["K"], ctx["M"], args.chunk_budget, args.max_chunk)

    def recency(ctx):
        L, H = len(ctx["qs"]), ctx["ks"][0].shape[2]
        return torch.arange(ctx["M"] - ctx["K"], ctx["M"]).expand(L, H, ctx["K"])

    def rand(ctx):
        L, H = len(ctx["qs"]), ctx["ks"][0].shape[2]
        gen = torch.Generator().manual_seed(ctx["g"])
        return torch.stack(
            [
                torch.randperm(ctx["M"], generator=gen)[: ctx["K"]].sort().values
                for _ in range(L * H)
            ]
        ).reshape(L, H, -1)

    def snapkv_window(ctx):
        a = torch.stack(
            [
                snapkv_pool(window_scores(q[:, -args.snapkv_window :], k)[0], 7)
                for q, k in zip(ctx["qs"], ctx["ks"])
            ]
        )
        return a.topk(ctx["K"], dim=-1).indices.sort(-1).values

    def future(ctx):
        return ctx["future_mass"].topk(ctx["K"], dim=-1).indices.sort(-1).values

    U = args.buffer
    return {
        "kara": lambda c: kara(c),
        "kara-noT2C": lambda c: kara(c, alpha=0),
        "kara-buffer": lambda c: kara(c, rows=slice(args.window - U, None)),
        "kara-global": lambda c: kara(c, norm="global"),
        "kara-max": lambda c: kara(c, agg="max"),
        "kara-sinks": kara_sinks,
        "recency": recency,
        "random": rand,
        "snapkv-window": snapkv_window,
        "future-oracle": future,
    }


def _max_agg(q, k):
    """Like window_scores but the group's query heads are combined by max instead of sum."""
    b, w, hq, d = q.shape
    hkv = k.shape[2]
    logits = torch.einsum(
        "bwhgd,bmhd->bhgwm", q.float().reshape(b, w, hkv, hq // hkv, d), k.float()
    ) / math.sqrt(d)
    return torch.softmax(logits, -1).sum(3).amax(2)[0]


# ------------------------------------------------------------------------------------ simulation
def simulate(model, tokens, P, args, method, methods, matched=None):
    """Kara's schedule with ``method``'s selections. Returns (events, per-event records).
    ``matched``: list to fill with every method's dropped mass at this trajectory's events."""
    W, U = args.window, args.buffer
    M = W - U
    K = kept_count(M, args.retention)
    cfg = model.config
    T = len(tokens)
    events, kept_gen = (
        [],
        None,
    )  # kept_gen: generated positions still held (for matched baselines)
    g = P
    for L in range(P, T):
        step = L - P + 1  # decode_steps when the forward of position L is prepared
        if step % args.period or L - g < W:
            continue
        while L - g >= W:
            F = min(args.future, T - L)
            forward(model, tokens, events, rows=(L, L + F))
            vis = PROBE.vis
            qs, ks = window_qk(g, W, M, cfg.num_key_value_heads)
            # future mass per (layer, kv head, region key): next F queries under the current context
            fm = torch.stack(
                [
                    PROBE.probs[layer_id][:, :, g : g + M].mean(1)
                    for layer_id in sorted(PROBE.probs)
                ]
            )  # [L, H_q, M]
            grp = cfg.num_attention_heads // cfg.num_key_value_heads
            fm_kv = fm.reshape(fm.shape[0], -1, grp, M).sum(2)
            ctx = dict(
                g=g, P=P, W=W, M=M, K=K, qs=qs, ks=ks, vis=vis, future_mass=fm_kv
            )
            kept = methods[method](ctx)
            if matched is not None:
                matched.append(_matched_record(ctx, methods, L, P, args, vis, kept_gen))
            evicted = [
                [
                    sorted(set(range(g, g + M)) - set((kept[layer_id, h] + g).tolist()))
                    for h in range(kept.shape[1])
                ]
                for layer_id in range(kept.shape[0])
            ]
            events.append({"logical_len": L, "evicted": evicted})
            g += M
    return events


def _matched_record(ctx, methods, L, P, args, vis, kept_gen):
    """Dropped future mass of every method at this event (same region, K; for streaming /
    snapkv-matched: the same count D of generated entries, from everything generated)."""
    M, K, g = ctx["M"], ctx["K"], ctx["g"]
    fm = ctx[
        "future_mass"
    ]  # [L, H_kv, M] (sum over the group's heads of the mean over queries)
    rec = {"L": L, "g": g, "region_mass": float(fm.sum(-1).mean())}
    for name, fn in methods.items():
        kept = fn(ctx)
        drop = torch.ones_like(fm, dtype=torch.bool)
        drop.scatter_(2, kept, False)
        rec[name] = float((fm * drop).sum(-1).mean())
    # Generated-region baselines at the same moment, dropping the same D = M - K entries.
    D = M - K
    probs = torch.stack(
        [PROBE.probs[layer_id].mean(1) for layer_id in sorted(PROBE.probs)]
    )  # [L, H_q, T]
    grp = probs.shape[1] // vis.shape[1]
    gm = probs.reshape(probs.shape[0], -1, grp, probs.shape[-1]).sum(2)[
        ..., P:L
    ]  # generated keys
    held = vis[:, :, L, P:L]  # [L, H_kv, n] still visible at L
    n = L - P
    pos = torch.arange(n).expand_as(held)
    sinks = args.sinks
    # streaming: oldest held generated entries beyond the sinks (and outside the last w)
    order = torch.where(
        held & (pos >= sinks) & (pos < n - args.snapkv_window), pos, n + pos
    )
    stream_drop = torch.zeros_like(held)
    stream_drop.scatter_(2, order.argsort(-1)[..., :D], True)
    rec["streaming-matched"] = float((gm * (stream_drop & held)).sum(-1).mean())
    # snapkv: lowest pooled score of the last w queries among held generated entries
    last = torch.stack(
        [
            PROBE.q[layer_id][:, L - args.snapkv_window : L]
            for layer_id in sorted(PROBE.q)
        ]
    )  # [L, H_q, w, D]
    ks = torch.stack(
        [PROBE.k[layer_id][:, P:L] for layer_id in sorted(PROBE.k)]
    )  # [L, H_kv, n, D]
    s = torch.einsum(
        "lhwd,lhnd->lhwn", last.float(), ks.repeat_interleave(grp, 1).float()
    ) / math.sqrt(last.shape[-1])
    s = s.masked_fill(~held.repeat_interleave(grp, 1)[:, :, None], float("-inf"))
    sc = torch.softmax(s, -1).sum(2).reshape(held.shape[0], -1, grp, n).sum(2)
    sc = snapkv_pool(sc, 7).masked_fill(
        ~held | (pos >= n - args.snapkv_window), float("inf")
    )
    snap_drop = torch.zeros_like(held)
    snap_drop.scatter_(2, sc.argsort(-1)[..., :D], True)
    rec["snapkv-matched"] = float((gm * (snap_drop & held)).sum(-1).mean())
    rec["generated_mass"] = float(gm.sum(-1).mean())
    # Where the next queries' attention to generated entries goes, by distance back from L.
    dist = L - (
        P + torch.arange(n)
    )  # distance of each generated key from the event position
    rec["by_distance"] = {
        f"{lo}-{hi}": float((gm * ((dist >= lo) & (dist <= hi))).sum(-1).mean())
        for lo, hi in DISTANCES
    }
    return rec


DISTANCES = [(1, 16), (17, 32), (33, 64), (65, 128), (129, 256), (257, 10**9)]


def fidelity(full_lp, lp, P, out_ids, loop_at):
    """Agreement / KL / first disagreement / PPL of the full-KV text, over generated steps."""
    rows = slice(P - 1, P - 1 + len(out_ids))
    f, m = full_lp[rows], lp[rows]
    agree = (m.argmax(-1) == f.argmax(-1)).float()
    kl = (f.exp() * (f - m)).sum(-1).clamp_min(0)
    nll = -m.gather(1, torch.tensor(out_ids)[:, None])[:, 0]
    dis = (agree == 0).nonzero()
    first = int(dis[0]) if len(dis) else len(out_ids)
    cut = slice(0, max(1, loop_at))
    return {
        "agree": float(agree.mean()),
        "kl": float(kl.mean()),
        "ppl": float(nll.mean().exp()),
        "first_disagree": first,
        "agree_noloop": float(agree[cut].mean()),
        "kl_noloop": float(kl[cut].mean()),
        "steps": len(out_ids),
        "steps_noloop": cut.stop,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model-path", default=None, help="default: the SmolLM2 default model"
    )
    ap.add_argument("--prompts", default=os.path.join(HERE, "real_prompts.jsonl"))
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument(
        "--stride",
        type=int,
        default=4,
        help="take every k-th prompt (kinds interleaved)",
    )
    ap.add_argument("--new-tokens", type=int, default=600)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--buffer", type=int, default=16)
    ap.add_argument("--period", type=int, default=16)
    ap.add_argument("--retention", type=float, default=0.25)
    ap.add_argument("--chunk-budget", type=int, default=None)
    ap.add_argument("--max-chunk", type=int, default=8)
    ap.add_argument("--snapkv-window", type=int, default=32)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument(
        "--future",
        type=int,
        default=32,
        help="queries after an event whose attention is measured",
    )
    ap.add_argument("--driver", default="kara")
    ap.add_argument(
        "--methods", nargs="+", default=None, help="fidelity runs (default: all)"
    )
    ap.add_argument("--cache", default=os.path.join(ROOT, "bench", "results", "cache"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    if args.chunk_budget is None:
        args.chunk_budget = default_chunk_budget(
            kept_count(args.window - args.buffer, args.retention)
        )
    if args.model_path is None:
        from sgl_kara.cpu.smollm2 import default_model_path

        args.model_path = default_model_path()
    from bench.record import RunRecord

    record = RunRecord(args.out, argv)
    record.note(model_path=args.model_path)
    os.makedirs(args.cache, exist_ok=True)
    model, tok = load(args.model_path)
    rows = [json.loads(line) for line in open(args.prompts)]
    prompts = [rows[(i * args.stride) % len(rows)] for i in range(args.n)]
    methods = region_methods(args)
    fid_methods = args.methods or list(methods) + []
    results = {
        "args": vars(args),
        "prompts": [],
        "matched": [],
        "fidelity": {m: [] for m in fid_methods},
    }
    tic = time.time()
    for pi, row in enumerate(prompts):
        rec = full_output(model, tok, row["prompt"], args.new_tokens, args.cache)
        P, out_ids = len(rec["prompt_ids"]), rec["output_ids"]
        tokens = rec["prompt_ids"] + out_ids
        loop_at = first_loop(out_ids)
        full_lp = forward(model, tokens, [])
        results["prompts"].append({"id": row["id"], "P": P, "loop_at": loop_at})
        matched = []
        for m in fid_methods:
            events = simulate(
                model,
                tokens,
                P,
                args,
                m,
                methods,
                matched if m == args.driver else None,
            )
            lp = forward(model, tokens, events)
            fid = fidelity(full_lp, lp, P, out_ids, loop_at)
            fid.update(id=row["id"], events=len(events))
            results["fidelity"][m].append(fid)
        for r in matched:
            r["id"] = row["id"]
        results["matched"] += matched
        print(
            f"[{pi + 1}/{len(prompts)}] {row['id']} P={P} loop_at={loop_at} "
            + " ".join(
                f"{m}:{results['fidelity'][m][-1]['first_disagree']}"
                for m in fid_methods
            )
            + f"  ({time.time() - tic:.0f}s)",
            flush=True,
        )
        json.dump(results, open(os.path.join(args.out, "event_analysis.json"), "w"))
    table = summarize(results, fid_methods)
    record.write_md(os.path.join(args.out, "event_analysis.md"), table)
    record.finish()
    print(table)


def summarize(results, methods) -> str:
    a = results["args"]
    lines = [
        f"Model {os.path.basename(a['model_path'])}, {len(results['prompts'])} prompts x {a['new_tokens']} "
        f"tokens (full-KV greedy, EOS suppressed), W={a['window']} U={a['buffer']} period={a['period']} "
        f"r={a['retention']} alpha={a['chunk_budget']} gamma={a['max_chunk']}.",
        "",
        "Matched events (driver: "
        + a["driver"]
        + f"): full-KV attention of the next {a['future']} queries "
        "that lands on the dropped entries (mean over layers, heads, queries, events; lower is better).",
        "",
        "| selection | dropped mass | share of region mass |",
        "|---|---|---|",
    ]
    mt = results["matched"]
    if mt:
        region = sum(r["region_mass"] for r in mt) / len(mt)
        names = [
            k
            for k in mt[0]
            if k not in ("L", "g", "region_mass", "generated_mass", "id", "by_distance")
        ]
        for n in names:
            v = sum(r[n] for r in mt) / len(mt)
            lines.append(f"| {n} | {v:.4f} | {v / region:.3f} |")
        lines.append(f"| (whole window region) | {region:.4f} | 1.000 |")
        gen = sum(r["generated_mass"] for r in mt) / len(mt)
        lines.append(f"| (all generated entries) | {gen:.4f} | |")
        lines += [
            "",
            "Attention of those queries to generated entries by distance back from the event "
            "(share of all attention to generated entries):",
            "",
            "| distance | " + " | ".join(mt[0]["by_distance"]) + " |",
            "|---|" + "---|" * len(mt[0]["by_distance"]),
            "| share | "
            + " | ".join(
                f"{sum(r['by_distance'][k] for r in mt) / len(mt) / gen:.3f}"
                for k in mt[0]["by_distance"]
            )
            + " |",
        ]
    lines += [
        "",
        "Fidelity with each selection's own evictions (token-weighted; shared prefix = first "
        "disagreement, median over prompts; no-loop = steps before the full-KV output's first "
        "repetition loop).",
        "",
        "| selection | agreement | KL | PPL | shared prefix (median) | identical to end | agreement no-loop | KL no-loop |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in methods:
        rs = results["fidelity"][m]
        if not rs:
            continue
        steps = sum(r["steps"] for r in rs)
        sn = sum(r["steps_noloop"] for r in rs)
        fd = sorted(r["first_disagree"] for r in rs)
        lines.append(
            f"| {m} | {sum(r['agree'] * r['steps'] for r in rs) / steps:.4f} | "
            f"{sum(r['kl'] * r['steps'] for r in rs) / steps:.4f} | "
            f"{math.exp(sum(math.log(r['ppl']) * r['steps'] for r in rs) / steps):.3f} | {fd[len(fd) // 2]} | "
            f"{sum(r['first_disagree'] == r['steps'] for r in rs)}/{len(rs)} | "
            f"{sum(r['agree_noloop'] * r['steps_noloop'] for r in rs) / sn:.4f} | "
            f"{sum(r['kl_noloop'] * r['steps_noloop'] for r in rs) / sn:.4f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
