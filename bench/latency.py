"""Throughput and inter-token latency of plain SGLang and sgl_kara servers on the same requests.

Each system is a launched server given the same streamed requests, all sent at once (they decode
in step and, under ``--kara-phase request``, fall due for compression together: the worst case
for stalls); the client timestamps every streamed chunk:

    ITL          per request, the seconds between consecutive output tokens (a k-token chunk
                 counts its gap once per token, divided by k); p50 / p99 over all tokens, and
                 the longest gap: a step stalled by an event shows as one long gap
    throughput   output tokens / wall seconds from the first request sent to the last finished
    TTFT         median seconds to the first token

Systems (``--systems``; the same model, KV pool, request limit and CPU kernels on every side):

    sglang        ``python -m sglang.launch_server`` with the settings sgl_kara's launcher
                  resolves to and KARA_CPU_KERNELS=1, so that only compression differs
    sglang-nooverlap   the same with --disable-overlap-schedule
    kara-before   --disable-overlap-schedule --kara-spread off --kara-query-source recompute
                  (sgl_kara before overlap support: each event whole, its window recomputed)
    kara          sgl_kara at its defaults; kara-recompute: --kara-query-source recompute
    kara-nospread --kara-spread off; kara-capN: --kara-spread-max N
    POLICY        --kara-policy POLICY (snapkv, h2o, streaming, rkv, random); a threshold
                  baseline keeps Kara's kept KV (budget U + r (W - U)) and triggers one window
                  later (threshold budget + W - U): Kara's compression rhythm

Workloads (``--workload``):

    free    the default server's settings (W 512, U 32, delta 128), 8 requests x 700 tokens, a
            pool that holds them uncompressed; one event per request, at its 640th token
    bound   memory-fair: pool = 1/4 of the requests' full KV, W 64, U 8, delta 16, 33 requests
            x 512 tokens

    python -m bench.latency --out DIR [--workload free|bound] [--model default|tiny] [--reps 2]

Runs alternate between systems (``--reps`` rounds). Writes latency.json, latency.md and the run
record (run.json) under --out. Run it with nothing else on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import requests

from bench.serve_numbers import start, stop

BASELINES = ("snapkv", "h2o", "streaming", "rkv", "random")
THRESHOLD = ("snapkv", "h2o", "streaming", "rkv")
PROMPT = "Write a long story about a robot named Unit {i} who learns to paint."
WORKLOADS = {
    "free": dict(requests=8, tokens=700, kara=[], pool=None),
    "bound": dict(
        requests=33,
        tokens=512,
        kara=["--kara-window", "64", "--kara-buffer", "8", "--kara-period", "16"],
        pool="quarter",
    ),
}


def stream(url: str, text: str, n: int, out: dict) -> None:
    """POST /generate streamed; ``out``: send time, [(arrival, completion tokens)], meta_info."""
    body = {
        "text": text,
        "stream": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    out["sent"] = time.perf_counter()
    chunks = []
    meta = None
    with requests.post(url + "/generate", json=body, stream=True, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            data = json.loads(line[5:])
            meta = data["meta_info"]
            chunks.append((time.perf_counter(), int(meta["completion_tokens"])))
    out["chunks"], out["meta"] = chunks, meta


def summarize(outs: list[dict]) -> dict:
    gaps, ttft = [], []
    for o in outs:
        chunks = o["chunks"]
        ttft.append(chunks[0][0] - o["sent"])
        for (t0, n0), (t1, n1) in zip(chunks, chunks[1:]):
            if n1 > n0:
                gaps += [(t1 - t0) / (n1 - n0)] * (n1 - n0)
    gaps.sort()
    first = min(o["sent"] for o in outs)
    last = max(o["chunks"][-1][0] for o in outs)
    tokens = sum(o["chunks"][-1][1] for o in outs)
    kara = [o["meta"].get("kara") for o in outs if o["meta"].get("kara")]
    return {
        "tokens": tokens,
        "seconds": round(last - first, 2),
        "tok_s": round(tokens / (last - first), 2),
        "ttft_p50_s": round(statistics.median(ttft), 3),
        "itl_p50_ms": round(1e3 * gaps[len(gaps) // 2], 1),
        "itl_p99_ms": round(1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 1),
        "itl_max_ms": round(1e3 * gaps[-1], 1),
        "compressions": sum(k["compressions"] for k in kara) if kara else 0,
        "kv_mean": round(statistics.mean(k["kv_mean_len"] for k in kara), 1)
        if kara
        else None,
    }


def run_load(url: str, requests_: int, tokens: int) -> dict:
    outs = [{} for _ in range(requests_)]
    threads = [
        threading.Thread(target=stream, args=(url, PROMPT.format(i=i), tokens, outs[i]))
        for i in range(requests_)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any("chunks" not in o or not o["chunks"] for o in outs):
        raise RuntimeError("a request got no output")
    return summarize(outs)


def sglang_command(resolved, pool: int) -> list[str]:
    """Plain SGLang's server at sgl_kara's resolved settings (model, device, backend, dtype,
    pages, request limit) on a pool of ``pool`` tokens."""
    flags = {
        "--model-path": resolved.model_path,
        "--device": resolved.device,
        "--attention-backend": resolved.attention_backend,
        "--dtype": resolved.dtype,
        "--page-size": resolved.page_size,
        "--max-total-tokens": pool,
        "--max-running-requests": resolved.max_running_requests,
    }
    args = [s for flag, value in flags.items() for s in (flag, str(value))]
    return [sys.executable, "-m", "sglang.launch_server", *args]


def commands(
    system: str, model_argv: list[str], workload: dict, resolved
) -> tuple[list[str], dict]:
    """(command, extra environment) of a system's server."""
    py = sys.executable
    if system.startswith("sglang"):
        cmd = sglang_command(resolved, resolved.max_total_tokens)
        if system == "sglang-nooverlap":
            cmd.append("--disable-overlap-schedule")
        return cmd, {"KARA_CPU_KERNELS": "1"}
    # W, U, delta are Kara's options
    kara_flags = [] if system in BASELINES else workload["kara"]
    cmd = [py, "-m", "sgl_kara.launch_server", *model_argv, *kara_flags]
    cmd += ["--max-total-tokens", str(resolved.max_total_tokens)]
    cmd += ["--max-running-requests", str(resolved.max_running_requests)]
    if system == "kara-before":
        cmd += (
            "--disable-overlap-schedule --kara-spread off --kara-query-source recompute"
        ).split()
    elif system == "kara-nospread":
        cmd += ["--kara-spread", "off"]
    elif system == "kara-recompute":
        cmd += ["--kara-query-source", "recompute"]
    elif system.startswith("kara-cap"):
        cmd += ["--kara-spread-max", system[len("kara-cap") :]]
    elif system in BASELINES:
        cmd += ["--kara-policy", system]
        if system in THRESHOLD:
            flags = dict(zip(workload["kara"][::2], workload["kara"][1::2]))
            window = int(flags.get("--kara-window", 512))
            buffer = int(flags.get("--kara-buffer", 32))
            budget = buffer + round(0.25 * (window - buffer))
            cmd += [f"--kara-{system}-budget", str(budget)]
            cmd += [f"--kara-{system}-threshold", str(budget + window - buffer)]
    elif system != "kara":
        raise ValueError(f"unknown system {system!r}")
    return cmd, {}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    arg = ap.add_argument
    arg("--out", required=True)
    arg("--workload", choices=sorted(WORKLOADS), default="free")
    arg("--model", choices=("default", "tiny"), default="default")
    arg("--systems", default="sglang,sglang-nooverlap,kara-before,kara,kara-recompute")
    arg("--reps", type=int, default=2)
    arg("--requests", type=int, default=None)
    arg("--tokens", type=int, default=None)
    args = ap.parse_args(argv)
    from bench.record import RunRecord
    from sgl_kara.launch_server import parse

    workload = dict(WORKLOADS[args.workload])
    workload["requests"] = args.requests or workload["requests"]
    workload["tokens"] = args.tokens or workload["tokens"]
    model_argv = []
    if args.model == "tiny":
        from bench.models.tiny import write_tiny_model

        model_argv = [
            "--model-path",
            str(
                write_tiny_model(os.path.join(args.out, "tiny_llama"), "llama", seed=1)
            ),
        ]
        if args.workload == "free":
            workload["kara"] = (
                "--kara-window 128 --kara-buffer 16 --kara-period 32"
            ).split()
    probe = model_argv + workload["kara"]
    if workload["pool"] == "quarter":
        # prompt (~20 tokens) + answer per request, all requests: a quarter of it
        full = workload["requests"] * (workload["tokens"] + 32)
        probe += ["--max-total-tokens", str(full // 4)]
        probe += ["--max-running-requests", str(workload["requests"])]
    _, resolved = parse(list(probe))
    record = RunRecord(args.out, argv)
    record.note(
        workload=args.workload,
        requests=workload["requests"],
        tokens=workload["tokens"],
        model=args.model,
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    systems = args.systems.split(",")
    results: dict = {s: [] for s in systems}
    for rep in range(args.reps):
        for system in systems:
            cmd, extra = commands(system, model_argv, workload, resolved)
            if not system.startswith("sglang"):
                record.add_server(system, cmd[3:])
            else:
                record.add_config(
                    system, {"kara": {"policy": "none"}, "argv": cmd[1:], "env": extra}
                )
            proc, url, _ = start(
                {**env, **extra},
                os.path.join(args.out, f"{system}-{rep}.log"),
                900,
                cmd,
            )
            try:
                run_load(url, 2, 16)  # warm-up: first forwards, allocator
                res = run_load(url, workload["requests"], workload["tokens"])
                internal = requests.get(url + "/server_info", timeout=30).json()[
                    "internal_states"
                ][0]
                # None: SGLang's own code
                res["cpu_kernels"] = internal.get("kara_cpu_kernels")
                if not system.startswith("sglang"):
                    state = internal["kara"]
                    res.update(
                        events=state["events"],
                        event_max_ms=round(1e3 * state["event_max_seconds"], 1),
                        spread_queries=state["spread_queries"],
                        compression_s=round(state["compression_seconds"], 2),
                    )
            finally:
                stop(proc)
            results[system].append(res)
            print(system, rep, res, flush=True)
    with open(os.path.join(args.out, "latency.json"), "w") as f:
        json.dump(results, f, indent=1)
    keys = (
        "tok_s itl_p50_ms itl_p99_ms itl_max_ms ttft_p50_s kv_mean events event_max_ms"
    ).split()
    lines = [
        "| system | rep | " + " | ".join(keys) + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for system, runs in results.items():
        for rep, res in enumerate(runs):
            lines.append(
                f"| {system} | {rep} | "
                + " | ".join(str(res.get(k, "-")) for k in keys)
                + " |"
            )
    record.write_md(os.path.join(args.out, "latency.md"), "\n".join(lines))
    record.finish()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
