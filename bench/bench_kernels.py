"""Micro-benchmark of the Kara kernels against their torch references.

    python bench/bench_kernels.py [--repeats 5] [--results bench/RESULTS.md]

On CUDA both paths are real kernels at serving-like sizes. On CPU the Triton path is
Triton's interpreter (numpy, one Python step per program), so its time says nothing
about GPU speed; it is reported only as an interpreter / reference ratio, with small
sizes. GB/s counts the minimum bytes each op must touch (reads + writes), not traffic.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import subprocess
import sys
import time

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sgl_kara.kernels import (  # noqa: E402
    compact_kv,
    compact_kv_ref,
    copy_slots,
    copy_slots_ref,
    window_scores_paged,
    window_scores_paged_ref,
)
from sgl_kara.policies import kept_count, select, select_ref  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def timed(fn, repeats):
    """Median wall time in ms over `repeats` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if CUDA:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if CUDA:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def sizes():
    if CUDA:  # serving-like: 32 requests, W 512, U 64, Llama-8B-like heads, 32 layers
        return dict(b=32, w=512, u=64, hq=32, hkv=8, d=128, layers=32, dtype=torch.bfloat16, tail=32)
    return dict(b=2, w=256, u=32, hq=8, hkv=2, d=128, layers=4, dtype=torch.float32, tail=16)


def bench_scores(c, repeats):
    b, w, m, hq, hkv, d = c["b"], c["w"], c["w"] - c["u"], c["hq"], c["hkv"], c["d"]
    s = b * w + 64
    q = torch.randn(b, w, hq, d, device=DEV).to(c["dtype"])
    kb = torch.randn(s, hkv, d, device=DEV).to(c["dtype"])
    slots = torch.randperm(s, device=DEV)[: b * m].view(b, m)
    nbytes = q.numel() * q.element_size() + b * m * hkv * d * kb.element_size() + b * hkv * m * 4
    shape = f"B={b} W={w} M={m} Hq={hq} Hkv={hkv} D={d} {str(c['dtype']).split('.')[-1]}"
    return ("window_scores_paged", shape, nbytes,
            timed(lambda: window_scores_paged_ref(q, kb, slots), repeats),
            timed(lambda: window_scores_paged(q, kb, slots, use_triton=True), repeats))


def bench_select(c, repeats):
    n, m = c["b"] * c["layers"] * c["hkv"], c["w"] - c["u"]
    a = torch.rand(n, m, device=DEV)
    shape = f"N={n} M={m} r=0.2 alpha=16 gamma=8"
    t_vec = timed(lambda: select(a, 0.2, 16, 8), repeats)
    rows = a[: min(n, 32)].cpu()
    t_ref = timed(lambda: [select_ref(r, 0.2, 16, 8) for r in rows], 1) * n / rows.shape[0]
    return ("select (vectorised, vs select_ref loop)", shape, a.numel() * 4, t_ref, t_vec)


def bench_compact(c, repeats):
    b, layers, hkv, d, m = c["b"], c["layers"], c["hkv"], c["d"], c["w"] - c["u"]
    k = kept_count(m, 0.2)
    s = b * m + b * k + 8
    kb = [torch.randn(s, hkv, d, device=DEV).to(c["dtype"]) for _ in range(layers)]
    vb = [torch.randn(s, hkv, d, device=DEV).to(c["dtype"]) for _ in range(layers)]
    src = torch.sort(torch.rand(b, layers, hkv, m, device=DEV).argsort(-1)[..., :k], -1).values
    src = src + (torch.arange(b, device=DEV) * m).view(b, 1, 1, 1)
    dst = (b * m + torch.arange(b * k, device=DEV)).view(b, k)
    nbytes = 2 * 2 * b * layers * hkv * k * d * kb[0].element_size()
    shape = f"B={b} L={layers} Hkv={hkv} D={d} K={k}"
    return ("compact_kv", shape, nbytes,
            timed(lambda: compact_kv_ref(kb, vb, src, dst), repeats),
            timed(lambda: compact_kv(kb, vb, src, dst, use_triton=True, check=False), repeats))


def bench_copy(c, repeats):
    layers, hkv, d, n = c["layers"], c["hkv"], c["d"], c["b"] * c["tail"]
    s = 4 * n
    kb = [torch.randn(s, hkv, d, device=DEV).to(c["dtype"]) for _ in range(layers)]
    vb = [torch.randn(s, hkv, d, device=DEV).to(c["dtype"]) for _ in range(layers)]
    src = torch.arange(n, device=DEV) * 2
    dst = torch.arange(n, device=DEV) * 2 + 1
    nbytes = 2 * 2 * layers * n * hkv * d * kb[0].element_size()
    return ("copy_slots", f"L={layers} N={n} Hkv={hkv} D={d}", nbytes,
            timed(lambda: copy_slots_ref(kb, vb, src, dst), repeats),
            timed(lambda: copy_slots(kb, vb, src, dst, use_triton=True), repeats))


def machine():
    if CUDA:
        return torch.cuda.get_device_name()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = re.search(r"Model name:\s*(.+)", out).group(1).strip()
    except Exception:  # noqa: BLE001
        name = platform.processor() or "unknown CPU"
    return f"{os.cpu_count()}-core CPU, {name}"


def report(rows, repeats):
    import triton

    kind = "Triton (CUDA)" if CUDA else "Triton interpreter (TRITON_INTERPRET=1)"
    lines = [
        "## Kernels",
        "",
        f"Date: {datetime.date.today().isoformat()}. Machine: {machine()}; torch {torch.__version__}, triton {triton.__version__}. "
        f"Command: `python bench/bench_kernels.py --repeats {repeats}`; median of {repeats} "
        "runs after a warm-up. GB/s = minimum bytes touched / time.",
        "",
        f"| op | shape | reference ms | ref GB/s | {kind} ms | kernel GB/s | kernel / ref time |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, shape, nbytes, t_ref, t_k in rows:
        lines.append(f"| {name} | {shape} | {t_ref:.3f} | {nbytes / t_ref / 1e6:.2f} | {t_k:.3f} | "
                     f"{nbytes / t_k / 1e6:.3f} | {t_k / t_ref:.1f}x |")
    if not CUDA:
        lines += ["", "No GPU here: the kernel column is Triton's CPU interpreter, which checks "
                  "correctness, not speed; its ratio to torch is not a GPU prediction. "
                  "select is plain torch (no Triton); its reference column is the "
                  "per-row Python select_ref (timed on at most 32 rows, scaled to N). "
                  "CPU figures come from a shared 2-core machine and are noisy."]
    return "\n".join(lines) + "\n"


def write_section(path, section):
    text = open(path).read() if os.path.exists(path) else "# Benchmark results\n"
    pat = re.compile(r"^## Kernels\b[^\n]*\n.*?(?=^## |\Z)", re.M | re.S)
    if pat.search(text):
        text = pat.sub(lambda _: section + "\n", text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with open(path, "w") as f:
        f.write(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--results", help="markdown file whose '## Kernels' section is replaced")
    args = ap.parse_args()
    torch.manual_seed(0)
    c = sizes()
    rows = [f(c, args.repeats) for f in (bench_scores, bench_select, bench_compact, bench_copy)]
    section = report(rows, args.repeats)
    print(section)
    if args.results:
        write_section(args.results, section)


if __name__ == "__main__":
    main()
