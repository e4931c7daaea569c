"""The README's numbers for the default server: start-up, memory, decode speed, a compressed answer.

Starts the server exactly as the README's first command does (``python -m sgl_kara.launch_server
--port P``, no other flag), then measures

    conversion       first start with an empty model cache (--fresh-cache: KARA_CACHE in a
                     temporary directory, so the GGUF is converted again)
    start-up         launch -> /health answers 200, with the model already converted (--vanilla:
                     also plain ``python -m sglang.launch_server`` with the same resolved settings)
    memory           RSS summed over the server's processes, and PSS (shared pages counted once
                     across processes, from /proc/PID/smaps_rollup), after the requests below
    decode           one request alone, then 8 at once: completion tokens / wall seconds
                     (``ignore_eos``, 256 new tokens, the prompt's prefill included)
    compression      one 700-token answer: meta_info.kara (compressions, physical vs logical KV)

    python -m bench.serve_numbers --out DIR [--fresh-cache] [--vanilla]

Writes serve_numbers.json, serve_numbers.md and the run record (run.json, bench/record.py: the
settings the launcher resolves to) under --out. Timings are this machine's, at that moment: run
it with nothing else on the CPU for the README's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import requests

from bench.server_start import start_on_a_port


def tree_memory_mb(pid: int) -> tuple[float, float]:
    """(RSS summed over the process tree, PSS summed) in MiB."""
    import psutil

    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    rss = pss = 0
    for p in procs:
        try:
            rss += p.memory_info().rss
            with open(f"/proc/{p.pid}/smaps_rollup") as f:
                pss += next(
                    int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:")
                )
        except (OSError, psutil.Error, StopIteration):
            pass
    return rss / 2**20, pss / 2**20


def start(
    env: dict, log_path: str, timeout: float, command=None
) -> tuple[subprocess.Popen, str, float]:
    """Launch ``command`` (the README's first command by default) on a free port, and wait until
    it serves: (process, url, seconds to ready). A port another process took before the server
    bound it is given up for a new one (three tries)."""
    command = command or [sys.executable, "-m", "sgl_kara.launch_server"]

    def launch(port):
        with open(log_path, "w") as log:  # the server keeps its own descriptor
            proc = subprocess.Popen(
                [*command, "--port", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        return proc, log_path

    port, proc, seconds = start_on_a_port(launch, stop, timeout)
    return proc, f"http://127.0.0.1:{port}", seconds


def stop(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def generate(url: str, text: str, n: int) -> dict:
    r = requests.post(
        url + "/generate",
        json={
            "text": text,
            "sampling_params": {
                "max_new_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
            },
        },
        timeout=1800,
    )
    r.raise_for_status()
    return r.json()


def generate_concurrently(url: str, concurrent: int, n: int) -> list[dict]:
    """``concurrent`` different story prompts of ``n`` tokens each, sent at once; their outputs."""
    outs: list[dict] = []
    prompts = [
        f"Write a long story about a robot named Unit {i} who learns to paint."
        for i in range(concurrent)
    ]
    threads = [
        threading.Thread(target=lambda p=p: outs.append(generate(url, p, n)))
        for p in prompts
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outs) == concurrent
    return outs


def decode_rate(url: str, concurrent: int, n: int) -> float:
    tic = time.time()
    outs = generate_concurrently(url, concurrent, n)
    return sum(o["meta_info"]["completion_tokens"] for o in outs) / (time.time() - tic)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    arg = ap.add_argument
    arg("--out", required=True)
    arg("--fresh-cache", action="store_true", help="also time the first conversion")
    arg("--new-tokens", type=int, default=256)
    h = "also time plain `python -m sglang.launch_server`"
    arg("--vanilla", action="store_true", help=h)
    args = ap.parse_args(argv)
    from bench.record import RunRecord

    record = RunRecord(args.out, argv)
    record.add_server("sgl_kara (README's first command)", [])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res: dict = {
        "date": record.data["date"][:10],
        "machine": record.data["machine"]["text"],
        "python": sys.version.split()[0],
    }
    if args.fresh_cache:
        with tempfile.TemporaryDirectory(prefix="sgl_kara_cache_") as cache:
            proc, _, secs = start(
                {**env, "KARA_CACHE": cache},
                os.path.join(args.out, "first_start.log"),
                900,
            )
            stop(proc)
            res["first_start_s"] = round(secs, 1)
            marker = next(iter(os.scandir(cache)), None)
            done = marker and os.path.join(marker.path, "sgl_kara_conversion.json")
            if done and os.path.exists(done):
                res["conversion_s"] = json.load(open(done))["seconds"]
    # plain SGLang with the settings sgl_kara's launcher resolves to, for comparison
    if args.vanilla:
        from sgl_kara.launch_server import parse

        _, sa = parse([])
        command = [
            *(sys.executable, "-m", "sglang.launch_server"),
            *("--model-path", sa.model_path),
            *("--device", "cpu", "--attention-backend", "torch_native"),
            *("--dtype", "float32", "--page-size", "1"),
            *("--max-total-tokens", str(sa.max_total_tokens)),
            *("--max-running-requests", str(sa.max_running_requests)),
        ]
        record.add_config(
            "vanilla sglang", {"kara": {"policy": "none"}, "argv": command[1:]}
        )
        proc, _, secs = start(env, os.path.join(args.out, "vanilla.log"), 600, command)
        res["vanilla_sglang_startup_s"] = round(secs, 1)
        res["vanilla_sglang_pss_idle_mb"] = round(tree_memory_mb(proc.pid)[1])
        stop(proc)
    proc, url, secs = start(env, os.path.join(args.out, "server.log"), 600)
    try:
        res["startup_s"] = round(secs, 1)
        res["rss_idle_mb"], res["pss_idle_mb"] = map(round, tree_memory_mb(proc.pid))
        res["decode_1_tok_s"] = round(decode_rate(url, 1, args.new_tokens), 1)
        res["decode_8_tok_s"] = round(decode_rate(url, 8, args.new_tokens), 1)
        out = generate(
            url, "Write a long story about a dragon who learns to cook.", 700
        )
        res["long_answer_kara"] = out["meta_info"]["kara"]
        res["rss_after_mb"], res["pss_after_mb"] = map(round, tree_memory_mb(proc.pid))
        res["alive"] = proc.poll() is None
    finally:
        stop(proc)
    with open(os.path.join(args.out, "serve_numbers.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = ["| measure | value |", "|---|---|"] + [
        f"| {k} | {v} |" for k, v in res.items()
    ]
    record.write_md(os.path.join(args.out, "serve_numbers.md"), "\n".join(lines))
    record.finish()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
