"""Throughput across workloads: when does Kara pay? (``python -m bench.throughput --grid ...``)

A grid of cells -- output length G x KV pool (a fraction of the workload's full KV) x Kara window
W -- and in each cell, one after another in a rotating order, vanilla SGLang, Kara and the
threshold baselines on the same R requests (``ignore_eos``, sampled) and the same pool:

    pool        = frac * R * (P + G)                       (P: the longest prompt, in tokens)
    --spread S  output lengths spread evenly over [G (1 - S), G (1 + S)], mean G (default 0)
    kara        W, U = max(8, W/16), period = max(4, W/4), r = --retention, Token2Chunk default;
                kara-pressure / kara-headroom: --kara-trigger pressure / headroom; kara-buffer:
                --kara-scoring buffer (the last U queries score the window)
    baselines   budget matched per request to Kara's peak footprint (its admission estimate):
                C_max = min(G, ceil(G K / (W - U)) + W + period),  N = C_max - (W - U), window U

Judged on output tokens per CPU-second of the scheduler (the heat maps) and of the whole engine,
wall time beside them; with --repeats, medians. Also per cell: mean running requests against the
footprint limit (P + G) / (P + r G + W) times vanilla's, retractions, and the share of wall time
spent compressing; from the per-step trace (bench/step_costs.py), the saturated-phase rate and a
step-cost model that splits each ratio into concurrency, shorter rows and compression (costs.md).
Vanilla does not depend on W: it runs once per (G, frac).

    python -m bench.throughput --grid --model tiny --out DIR
    python -m bench.throughput --grid --model smollm2 --gens 256 512 1024 --windows 64 128 ... --out DIR

Writes grid.md / costs.md / grid.json after every run, grid_<system>.png heat maps (ratio to
vanilla) and the run record (run.json, bench/record.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

from bench.engine_env import kara_opts

BASELINES = ("snapkv", "streaming", "h2o", "rkv")


def tiny_model() -> str:
    """The random-weight 4-layer Llama of the tiny grids (bench/results/throughput.md, Terms)."""
    from bench.models.tiny import write_tiny_model

    path = os.path.join(tempfile.gettempdir(), "sgl_kara_tiny_llama_h128_l4_s2026")
    if not os.path.exists(os.path.join(path, "config.json")):
        shape = dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2)
        write_tiny_model(
            path, "llama", **shape, intermediate_size=256, vocab_size=512, seed=2026
        )
    return path


def model_path(name: str) -> str:
    """tiny | smollm2 | a checkpoint path -> a checkpoint path."""
    if name == "tiny":
        return tiny_model()
    if name == "smollm2":
        from sgl_kara.cpu.smollm2 import default_model_path

        return default_model_path()
    return name


def grid_prompts(n: int) -> list[str]:
    return [f"Problem {i}: let x{i} = {i % 10}. Think step by step." for i in range(n)]


def kara_shape(w: int) -> tuple[int, int]:
    """(U, period) for window W."""
    return max(8, w // 16), max(4, w // 4)


def kara_peak(gen: int, w: int, retention: float) -> int:
    """Kara's admission footprint of G generated tokens (policies/kara.py: footprint)."""
    from sgl_kara.policies.kara import kept_count

    u, period = kara_shape(w)
    m = w - u
    return min(gen, math.ceil(gen * kept_count(m, retention) / m) + w + period)


KARA_VARIANTS = {  # --systems name -> Kara options beside the cell's W, U, period, r
    "kara": {"kara_trigger": "schedule"},
    "kara-pressure": {"kara_trigger": "pressure"},
    "kara-headroom": {"kara_trigger": "headroom"},
    "kara-buffer": {"kara_trigger": "schedule", "kara_scoring": "buffer"},
}


