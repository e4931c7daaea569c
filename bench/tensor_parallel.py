"""Tensor parallelism on this machine: plain SGLang and sgl_kara at ``--tp-size 1`` and ``2``.

One greedy workload (``--requests`` prompts, ``--gen`` tokens each, EOS ignored) through plain
``sglang.Engine`` (sgl_kara installed: its CPU start-up fixes, and its CPU kernels, as every
throughput comparison here runs it, so that only compression differs) and ``sgl_kara.Engine``
with Kara, each at TP 1 and TP 2, one engine at a time, no thread binding given (the CPU kit
splits the cores). Reported per run: start-up seconds, and over ``--repeats`` generations of the
workload on the same engine the median generation seconds and output tokens per second (and
each repeat's), the engine processes' CPU seconds,
and the KV a request holds per rank: its mean physical KV rows over its decode steps (what
attention reads; plain SGLang: prompt + half the output) times the bytes of one row on one rank
(2 x layers x KV heads / TP x head dim x itemsize); the pool's bytes per rank likewise. Also:
whether TP 2 produced TP 1's tokens, per system.

    python -m bench.tensor_parallel                    # the reasoning proxy, 8 x 384 tokens
    python -m bench.tensor_parallel --model-path M --requests 16 --gen 512 --tp 1 2 4

Writes results.md, results.json and the run record (run.json: bench/record.py) under --out
(default bench/results/<today>-tensor-parallel/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

from bench.engine_env import engine_env
from bench.engine_run import engine_cpu_seconds
from bench.record import RunRecord

PROMPT = "Problem {i}: let x = {x}, y = x + {y}. Think step by step about z = x * y."


def kara_options(args) -> dict:
    return dict(
        kara_policy="kara",
        kara_window=args.window,
        kara_buffer=args.buffer,
        kara_period=args.period,
        kara_retention=args.retention,
    )


def run_one(system: str, tp: int, args, record: RunRecord) -> dict:
    """One engine (``sglang`` or ``kara``) at ``tp`` ranks over the workload."""
    import sglang

    import sgl_kara
    from sgl_kara.cpu.server import cpu_defaults
    from sgl_kara.engine import shutdown_cleanly
    from sgl_kara.model_shape import ModelShape

    prompts = [PROMPT.format(i=i, x=i % 10, y=i % 7 + 1) for i in range(args.requests)]
    params = {"max_new_tokens": args.gen, "temperature": 0.0, "ignore_eos": True}
    common = dict(
        model_path=args.model_path,
        tp_size=tp,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.requests,
        log_level="error",
        random_seed=0,
    )
    kernels = {"KARA_CPU_KERNELS": "1"} if system == "sglang" else {}
    tic = time.perf_counter()
    with engine_env(0, **kernels):
        if system == "sglang":
            engine = sglang.Engine(**cpu_defaults(), **common)
        else:
            engine = sgl_kara.Engine(**common, **kara_options(args))
    started = time.perf_counter() - tic
    record.add_engine(f"{system} tp{tp}", engine)
    try:
        engine.generate(prompts[:2], {"max_new_tokens": 4})  # warm up
        times, cpus = [], []
        for _ in range(args.repeats):
            engine.flush_cache()  # each repeat prefills its prompts again
            cpu0, _ = engine_cpu_seconds()
            tic = time.perf_counter()
            outs = engine.generate(prompts, params)
            times.append(time.perf_counter() - tic)
            cpus.append(engine_cpu_seconds()[0] - cpu0)
        stats = (engine.get_server_info()["internal_states"][0] or {}).get("kara")
    finally:
        shutdown_cleanly(engine)
    shape = ModelShape.from_model_path(args.model_path).per_rank(tp)
    row_bytes = shape.kv_bytes_per_token(shape.itemsize("float32"))
    mean_rows, peak_rows = [], []
    for o in outs:
        meta = o["meta_info"]
        kara = meta.get("kara") or {}
        mean_rows.append(
            kara.get("kv_mean_len")
            or meta["prompt_tokens"] + meta["completion_tokens"] / 2
        )
        peak_rows.append(
            kara.get("kv_peak_len") or meta["prompt_tokens"] + meta["completion_tokens"]
        )
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    seconds = sorted(times)[len(times) // 2]
    return {
        "system": system,
        "tp": tp,
        "start_seconds": round(started, 1),
        "seconds": round(seconds, 2),
        "seconds_each": [round(t, 2) for t in times],
        "output_tokens": tokens,
        "tokens_per_second": round(tokens / seconds, 1),
        "cpu_seconds": round(sorted(cpus)[len(cpus) // 2], 1),
        "kv_rows_mean": round(sum(mean_rows) / len(mean_rows), 1),
        "kv_rows_peak": max(peak_rows),
        "kv_bytes_per_row_per_rank": row_bytes,
        "kv_kib_per_request_per_rank": round(
            sum(mean_rows) / len(mean_rows) * row_bytes / 1024, 1
        ),
        "pool_mib_per_rank": round(args.max_total_tokens * row_bytes / (1 << 20), 1),
        "events": (stats or {}).get("events", 0),
        "output_ids": [o["output_ids"] for o in outs],
    }


def table(runs: list[dict]) -> str:
    by = {(r["system"], r["tp"]): r for r in runs}
    lines = [
        "| system | TP | start s | generate s (median; each) | output tok/s | CPU s | KV rows per request (mean / peak) | KV per request per rank (KiB) | pool per rank (MiB) | events | tokens = TP 1's |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        one = by.get((r["system"], 1))
        same = (
            "-"
            if one is None or r["tp"] == 1
            else f"{sum(a == b for a, b in zip(r['output_ids'], one['output_ids']))}/{len(r['output_ids'])}"
        )
        lines.append(
            f"| {r['system']} | {r['tp']} | {r['start_seconds']} | {r['seconds']}; "
            f"{', '.join(map(str, r['seconds_each']))} | "
            f"{r['tokens_per_second']} | {r['cpu_seconds']} | {r['kv_rows_mean']} / "
            f"{r['kv_rows_peak']} | {r['kv_kib_per_request_per_rank']} | "
            f"{r['pool_mib_per_rank']} | {r['events']} | {same} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from bench.models.proxy import PROXY_MODEL_DIR

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model-path", default=str(PROXY_MODEL_DIR))
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--gen", type=int, default=384)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--systems", nargs="+", default=["sglang", "kara"])
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--buffer", type=int, default=8)
    p.add_argument("--period", type=int, default=16)
    p.add_argument("--retention", type=float, default=0.25)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"{datetime.date.today().isoformat()}-tensor-parallel",
    )
    record = RunRecord(out, argv if argv is not None else sys.argv[1:])
    runs = []
    for system in args.systems:
        for tp in args.tp:
            runs.append(run_one(system, tp, args, record))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "output_ids"}))
    text = table(runs)
    record.write_md(os.path.join(out, "results.md"), text)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(
            [{k: v for k, v in r.items() if k != "output_ids"} for r in runs],
            f,
            indent=1,
        )
    record.finish()
    print(text)


if __name__ == "__main__":
    main()
