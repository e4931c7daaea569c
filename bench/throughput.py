"""Throughput under a memory-constrained KV pool: vanilla SGLang vs sgl_kara, side by side.

``--grid``: the workload grid of bench/throughput_grid.py (when Kara pays). Otherwise
one command runs, in one process and one run, vanilla ``sglang.Engine`` and sgl_kara with
``policy=kara``, ``policy=snapkv`` (threshold-triggered) and ``policy=none`` on the same
workload and the same KV pool size, and reports output tokens/s, the ratio to vanilla, mean and
peak running requests, retractions, compression events and the share of wall time spent
compressing. Per-step traces (running requests, free slots) come from the plugin's
``KARA_TRACE`` hook, which instruments vanilla and Kara schedulers alike.

    python bench/throughput.py                         # embedded model on CPU, defaults below
    python bench/throughput.py --pool-fractions 1 0.5 0.25 0.125 --max-running 16 64
    python bench/throughput.py --model-path /models/R1-Llama-8B --requests 256 --gen 8192 ...

Writes a table (markdown) and PNG plots under --out (default bench/results/<today>-throughput/).

The tight-pool runs of 2026-11-22 (bench/RESULTS.md, History) used the then-embedded random-weight 4-layer
Llama (hidden 128); the embedded default is now the trained proxy (3.5M parameters). That model is
re-created bit for bit by ``sgl_kara.models.tiny.write_tiny_model(path, "llama", hidden_size=128,
num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=256, vocab_size=512, seed=2026)``;
pass it with ``--model-path`` to reproduce those numbers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from engine_env import engine_env, stamp  # noqa: E402  (bench/engine_env.py)


@dataclass
class RunResult:
    system: str
    pool: int
    max_running: int
    seconds: float
    output_tokens: int
    lengths_ok: bool
    retractions: int
    mean_running: float
    peak_running: int
    events: int
    compress_seconds: float
    trace: list
    repeat: int = 0
    cpu_seconds: float = 0.0  # engine processes' CPU time during the run
    scheduler_cpu_seconds: float = 0.0  # of which the scheduler's (the model's compute)
    ring_bytes: int = 0  # capture query ring (memory beyond the KV pool; 0 with recompute)
    fallbacks: int = 0  # windows scored by recompute although capture was on (no ring row)
    mean_kv: float = 0.0  # KV rows a request held per decode step, mean over requests (what attention reads)
    skipped: int = 0  # due requests an event could not compact (no fresh slots), mostly skipped unscored

    @property
    def tps_cpu(self) -> float:
        """Output tokens per engine CPU-second (less sensitive to other load than wall time)."""
        return self.output_tokens / self.cpu_seconds if self.cpu_seconds else 0.0

    @property
    def tps_scheduler_cpu(self) -> float:
        return self.output_tokens / self.scheduler_cpu_seconds if self.scheduler_cpu_seconds else 0.0

    @property
    def steps(self) -> int:
        """Scheduler iterations that had requests running (decode steps, prefills folded in)."""
        return sum(1 for r in self.trace if r["running"] > 0)

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.seconds / max(1, self.steps)

    @property
    def tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def compress_share(self) -> float:
        return self.compress_seconds / self.seconds if self.seconds else 0.0


def workload(args):
    prompts, params = [], []
    for i in range(args.requests):
        prompts.append(f"Problem {i}: let x{i} = {i % 10}. Think step by step.")
        params.append({"max_new_tokens": args.gen, "temperature": 0.8, "ignore_eos": True, "n": 1})
    # Some requests share their prompt (parallel samples): the same prompt repeated.
    for i in range(args.shared):
        prompts.append("Shared problem: let y = 7. Think step by step.")
        params.append({"max_new_tokens": args.gen, "temperature": 0.8, "ignore_eos": True, "n": 1})
    return prompts, params


def system_options(system: str, args) -> dict:
    """sgl_kara.Engine ``kara_*`` options of a system of the single-workload comparison."""
    kara = {"kara_policy": system}
    if system == "kara":
        kara.update(kara_window=args.window, kara_buffer=args.buffer, kara_retention=args.retention,
                    kara_chunk_budget=args.chunk_budget, kara_period=args.period,
                    kara_max_seqs=args.max_seqs, kara_query_source=args.query_source)
    elif system in ("snapkv", "streaming", "h2o", "rkv"):  # threshold policies: the --snapkv-* budget
        prefix = f"kara_{system}_"
        kara.update({prefix + "threshold": args.snapkv_threshold, prefix + "budget": args.snapkv_budget,
                     prefix + "window": args.snapkv_window})
        if system != "streaming":
            kara["kara_query_source"] = args.query_source
    return kara


def engine_cpu_seconds() -> tuple[float, float]:
    """(CPU seconds used so far by this process and its children -- the engine's scheduler and
    detokenizer; its tokenizer manager runs in this process --, of which by the scheduler)."""
    import psutil

    me = psutil.Process()
    total, scheduler = sum(me.cpu_times()[:2]), 0.0
    for child in me.children(recursive=True):
        try:
            t = sum(child.cpu_times()[:2])
            total += t
            if "scheduler" in " ".join(child.cmdline()):
                scheduler += t
        except psutil.Error:
            pass
    return total, scheduler


def pin_scheduler() -> tuple[set[int], list] | None:
    """Give the engine's scheduler (the process that runs the model) the last core to itself and
    every other engine process (this one: tokenizer manager; the detokenizer) the others, so the
    processes do not trade cores mid-run. Returns what to restore, or None on a 1-core machine."""
    import psutil

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    me = psutil.Process()
    saved = set(cores)
    for child in me.children(recursive=True):
        try:
            child.cpu_affinity([cores[-1]] if "scheduler" in " ".join(child.cmdline()) else cores[:-1])
        except psutil.Error:
            pass
    me.cpu_affinity(cores[:-1])
    return saved, cores


def unpin(pinned) -> None:
    if pinned is not None:
        os.sched_setaffinity(0, pinned[0])


def run_system(system: str, args, pool: int, max_running: int, repeat: int = 0, kara: dict | None = None,
               prompts_params=None, label: str | None = None) -> RunResult:
    """One engine, one workload. ``kara``: the system's sgl_kara options (default: from args);
    ``prompts_params``: (prompts, sampling params), default ``workload(args)``."""
    import sglang

    import sgl_kara
    from sgl_kara.engine import shutdown_cleanly
    from sgl_kara.support import cpu_defaults

    trace_path = tempfile.mktemp(prefix=f"trace_{system}_", suffix=".jsonl")
    common = dict(
        max_total_tokens=pool, max_running_requests=max_running, disable_overlap_schedule=True,
        log_level="error", random_seed=0, disable_radix_cache=False,
    )
    if args.model_path:
        common["model_path"] = args.model_path
    with engine_env(args.omp_threads, KARA_TRACE=trace_path):
        if system == "vanilla":
            from sgl_kara.models.default import default_model_path

            engine = sglang.Engine(**{"model_path": default_model_path(), **cpu_defaults(), **common})
        else:
            engine = sgl_kara.Engine(**common, **(kara if kara is not None else system_options(system, args)))
    pinned = pin_scheduler() if getattr(args, "pin", False) else None
    try:
        prompts, params = prompts_params or workload(args)
        engine.generate(prompts[:2], {"max_new_tokens": 4})  # warm up
        with open(trace_path, "w"):
            pass
        cpu0, sched0 = engine_cpu_seconds()
        tic = time.perf_counter()
        outs = engine.generate(prompts, params)
        seconds = time.perf_counter() - tic
        cpu1, sched1 = engine_cpu_seconds()
    finally:
        shutdown_cleanly(engine)  # vanilla sglang.Engine too
        unpin(pinned)
    trace = [json.loads(line) for line in open(trace_path)]
    os.unlink(trace_path)
    running = [r["running"] for r in trace if r["running"] > 0]
    comp = [o["meta_info"]["completion_tokens"] for o in outs]
    kv = [o["meta_info"]["kara"]["kv_mean_len"] for o in outs if (o["meta_info"].get("kara") or {}).get("kv_mean_len")]
    if not kv:  # vanilla: every row grows by one per step, prompt + half the output on average
        kv = [o["meta_info"]["prompt_tokens"] + o["meta_info"]["completion_tokens"] / 2 for o in outs]
    want = [p["max_new_tokens"] for p in params]
    return RunResult(
        system=label or system, pool=pool, max_running=max_running, seconds=seconds,
        output_tokens=sum(comp), lengths_ok=comp == want,
        retractions=sum(o["meta_info"].get("num_retractions", 0) or 0 for o in outs),
        mean_running=sum(running) / max(1, len(running)), peak_running=max(running, default=0),
        events=trace[-1]["kara_events"] if trace else 0,
        compress_seconds=(trace[-1]["kara_seconds"] - trace[0]["kara_seconds"]) if trace else 0.0,
        trace=trace, repeat=repeat, cpu_seconds=cpu1 - cpu0, scheduler_cpu_seconds=sched1 - sched0,
        ring_bytes=trace[-1].get("kara_ring_bytes", 0) if trace else 0,
        fallbacks=(trace[-1].get("kara_recompute_fallbacks", 0) - trace[0].get("kara_recompute_fallbacks", 0))
        if trace else 0,
        mean_kv=sum(kv) / len(kv),
        skipped=(trace[-1].get("kara_skipped_no_memory", 0) - trace[0].get("kara_skipped_no_memory", 0)) if trace else 0,
    )


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
        import throughput_grid

        return throughput_grid.main(given)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded model")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--shared", type=int, default=8, help="extra requests sharing one prompt")
    p.add_argument("--gen", type=int, default=768, help="output tokens per request (ignore_eos)")
    p.add_argument("--pool-fractions", type=float, nargs="+", default=[0.125],
                   help="KV pool size as a fraction of the workload's full-length KV")
    p.add_argument("--max-running", type=int, nargs="+", default=[64])
    p.add_argument("--systems", nargs="+", default=["vanilla", "kara", "snapkv", "none"],
                   help="vanilla, none, kara, snapkv, streaming, h2o, rkv (threshold policies take --snapkv-*)")
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
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per system; the order of systems rotates each repeat (interleaved)")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                   help="scheduler on the last core alone, the other engine processes on the rest")
    p.add_argument("--omp-threads", type=int, default=1,
                   help="OMP_NUM_THREADS (+ OMP_WAIT_POLICY=PASSIVE) for the engines; 0 = leave as is")
    p.add_argument("--out", default=os.path.join(HERE, "results", f"{datetime.date.today().isoformat()}-throughput"),
                   help="output folder (default: bench/results/<today>-throughput)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

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
                print(f"[{done}/{total}] {system:8s} pool={pool} ({frac:g} of full KV) max_running={max_running} "
                      f"repeat {rep + 1} ...", end="", flush=True)
                r = run_system(system, args, pool, max_running, rep)
                results.append(r)
                print(f" {r.tps:8.1f} tok/s, mean running {r.mean_running:.1f}, {r.ms_per_step:.1f} ms/step, "
                      f"retractions {r.retractions}", flush=True)

    lines = [
        "| pool (tokens) | max running | system | output tok/s (median of runs) | runs | vs vanilla "
        "| mean / peak running | ms per step | limit at footprint | retractions | events | compress share "
        "| all lengths ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2

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
    with open(os.path.join(args.out, "throughput.md"), "w") as f:
        f.write(f"command: python bench/throughput.py {' '.join(argv if argv is not None else sys.argv[1:])}\n{stamp()}\n\n")
        f.write(table + "\n")
    with open(os.path.join(args.out, "throughput.json"), "w") as f:
        json.dump([{**{k: v for k, v in r.__dict__.items() if k != "trace"}, "tps": r.tps, "steps": r.steps,
                    "ms_per_step": r.ms_per_step} for r in results], f, indent=1)
    plot(results, args, full_kv)


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
        pts = sorted((r.pool, r.tps) for r in results if r.system == system and r.max_running == args.max_running[0])
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
        if r.pool == tight and r.max_running == args.max_running[0] and r.system in ("vanilla", "kara") and r.repeat == 0:
            ax.plot([x["running"] for x in r.trace], label=r.system)
    ax.set_xlabel("decode step")
    ax.set_ylabel("running requests")
    ax.legend()
    ax.set_title(f"Running requests per decode step (pool {tight} tokens)")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "running_vs_step.png"), dpi=120)


if __name__ == "__main__":
    main()
