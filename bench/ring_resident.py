"""Resident memory of the capture ring in a serving run: the default-model server with a ring sized
for many more rows than requests run (``--max-running-requests 32``, a 4,172-token pool: the
SmolLM2 G = 1,024, pool 1/4 grid cell of bench/results/throughput.md, "Throughput: capture ring versus recompute"), once with ``capture`` and
once with ``recompute`` (no ring), the same requests through each. The ring's buffers are
allocated unwritten, so only the rows requests write become resident (scheduler/ring.py).

    python -m bench.ring_resident --out bench/results/2026-11-25-capture-ring/ring_resident.md

Reports each server's memory (RSS and PSS summed over its processes) idle and after the requests,
and the ring's allocated size from the server log; with --out, the table goes to that file and the
run record (bench/record.py) beside it (``ring_resident.run.json``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

from bench.record import RunRecord
from bench.serve_numbers import generate_concurrently, start, stop, tree_memory_mb

FLAGS = [
    "--max-total-tokens",
    "4172",
    "--max-running-requests",
    "32",
    "--kara-window",
    "64",
    "--kara-buffer",
    "8",
    "--kara-period",
    "16",
]


def serve(source: str, requests: int, tokens: int, log: str) -> dict:
    proc, url, _ = start(
        dict(os.environ),
        log,
        600,
        command=[
            sys.executable,
            "-m",
            "sgl_kara.launch_server",
            *FLAGS,
            "--kara-query-source",
            source,
        ],
    )
    try:
        idle = tree_memory_mb(proc.pid)
        outs = generate_concurrently(url, requests, tokens)
        after = tree_memory_mb(proc.pid)
    finally:
        stop(proc)
    text = open(log).read()
    ring = re.search(
        r"capture query ring allocated: (\d+) rows x (\d+) queries x (\d+) layers, ([\d.]+ \w+)",
        text,
    )
    return dict(
        source=source,
        idle=idle,
        after=after,
        compressions=sum(o["meta_info"]["kara"]["compressions"] for o in outs),
        ring=f"{ring.group(1)} rows x {ring.group(2)} x {ring.group(3)} layers, {ring.group(4)}"
        if ring
        else "-",
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    record = RunRecord.beside(args.out, argv) if args.out else None
    if record is not None:
        for source in ("capture", "recompute"):
            record.add_server(source, [*FLAGS, "--kara-query-source", source])
    tmp = tempfile.mkdtemp()
    rows = [
        serve(s, args.requests, args.tokens, os.path.join(tmp, f"{s}.log"))
        for s in ("capture", "recompute")
    ]
    lines = [
        f"{args.requests} concurrent requests x {args.tokens} tokens, flags: {' '.join(FLAGS)}",
        "",
        "| query source | ring allocated | windows compressed | RSS idle (MiB) | PSS idle | RSS after | PSS after |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['source']} | {r['ring']} | {r['compressions']} | {r['idle'][0]:.0f} | {r['idle'][1]:.0f} "
            f"| {r['after'][0]:.0f} | {r['after'][1]:.0f} |"
        )
    cap, rec = rows
    lines += [
        "",
        f"capture - recompute, after the requests: RSS {cap['after'][0] - rec['after'][0]:+.0f} MiB, "
        f"PSS {cap['after'][1] - rec['after'][1]:+.0f} MiB",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if record is not None:
        record.write_md(args.out, text)
        record.finish()


if __name__ == "__main__":
    main()