def system_spec(system: str, gen: int, w: int | None, args, n: int):
    """(label, sgl_kara options or None for vanilla, per-request custom_params.kara or None);
    ``args.kara_opt`` (``--kara-opt``) applies to every compressing system."""
    if system == "vanilla":
        return "vanilla", None, None
    extra = kara_opts(getattr(args, "kara_opt", None) or [])
    from sgl_kara.config import QUERY_SOURCES

    name = system
    # "kara:recompute": this system's own query source
    system, _, source = system.partition(":")
    source = source or args.query_source
    if source not in QUERY_SOURCES:
        raise ValueError(
            f"--systems {name}: the query source after ':' must be one of {', '.join(QUERY_SOURCES)}"
        )
    u, period = kara_shape(w)
    if system in KARA_VARIANTS:
        opts = dict(
            kara_policy="kara", kara_window=w, kara_buffer=u, kara_period=period
        )
        opts.update(kara_retention=args.retention, kara_max_seqs=256)
        opts.update(kara_query_source=source, **KARA_VARIANTS[system])
        return f"{name} W={w}", {**opts, **extra}, None
    gap = w - u
    peak = kara_peak(gen, w, args.retention)
    prefix = f"kara_{system}_"
    floor = u + 8
    opts = {
        "kara_policy": system,
        prefix + "window": u,
        prefix + "budget": floor,
        prefix + "threshold": floor + gap,
        "kara_query_source": source,
        **extra,
    }
    budget = max(floor, peak - gap)
    return f"{name} W={w}", opts, [{"budget": budget}] * n


def output_lengths(gen: int, n: int, spread: float) -> list[int]:
    """Per-request output lengths: all ``gen`` (spread 0), or evenly over [gen (1 - spread),
    gen (1 + spread)], mean ``gen`` within rounding, in a fixed shuffled order."""
    import random

    if not 0.0 <= spread < 1.0:
        raise ValueError(f"--spread must be in [0, 1) (got {spread})")
    if spread == 0 or n == 1:
        return [gen] * n
    lengths = [round(gen * (1 - spread + 2 * spread * j / (n - 1))) for j in range(n)]
    random.Random(0).shuffle(lengths)
    return lengths


def cells(args):
    return [(g, f) for g in args.gens for f in args.pool_fractions]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    arg = ap.add_argument
    arg("--grid", action="store_true", help=argparse.SUPPRESS)
    arg("--model", default="tiny", help="tiny | smollm2 | a checkpoint path")
    arg("--requests", type=int, default=32)
    arg("--gens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    arg("--pool-fractions", type=float, nargs="+", default=[0.5, 0.25, 0.125])
    arg("--windows", type=int, nargs="+", default=[64, 128, 512])
    arg(
        "--systems",
        nargs="+",
        default=["vanilla", "kara", "snapkv", "streaming"],
        help="vanilla, kara, kara-pressure, kara-headroom, kara-buffer, or a baseline; ':<source>' after a name "
        "(kara:recompute) gives that system its own query source",
    )
    arg("--retention", type=float, default=0.25)
    arg("--max-running", type=int, default=256)
    arg("--omp-threads", type=int, default=1)
    arg(
        "--query-source",
        default="auto",
        choices=("auto", "capture", "recompute"),
        help="auto: sgl_kara's rule (ring rows bounded by the pool; with GQA, g >= 2, the ring is about g/2 of the pool or more: recompute)",
    )
    h = "runs per system and cell (order rotated); medians"
    arg("--repeats", type=int, default=1, help=h)
    h = "output lengths spread evenly over [G(1-S), G(1+S)], mean G (0: all G; waves)"
    arg("--spread", type=float, default=0.0, help=h)
    h = "scheduler on the last core alone, the other engine processes on the rest (steadier CPU times)"
    arg("--pin", action=argparse.BooleanOptionalAction, default=True, help=h)
    h = "another sgl_kara option for every compressing system, e.g. phase=server (repeatable)"
    arg("--kara-opt", action="append", default=[], metavar="NAME=VALUE", help=h)
    arg("--out", required=True)
    args = ap.parse_args(argv)
    try:
        kara_opts(args.kara_opt)
    except ValueError as e:
        ap.error(str(e))
    from transformers import AutoTokenizer

    from bench.engine_run import run_system
    from bench.record import RunRecord
    from sgl_kara import env as kara_env

    record = RunRecord(args.out, argv)
    args.env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith("KARA_") and k != "KARA_TRACE"
    }
    args.env.setdefault(
        "KARA_PACKED_CPU_LINEAR", "1 (default)" if kara_env.packed_cpu_linear() else "0"
    )
    args.stamp = record.stamp
    args.command = record.data["command"]

    model = model_path(args.model)
    args.model_path = model
    os.makedirs(args.out, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(model)
    prompts = grid_prompts(args.requests)
    p_len = max(len(tok(p)["input_ids"]) for p in prompts) + 1
    runs = []
    for gen, frac in cells(args):
        specs = []
        if "vanilla" in args.systems:
            specs.append(system_spec("vanilla", gen, None, args, args.requests))
        specs += [
            system_spec(s, gen, w, args, args.requests)
            for w in args.windows
            for s in args.systems
            if s != "vanilla"
        ]
        runs.append((gen, frac, specs))
    total = sum(len(s) for _, _, s in runs) * args.repeats
    try:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="grid runs", file=sys.stdout)
    except ImportError:
        bar = None
    results = []
    order = [(i, rep) for i in range(len(runs)) for rep in range(args.repeats)]
    for i, rep in order:
        gen, frac, specs = runs[i]
        pool = int(frac * args.requests * (p_len + gen))
        k = (i + rep) % len(specs)
        # rotate the order per cell and repeat
        for label, opts, per_request in specs[k:] + specs[:k]:
            r = run_one(
                run_system, args, prompts, gen, pool, label, opts, per_request, record
            )
            window = int(label.split("W=")[1]) if "W=" in label else None
            row = dict(gen=gen, frac=frac, pool=pool, label=label, repeat=rep)
            row.update(prompt_len=p_len, system=label.split(" W=")[0], window=window)
            results.append({**row, **r})
            if bar is not None:
                bar.set_postfix_str(
                    f"G={gen} pool={frac:g} {label}: {r['tps_sched']:.0f} tok/sched-CPU-s"
                )
                bar.update(1)
            write(results, args, argv)
    if bar is not None:
        bar.close()
    write(results, args, argv)
    heat_maps(ratios(results), args)
    record.finish()
    return results


