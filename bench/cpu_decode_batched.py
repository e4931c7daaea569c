"""CPU decode attention: the per-request SDPA loop (sgl_kara/cpu_attention.py, as SGLang's
torch_native backend) against one padded SDPA call for the whole batch, in isolation. The runtime
runs the loop by default and the padded call with ``SGL_KARA_BATCHED_CPU_DECODE=1``
(bench/RESULTS.md, session 9).

    python bench/cpu_decode_batched.py                      # the shapes of RESULTS.md
    python bench/cpu_decode_batched.py --shapes 48x650x9x3x64 --threads 1

Both read K/V from a pool twice the rows' size, at slots scattered at random (rows of equal
length); times include the K/V gather. The padded call folds the GQA group into the query axis:

    q      [T, H_kv, g, D]       (H_q = H_kv * g; query head h uses KV head h // g, as SGLang)
    K, V   [T, H_kv, L_max, D]   gathered with padding pointed at each row's first slot
    mask   [T, 1, 1, L_max]      True where the key is in the row

so K/V are never repeated per query head (``enable_gqa=True`` on padded [T, H_q, 1, D] queries
repeats them; session 7's padded call, 2.4x slower than the loop, is not recorded in detail).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

SHAPES = ["4x280x4x2x32", "16x120x4x2x32", "16x280x4x2x32", "32x300x4x2x32", "16x1000x4x2x32",
          "8x145x9x3x64", "48x650x9x3x64"]


def looped(q, k_cache, v_cache, slots, bounds, out):
    """Per request: one SDPA over its gathered row (the runtime's path)."""
    keys, values = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
    qh = q.movedim(0, 1)  # [H_q, T, D]
    gqa = q.shape[1] != k_cache.shape[1]
    for i, (a, b) in enumerate(bounds):
        o = sdpa(qh[:, i : i + 1].unsqueeze(0), keys[a:b].movedim(0, 1).unsqueeze(0),
                 values[a:b].movedim(0, 1).unsqueeze(0), enable_gqa=gqa)
        out[i : i + 1] = o.squeeze(0).movedim(1, 0)
    return out


def padded(q, k_cache, v_cache, rows, lens, out):
    """One SDPA for the batch: rows [T, L_max] of slots, lens [T]."""
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    width = rows.shape[1]
    mask = torch.arange(width)[None, :] < lens[:, None]
    idx = torch.where(mask, rows, rows[:, :1]).reshape(-1)
    k = k_cache.index_select(0, idx).view(t, width, hkv, d).transpose(1, 2)
    v = v_cache.index_select(0, idx).view(t, width, hkv, -1).transpose(1, 2)
    o = sdpa(q.view(t, hkv, hq // hkv, d), k, v, attn_mask=mask[:, None, None, :])
    out.copy_(o.reshape(t, hq, -1))
    return out


def measure(shape: str, reps: int, calls: int) -> tuple[float, float, float]:
    """(loop µs, padded µs, max |difference|) for one T x L x H_q x H_kv x D shape."""
    t, length, hq, hkv, d = (int(x) for x in shape.split("x"))
    pool = 2 * t * length + 1
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(pool, hkv, d, generator=gen), torch.randn(pool, hkv, d, generator=gen)
    rows = torch.randperm(pool - 1, generator=gen)[: t * length].view(t, length) + 1
    lens = torch.full((t,), length)
    q = torch.randn(t, hq, d, generator=gen)
    slots = rows.reshape(-1)
    bounds = [(i * length, (i + 1) * length) for i in range(t)]
    out_a, out_b = torch.empty(t, hq, d), torch.empty(t, hq, d)
    runs = {"loop": lambda: looped(q, k_cache, v_cache, slots, bounds, out_a),
            "padded": lambda: padded(q, k_cache, v_cache, rows, lens, out_b)}
    times = {name: [] for name in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            tic = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - tic) / calls * 1e6)
    return statistics.median(times["loop"]), statistics.median(times["padded"]), float((out_a - out_b).abs().max())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="T x L x H_q x H_kv x D")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), medians of {args.reps} x {args.calls} calls")
    print("| requests x row | H_q / H_kv, D | loop µs | padded µs | speed-up | max |diff| |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes:
        a, b, err = measure(shape, args.reps, args.calls)
        t, length, hq, hkv, d = shape.split("x")
        print(f"| {t} x {length} | {hq} / {hkv}, {d} | {a:,.0f} | {b:,.0f} | {a / b:.2f}x | {err:.1e} |")


if __name__ == "__main__":
    main()
