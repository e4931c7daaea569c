"""Throughput under a memory-constrained KV pool: vanilla SGLang vs sgl_kara, side by side.

``--grid``: the workload grid of bench/throughput_grid.py (when Kara pays). Otherwise
one command runs, in one process and one run, vanilla ``sglang.Engine`` and sgl_kara with
``policy=kara``, ``policy=snapkv`` (threshold-triggered) and ``policy=none`` on the same
workload and the same KV pool size, and reports output tokens/s, the ratio to vanilla, mean and
peak running requests, retractions, compression events and the share of wall time spent
compressing. Per-step traces (running requests, free slots) come from the plugin's
``KARA_TRACE`` hook, which instruments vanilla and Kara schedulers alike.

    python -m bench.throughput                         # the default model on CPU, defaults below
    python -m bench.throughput --pool-fractions 1 0.5 0.25 0.125 --max-running 16 64
    python -m bench.throughput --model-path /models/R1-Llama-8B --requests 256 --gen 8192 ...

Writes a table (markdown, JSON), PNG plots and the run record (run.json: bench/record.py) under
--out (default bench/results/<today>-throughput/). The grid's tiny model (``--grid --model tiny``,
bench/throughput_grid.py ``tiny_model``) can be passed here with ``--model-path``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from bench.engine_run import RunResult, run_system
from bench.record import RunRecord

HERE = os.path.dirname(os.path.abspath(__file__))


def workload(args):
    prompts, params = [], []
    for i in range(args.requests):
        prompts.append(f"Problem {i}: let x{i} = {i % 10}. Think step by step.")
        params.append(
            {"max_new_tokens": args.gen, "temperature": 0.8, "ignore_eos": True, "n": 1}
        )
    # Some requests share their prompt (parallel samples): the same prompt repeated.
    for _ in range(args.shared):
        prompts.append("Shared problem: let y = 7. Think step by step.")
        params.append(
            {"max_new_tokens": args.gen, "temperature": 0.8, "ignore_eos": True, "n": 1}
        )
    return prompts, params


def system_options(system: str, args) -> dict:
    """sgl_kara.Engine ``kara_*`` options of a system of the single-workload comparison."""
    kara = {"kara_policy": system}
    if system == "kara":
        kara.update(
            kara_window=args.window,
            kara_buffer=args.buffer,
            kara_retention=args.retention,
            kara_chunk_budget=args.chunk_budget,
            kara_period=args.period,
            kara_max_seqs=args.max_seqs,
            kara_query_source=args.query_source,
        )
    elif system in (
        "snapkv",
        "streaming",
        "h2o",
        "rkv",
    ):  # threshold policies: the --snapkv-* budget
        prefix = f"kara_{system}_"
        kara.update(
            {
                prefix + "threshold": args.snapkv_threshold,
                prefix + "budget": args.snapkv_budget,
                prefix + "window": args.snapkv_window,
            }
        )
        if system != "streaming":
            kara["kara_query_source"] = args.query_source
    return kara


def footprint_limit(args, pool: int, system: str) -> float:
    """Concurrent requests the pool holds at the per-request footprint a system targets."""
    prompt = 16
    if system == "kara":
        m = args.window - args.buffer
        keep = -(-int(round(args.retention * m * 1e6)) // 1_000_000)
        per = prompt + args.gen * keep / m + args.window + args.period
    elif system == "snapkv":
        per = prompt + args.snapkv_threshold
    else:
        per = prompt + args.gen
    return pool / per


def main(argv=None):
    given = sys.argv[1:] if argv is None else argv
    if "--grid" in given:  # the workload grid: bench/throughput_grid.py
        from bench import throughput_grid

        return throughput_grid.main(given)
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model-path",
        default=None,
        help="default: the default model (SmolLM2-135M-Instruct)",
    )
    p.add_argument("--requests", type=int, default=40)
    p.add_argument(
        "--shared", type=int, default=8, help="extra requests sharing one prompt"
    )
    p.add_argument(
        "--gen", type=int, default=768, help="output tokens per request (ignore_eos)"
    )
    p.add_argument(
        "--pool-fractions",
        type=float,
        nargs="+",
        default=[0.125],
        help="KV pool size as a fraction of the workload's full-length KV",
    )
    p.add_argument("--max-running", type=int, nargs="+", default=[64])
    p.add_argument(
        "--systems",
        nargs="+",
        default=["vanilla", "kara", "snapkv", "none"],
        help="vanilla, none, kara, snapkv, streaming, h2o, rkv (threshold policies take --snapkv-*)",
    )
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--buffer", type=int, default=16)
    p.add_argument("--retention", type=float, default=0.25)
    p.add_argument("--chunk-budget", type=int, default=8)
    p.add_argument("--period", type=int, default=16)
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--query-source", default="capture")
    p.add_argument("--snapkv-threshold", type=int, default=256)
    p.add_argument("--snapkv-budget", type=int, default=192)
    p.add_argument("--snapkv-window", type=int, default=16)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per system; the order of systems rotates each repeat (interleaved)",
    )
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="scheduler on the last core alone, the other engine processes on the rest",
    )
    p.add_argument(
        "--omp-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS (+ OMP_WAIT_POLICY=PASSIVE) for the engines; 0 = leave as is",
    )
    p.add_argument(
        "--out",
        default=os.path.join(
            HERE, "results", f"{datetime.date.today().isoformat()}-throughput"
        ),
        help="output folder (default: bench/results/<today>-throughput)",
    )
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    record = RunRecord(args.out, argv)

    full_kv = (args.requests + args.shared) * (16 + args.gen)
    results: list[RunResult] = []
    combos = [(f, m) for f in args.pool_fractions for m in args.max_running]
    total = len(combos) * len(args.systems) * args.repeats
    done = 0
    for frac, max_running in combos:
        pool = int(full_kv * frac)
        for rep in range(args.repeats):
            k = rep % len(args.systems)
            for system in args.systems[k:] + args.systems[:k]:
                done += 1
                print(
                    f"[{done}/{total}] {system:8s} pool={pool} ({frac:g} of full KV) max_running={max_running} "
                    f"repeat {rep + 1} ...",
                    end="",
                    flush=True,
                )
                r = run_system(
                    system,
                    args,
                    pool,
                    max_running,
                    kara=None if system == "vanilla" else system_options(system, args),
                    prompts_params=workload(args),
                    repeat=rep,
                    record=record,
                )
                results.append(r)
                print(
                    f" {r.tps:8.1f} tok/s, mean running {r.mean_running:.1f}, {r.ms_per_step:.1f} ms/step, "
                    f"retractions {r.retractions}",
                    flush=True,
                )

    lines = [
        "| pool (tokens) | max running | system | output tok/s (median of runs) | runs | vs vanilla "
        "| mean / peak running | ms per step | limit at footprint | retractions | events | compress share "
        "| all lengths ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def median(xs):
        xs = sorted(xs)
        return (
            xs[len(xs) // 2]
            if len(xs) % 2
            else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2
        )

    for frac, max_running in combos:
        pool = int(full_kv * frac)
        group = [r for r in results if r.pool == pool and r.max_running == max_running]
        base_runs = [r.tps for r in group if r.system == "vanilla"]
        base = median(base_runs) if base_runs else None
        for system in args.systems:
            runs = [r for r in group if r.system == system]
            tps = median([r.tps for r in runs])
            ratio = f"{tps / base:.2f}x" if base else "-"
            spread = ", ".join(f"{r.tps:.0f}" for r in runs)
            lines.append(
                f"| {pool} | {max_running} | {system} | {tps:.1f} | {spread} | {ratio} "
                f"| {median([r.mean_running for r in runs]):.1f} / {max(r.peak_running for r in runs)} "
                f"| {median([r.ms_per_step for r in runs]):.1f} "
                f"| {footprint_limit(args, pool, system):.1f} | {sum(r.retractions for r in runs)} "
                f"| {sum(r.events for r in runs)} | {100 * median([r.compress_share for r in runs]):.1f}% "
                f"| {all(r.lengths_ok for r in runs)} |"
            )
    table = "\n".join(lines)
    print(table)
    record.write_md(os.path.join(args.out, "throughput.md"), table)
    with open(os.path.join(args.out, "throughput.json"), "w") as f:
        json.dump(
            [
                {
                    **{k: v for k, v in r.__dict__.items() if k != "trace"},
                    "tps": r.tps,
                    "steps": r.steps,
                    "ms_per_step": r.ms_per_step,
                }
                for r in results
            ],
            f,
            indent=1,
        )
    plot(results, args, full_kv)
    record.finish()


def plot(results, args, full_kv):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for system in args.systems:
        pts = sorted(
            (r.pool, r.tps)
            for r in results
            if r.system == system and r.max_running == args.max_running[0]
        )
        ax.plot([p for p, _ in pts], [t for _, t in pts], marker="o", label=system)
    ax.set_xlabel("KV pool (tokens)")
    ax.set_ylabel("output tokens/s")
    ax.set_xscale("log")
    ax.legend()
    ax.set_title("Throughput vs KV pool size")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "throughput_vs_pool.png"), dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    tight = min(r.pool for r in results)
    for r in results:
        if (
            r.pool == tight
            and r.max_running == args.max_running[0]
            and r.system in ("vanilla", "kara")
            and r.repeat == 0
        ):
            ax.plot([x["running"] for x in r.trace], label=r.system)
    ax.set_xlabel("decode step")
    ax.set_ylabel("running requests")
    ax.legend()
    ax.set_title(f"Running requests per decode step (pool {tight} tokens)")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "running_vs_step.png"), dpi=120)


if __name__ == "__main__":
    main()