def run_one(
    run_system, args, prompts, gen, pool, label, opts, per_request, record=None
) -> dict:
    lengths = output_lengths(gen, len(prompts), args.spread)
    params = [
        {"max_new_tokens": lengths[j], "temperature": 0.8, "ignore_eos": True}
        | ({"custom_params": {"kara": per_request[j]}} if per_request else {})
        for j in range(len(prompts))
    ]
    system = "vanilla" if opts is None else opts["kara_policy"]
    r = run_system(
        system,
        args,
        pool,
        args.max_running,
        kara=opts,
        prompts_params=(prompts, params),
        label=label,
        record=record,
    )
    out = dict(tps=r.tps, tps_cpu=r.tps_cpu, tps_sched=r.tps_scheduler_cpu)
    same = (
        "seconds cpu_seconds scheduler_cpu_seconds mean_running peak_running retractions "
        "events compress_share lengths_ok ring_bytes fallbacks"
    )
    out.update({k: getattr(r, k) for k in same.split()})
    out["pool_bytes"] = pool * kv_bytes_per_token(args.model_path)
    out.update(mean_kv=r.mean_kv, skipped=r.skipped)
    return {**out, **concurrency_profile(r.trace), **step_profile(r.trace)}


def step_profile(trace: list[dict]) -> dict:
    """From the per-step trace (bench/step_costs.py): the saturated phase's rate (intervals at which
    a request waited for admission; ``sat_tps`` tokens per scheduler CPU-second), the whole run's
    rate from the same intervals, and the step-cost fit statistics."""
    from bench import step_costs

    ivs = step_costs.intervals(trace)
    sat = step_costs.saturated(ivs)
    return dict(
        saturated=sat,
        sat_tps=sat["tps"] if sat else None,
        steps_rate=step_costs.rate(ivs),
        fit_stats=step_costs.fit_stats(ivs),
    )


