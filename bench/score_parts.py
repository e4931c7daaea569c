"""What a part of a window's scoring costs on this machine: Kara's window scores (Eq. 4) of B
requests' regions over all layers, for a few queries, a part's worth and the whole window.

The spread scoring (``--kara-spread even``, sgl_kara/scheduler/spread.py) scores a window in parts
over the decode steps before it falls due; a part's cost is mostly reading the region's keys (per
layer, through the requests' slot indices), nearly the same for a few queries as for a chunk, so
parts come in chunks of at least ``spread.MIN_CHUNK`` queries. This measures that on the shapes of
the default server (SmolLM2-135M: 30 layers, 9 query / 3 KV heads, head 64; W 512, U 32: 480
region keys; 8 requests), with the kernel the server runs on this device.

    python -m bench.score_parts --out DIR [--requests 8] [--reps 5]

Writes score_parts.md / .json and the run record under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import torch

    from bench.record import RunRecord
    from sgl_kara.kernels.window_score import window_scores_paged
    from sgl_kara.scheduler.spread import MIN_CHUNK

    torch.set_num_threads(args.threads)
    record = RunRecord(args.out, argv)
    layers, hq, hkv, d, pool, region = 30, 9, 3, 64, 8192, 480
    record.note(
        layers=layers,
        q_heads=hq,
        kv_heads=hkv,
        head_dim=d,
        pool=pool,
        region=region,
        requests=args.requests,
        threads=args.threads,
        min_chunk=MIN_CHUNK,
    )
    gen = torch.Generator().manual_seed(0)
    k_buffers = [torch.randn(pool, hkv, d, generator=gen) for _ in range(layers)]
    slots = torch.stack(
        [
            torch.randperm(pool - 1, generator=gen)[:region] + 1
            for _ in range(args.requests)
        ]
    )
    rows = []
    for n in (4, MIN_CHUNK, 512):
        q = torch.randn(args.requests, n, hq, d, generator=gen)
        times = []
        for _ in range(args.reps + 1):
            tic = time.perf_counter()
            for k in k_buffers:
                window_scores_paged(q, k, slots)
            times.append(time.perf_counter() - tic)
        ms = 1e3 * statistics.median(times[1:])
        rows.append(
            {
                "queries": n,
                "ms_all_layers": round(ms, 1),
                "ms_per_query": round(ms / n, 2),
                "parts_per_window": -(-512 // n),
                "ms_per_window": round(ms * -(-512 // n), 0),
            }
        )
    with open(os.path.join(args.out, "score_parts.json"), "w") as f:
        json.dump(rows, f, indent=1)
    lines = [
        "| queries per part | ms per part (all layers, all requests) | ms per query | parts per window | ms per window |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['queries']} | {r['ms_all_layers']} | {r['ms_per_query']} | {r['parts_per_window']} | "
        f"{r['ms_per_window']:.0f} |"
        for r in rows
    ]
    record.write_md(os.path.join(args.out, "score_parts.md"), "\n".join(lines))
    record.finish()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