def concurrency_profile(trace: list[dict]) -> dict:
    """From the per-step trace (KARA_TRACE lines): the share of decode steps at which a request
    waited for admission, mean running requests at those steps (the admission-bound phase) and
    after them (the drain), and mean running by tenth of the run's steps."""
    steps = [s for s in trace if s["running"] > 0]
    if not steps:
        return {}
    waiting = [s["running"] for s in steps if s.get("waiting", 0) > 0]
    drain = [s["running"] for s in steps if s.get("waiting", 0) == 0]
    k = -(-len(steps) // 10)
    return dict(
        waiting_share=len(waiting) / len(steps),
        running_while_waiting=sum(waiting) / len(waiting) if waiting else None,
        running_after_waiting=sum(drain) / len(drain) if drain else None,
        running_by_tenth=[
            round(
                sum(s["running"] for s in steps[i : i + k]) / len(steps[i : i + k]), 1
            )
            for i in range(0, len(steps), k)
        ],
    )


def kv_bytes_per_token(model_path: str) -> int:
    """KV bytes per token of the served model (float32 on CPU), for the ring-vs-pool column."""
    from sgl_kara.model_shape import ModelShape

    shape = ModelShape.from_model_path(model_path)
    return shape.kv_bytes_per_token(4) if shape is not None else 0


METRICS = ("tps", "tps_cpu", "tps_sched", "mean_running", "compress_share", "mean_kv")


def ratios(results):
    """Per (cell, system): medians over repeats, and their ratios to vanilla's in the same cell
    (tokens per engine CPU-s, per scheduler CPU-s, per wall s; mean running requests)."""
    import statistics

    groups: dict[tuple, list] = {}
    for r in results:
        groups.setdefault((r["gen"], r["frac"], r["label"]), []).append(r)
    med = []
    for runs in groups.values():
        m = dict(
            runs[0],
            runs=len(runs),
            retractions=sum(r["retractions"] for r in runs),
            skipped=sum(r.get("skipped", 0) for r in runs),
            lengths_ok=all(r["lengths_ok"] for r in runs),
            peak_running=max(r["peak_running"] for r in runs),
        )
        m.update({k: statistics.median(r[k] for r in runs) for k in METRICS})
        m["spread_sched"] = [round(r["tps_sched"]) for r in runs]
        sat = [r["sat_tps"] for r in runs if r.get("sat_tps")]
        m["sat_tps"] = statistics.median(sat) if sat else None
        if sat:  # the saturated phase (batch, rows, events) of the run nearest the median rate
            m["saturated"] = min(
                (r for r in runs if r.get("sat_tps")),
                key=lambda r: abs(r["sat_tps"] - m["sat_tps"]),
            )["saturated"]
        med.append(m)
    base = {(r["gen"], r["frac"]): r for r in med if r["system"] == "vanilla"}
    out = []
    for r in med:
        b = base.get((r["gen"], r["frac"]))
        out.append(
            dict(
                r,
                cpu_ratio=r["tps_cpu"] / b["tps_cpu"] if b else None,
                sched_ratio=r["tps_sched"] / b["tps_sched"] if b else None,
                wall_ratio=r["tps"] / b["tps"] if b else None,
                running_ratio=r["mean_running"] / b["mean_running"]
                if b and b["mean_running"]
                else None,
                sat_ratio=r["sat_tps"] / b["sat_tps"]
                if b and r.get("sat_tps") and b.get("sat_tps")
                else None,
            )
        )
    return out


def footprint_limit(r, retention):
    """(P + G) / (P + r G + W): how many more requests the pool holds at Kara's footprint."""
    if r["window"] is None or r["system"] == "vanilla":
        return None
    p, g, w = r["prompt_len"], r["gen"], r["window"]
    return (p + g) / (p + min(g, retention * g + w))


def wave_bound(r, requests: int, retention: float):
    """(gain, n_vanilla, n_kara): R equal-length requests arriving together run in waves of n =
    pool // (per-request charge) -- vanilla's charge P + G, Kara's P + its admission footprint --
    so mean running is R / ceil(R / n) and the concurrency gain Kara can reach is
    ceil(R / n_vanilla) / ceil(R / n_kara), however far its footprint limit lies above it."""
    if r["window"] is None or not r["system"].startswith("kara"):
        return None
    p, g, pool = r["prompt_len"], r["gen"], r["pool"]
    n_v = min(requests, max(1, pool // (p + g)))
    n_k = min(requests, max(1, pool // (p + kara_peak(g, r["window"], retention))))
    return math.ceil(requests / n_v) / math.ceil(requests / n_k), n_v, n_k


def ring(r) -> str:
    """The capture ring's memory beside the KV pool's (memory Kara uses beyond the pool)."""
    if not r.get("ring_bytes"):
        return "-"
    share = (
        f"{r['ring_bytes'] / r['pool_bytes']:.2f}x"
        if r.get("pool_bytes")
        else f"{r['ring_bytes'] >> 20} MiB"
    )
    return f"{share} ({r.get('fallbacks', 0)})"


def write(results, args, argv):
    rows = ratios(results)
    cmd = getattr(args, "command", None) or "python -m bench.throughput " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    write_table(rows, args, cmd)
    write_costs(results, args, cmd)
    with open(os.path.join(args.out, "grid.json"), "w") as f:
        json.dump(
            {
                "args": {k: v for k, v in vars(args).items()},
                "command": cmd,
                "runs": rows,
                "all_runs": results,
            },
            f,
            indent=1,
        )


def write_table(rows, args, cmd: str) -> None:
    head = (
        "| G | pool | system | runs | tok/sched-CPU-s | vs vanilla (sched CPU) | tok/CPU-s | vs vanilla (CPU) "
        "| tok/s wall | vs vanilla (wall) | mean / peak running | running vs vanilla | mean KV rows / request "
        "| footprint limit "
        "| wave bound (per wave: vanilla, kara) | retractions (requests an event could not compact) "
        "| compress share | capture ring / pool (fallbacks) "
        "| while requests wait: tok/sched-CPU-s, vs vanilla (running) "
        "| lengths ok |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    fmt = lambda x, f="{:.2f}x": "-" if x is None else f.format(x)  # noqa: E731
    for r in rows:
        lim = footprint_limit(r, args.retention)
        # whole waves only when every request has the same length (grids saved before --spread: equal)
        waves = (
            None
            if getattr(args, "spread", 0.0)
            else wave_bound(r, args.requests, args.retention)
        )
        kv = "-" if r.get("mean_kv") is None else f"{r['mean_kv']:.0f}"
        lines.append(
            f"| {r['gen']} | {r['frac']:g} ({r['pool']}) | {r['label']} | {r['runs']} | {r['tps_sched']:.1f} "
            f"{r['spread_sched']} | {fmt(r['sched_ratio'])} | {r['tps_cpu']:.1f} | {fmt(r['cpu_ratio'])} "
            f"| {r['tps']:.1f} | {fmt(r['wall_ratio'])} | {r['mean_running']:.1f} / {r['peak_running']} "
            f"| {fmt(r['running_ratio'])} | {kv} "
            f"| {fmt(lim)} "
            f"| {'-' if waves is None else f'{waves[0]:.2f}x ({waves[1]}, {waves[2]})'} "
            f"| {r['retractions']} ({r.get('skipped', '-')}) | {100 * r['compress_share']:.1f}% | {ring(r)} "
            f"| {saturated_cell(r)} "
            f"| {r['lengths_ok']} |"
        )
    with open(os.path.join(args.out, "grid.md"), "w") as f:
        f.write(
            f"command: {cmd}\nmodel: {args.model_path}\n{settings(args)}\n"
            + "\n".join(lines)
            + "\n"
        )


def settings(args) -> str:
    """The sgl_kara variables the engines ran with (they change what vanilla runs too), as recorded."""
    env = getattr(args, "env", None) or {}
    # date and machine, recorded with the run (grids before it have none)
    stamp = getattr(args, "stamp", None)
    return (f"{stamp}\n" if stamp else "") + "".join(
        f"environment: {k}={v}\n" for k, v in sorted(env.items())
    )


def saturated_cell(r) -> str:
    """The saturated phase's rate, its ratio to vanilla's and its mean running requests."""
    sat = r.get("saturated")
    if not sat:
        return "-"
    ratio = "" if r.get("sat_ratio") is None else f", {r['sat_ratio']:.2f}x"
    return f"{sat['tps']:.1f}{ratio} ({sat['running']:.1f})"


def cost_rows(results, retention: float) -> list[dict]:
    """Per cell and compressing system, the step-cost model fitted jointly to vanilla's runs and the
    system's, and the parts of its saturated ratio (bench/step_costs.py: explain)."""
    from bench import step_costs

    rows = ratios(results)
    out = []
    for gen, frac in dict.fromkeys((r["gen"], r["frac"]) for r in rows):
        cell = [
            r
            for r in results
            if r["gen"] == gen and r["frac"] == frac and r.get("fit_stats")
        ]
        base = next(
            (
                r
                for r in rows
                if (r["gen"], r["frac"]) == (gen, frac) and r["system"] == "vanilla"
            ),
            None,
        )
        for r in rows:
            if (r["gen"], r["frac"]) != (gen, frac) or r["system"] == "vanilla":
                continue
            pair = [
                x for x in cell if x["label"] in ("vanilla", r["label"])
            ]  # vanilla's runs and this system's
            model = step_costs.fit([x["fit_stats"] for x in pair])
            parts = None
            if (
                model is not None
                and base
                and base.get("saturated")
                and r.get("saturated")
            ):
                lim = footprint_limit(r, retention)
                parts = step_costs.explain(
                    model,
                    base["saturated"],
                    r["saturated"],
                    None if lim is None else lim * base["saturated"]["running"],
                )
            out.append(
                dict(
                    gen=gen,
                    frac=frac,
                    label=r["label"],
                    model=model,
                    parts=parts,
                    sat_ratio=r.get("sat_ratio"),
                    sched_ratio=r["sched_ratio"],
                )
            )
    return out


def write_costs(results, args, cmd: str) -> None:
    """costs.md: each cell's step-cost model and what each ratio is made of."""
    head = (
        "| G | pool | system | step = fixed + per request x B + per row x rows (ms, ms, us; R^2, steps) "
        "| fixed share of vanilla's step "
        "| ratio, whole run | ratio while requests wait | model's ratio there "
        "| rows alone (vanilla's B) | batch alone (vanilla's rows) | at the footprint limit, no events |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    fmt = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    for c in cost_rows(results, args.retention):
        m, p = c["model"], c["parts"] or {}
        model = (
            "-"
            if m is None
            else (
                f"{1e3 * m.fixed:.1f} + {1e3 * m.per_request:.2f} B + {1e6 * m.per_row:.3f} rows "
                f"({m.r2:.3f}, {m.n})"
            )
        )
        share = "-" if not p else f"{100 * p['fixed_share']:.0f}%"
        lines.append(
            f"| {c['gen']} | {c['frac']:g} | {c['label']} | {model} | {share} | {fmt(c['sched_ratio'])} "
            f"| {fmt(c['sat_ratio'])} | {fmt(p.get('predicted'))} | {fmt(p.get('same_batch'))} "
            f"| {fmt(p.get('batching'))} | {fmt(p.get('at_limit'))} |"
        )
    with open(os.path.join(args.out, "costs.md"), "w") as f:
        f.write(
            f"command: {cmd}\nmodel: {args.model_path}\n{settings(args)}\n"
            + "\n".join(lines)
            + "\n"
        )


def heat_maps(rows, args):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no heat maps")
        return
    for system in [s for s in args.systems if s != "vanilla"]:
        fig, axes = plt.subplots(
            1, len(args.windows), figsize=(4.6 * len(args.windows), 3.6), squeeze=False
        )
        for i, (ax, w) in enumerate(zip(axes[0], args.windows)):
            grid = [
                [
                    next(
                        (
                            r["sched_ratio"]
                            for r in rows
                            if r["system"] == system
                            and r["window"] == w
                            and r["gen"] == g
                            and r["frac"] == f
                        ),
                        float("nan"),
                    )
                    for g in args.gens
                ]
                for f in args.pool_fractions
            ]
            im = ax.imshow(grid, cmap="RdYlGn", vmin=0.5, vmax=2.5)
            ax.set_xticks(range(len(args.gens)), [str(g) for g in args.gens])
            ax.set_yticks(
                range(len(args.pool_fractions)), [f"{f:g}" for f in args.pool_fractions]
            )
            ax.set_xlabel("output tokens G")
            if i == 0:
                ax.set_ylabel("pool / full KV")
            ax.set_title(f"{system} W={w}")
            for yi, line in enumerate(grid):
                for xi, v in enumerate(line):
                    if v == v:
                        ax.text(
                            xi, yi, f"{v:.2f}", ha="center", va="center", fontsize=9
                        )
        fig.colorbar(
            im,
            ax=axes[0].tolist(),
            shrink=0.8,
            label="tokens per scheduler CPU-s vs vanilla",
        )
        fig.savefig(
            os.path.join(args.out, f"grid_{system.replace(':', '_')}.png"),
            dpi=110,
            bbox_inches="tight",
        )
        plt.close(fig)


if __name__ == "__main__":
    main()
