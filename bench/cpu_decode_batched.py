"""CPU decode attention in isolation: SGLang 0.5.23's own per-request loop, the runtime's loop
(sgl_kara/cpu/attention.py, default) and the runtime's padded call (``KARA_BATCHED_CPU_DECODE=1``),
all three through the functions the server runs: SGLang's ``_run_sdpa_forward_decode`` and
``sgl_kara.cpu.attention.run_sdpa_forward_decode`` with the flag toggled (bench/results/kernels.md).

    python -m bench.cpu_decode_batched                      # the shapes of kernels.md
    python -m bench.cpu_decode_batched --shapes 48x650x9x3x64 --threads 1 --spread 0.5
    python -m bench.cpu_decode_batched --out DIR/cpu_decode_batched.txt   # + the run record beside it

K/V live in a pool twice the rows' size, at slots scattered at random; row lengths are L, or spread
evenly over [L(1-S), L(1+S)] with ``--spread S``. One "forward" is ``--layers`` calls: the runtime
reads the rows once per forward (as after ``init_forward_metadata``) and gathers K/V per call, so
times are per layer, gather included. The padded call folds the GQA group into the query axis:

    q      [T, H_kv, g, D]       (H_q = H_kv * g; query head h uses KV head h // g, as SGLang)
    K, V   [T, H_kv, L_max, D]   gathered with padding pointed at each row's first slot
    mask   [T, 1, 1, L_max]      True where the key is in the row

and is taken only while T x L_max <= PAD_RATIO sum(L_i) + T CALL_UNITS / (H_q D) (cpu/attention.py; else
the runtime loops; the table says which ran). ``--spread`` checks that rule.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from sgl_kara.cpu import attention as cpu_attention

SHAPES = [
    "4x280x4x2x32",
    "16x120x4x2x32",
    "16x280x4x2x32",
    "32x300x4x2x32",
    "16x1000x4x2x32",
    "8x145x9x3x64",
    "48x650x9x3x64",
]
FLAG = "KARA_BATCHED_CPU_DECODE"


def _sglang_decode():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    fn = TorchNativeAttnBackend._run_sdpa_forward_decode
    return getattr(
        fn, "__wrapped__", fn
    )  # SGLang's own, whether or not the plugin hooked it


class _Backend:  # the instance state the runtime keeps (SGLang's backend needs a model runner)
    pass


def lengths(t: int, length: int, spread: float) -> list[int]:
    """t row lengths evenly over [L(1-S), L(1+S)] (all L when S = 0), at least 1."""
    if t == 1 or spread == 0:
        return [length] * t
    lo, hi = length * (1 - spread), length * (1 + spread)
    return [max(1, round(lo + (hi - lo) * i / (t - 1))) for i in range(t)]


def measure(shape: str, spread: float, layers: int, reps: int, forwards: int, original):
    """({system: µs per layer call}, max |padded - SGLang|, padded taken) for T x L x H_q x H_kv x D."""
    t, length, hq, hkv, d = (int(x) for x in shape.split("x"))
    lens = lengths(t, length, spread)
    width = max(lens)
    pool = 2 * sum(lens) + 1
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (
        torch.randn(pool, hkv, d, generator=gen),
        torch.randn(pool, hkv, d, generator=gen),
    )
    req_to_token = (
        torch.randperm(pool - 1, generator=gen)[: t * width].view(t, width) + 1
    ).to(torch.int32)
    req_pool_indices, seq_lens = torch.arange(t), torch.tensor(lens)
    q = torch.randn(t, hq, d, generator=gen)
    kw = dict(scaling=d**-0.5, enable_gqa=hq != hkv, causal=False)
    outs = {name: torch.empty(t, hq, d) for name in ("sglang", "loop", "padded")}

    def runtime(name):
        backend = (
            _Backend()
        )  # lives across forwards, as SGLang's backend (K/V buffers reused)

        def forward():
            os.environ[FLAG] = "1" if name == "padded" else "0"
            cpu_attention.reset_metadata_hook(None, backend)
            for _ in range(layers):
                cpu_attention.run_sdpa_forward_decode(
                    original,
                    backend,
                    q,
                    outs[name],
                    k_cache,
                    v_cache,
                    req_to_token,
                    req_pool_indices,
                    seq_lens,
                    None,
                    **kw,
                )
            return backend

        return forward

    def sglang():
        for _ in range(layers):
            original(
                _Backend(),
                q,
                outs["sglang"],
                k_cache,
                v_cache,
                req_to_token,
                req_pool_indices,
                seq_lens,
                None,
                **kw,
            )

    runs = {"sglang": sglang, "loop": runtime("loop"), "padded": runtime("padded")}
    saved = os.environ.get(FLAG)
    try:
        taken = (
            getattr(runs["padded"](), cpu_attention._META).padded(hq * d) is not None
        )
        times = {name: [] for name in runs}
        for _ in range(reps):
            for name, fn in runs.items():
                tic = time.perf_counter()
                for _ in range(forwards):
                    fn()
                times[name].append(
                    (time.perf_counter() - tic) / (forwards * layers) * 1e6
                )
    finally:
        if saved is None:
            os.environ.pop(FLAG, None)
        else:
            os.environ[FLAG] = saved
    if not torch.equal(outs["loop"], outs["sglang"]):
        raise AssertionError(
            f"{shape}: the runtime loop is not bit-identical to SGLang's"
        )
    err = float((outs["padded"] - outs["sglang"]).abs().max())
    return {name: statistics.median(v) for name, v in times.items()}, err, taken


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--shapes", nargs="+", default=SHAPES, help="T x L x H_q x H_kv x D"
    )
    ap.add_argument(
        "--spread",
        type=float,
        default=0.0,
        help="row lengths over [L(1-S), L(1+S)], 0 <= S < 1",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--layers",
        type=int,
        default=4,
        help="calls per forward (rows read once per forward)",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--forwards", type=int, default=12)
    ap.add_argument(
        "--out",
        default=None,
        help="also write the table to this file, the run record beside it",
    )
    args = ap.parse_args(argv)
    if not 0 <= args.spread < 1:
        ap.error(f"--spread must be in [0, 1) (got {args.spread})")
    torch.set_num_threads(args.threads)
    original = _sglang_decode()
    lines = [
        f"torch {torch.__version__}, {args.threads} thread(s), spread {args.spread}, medians of "
        f"{args.reps} x {args.forwards} forwards x {args.layers} layers, µs per layer",
        "| requests x row | H_q / H_kv, D | SGLang µs | loop µs | padded µs | padded / loop speed-up "
        "| max |padded - SGLang| |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for shape in args.shapes:
        us, err, taken = measure(
            shape, args.spread, args.layers, args.reps, args.forwards, original
        )
        t, length, hq, hkv, d = shape.split("x")
        note = "" if taken else " (loop taken: padding costs more)"
        lines.append(
            f"| {t} x {length} | {hq} / {hkv}, {d} | {us['sglang']:,.0f} | {us['loop']:,.0f} | "
            f"{us['padded']:,.0f} | {us['loop'] / us['padded']:.2f}x{note} | {err:.1e} |"
        )
        print(lines[-1], flush=True)
    if args.out:
        from bench.record import RunRecord

        record = RunRecord.beside(args.out, argv)
        record.write_md(args.out, "\n".join(lines))
        record.finish()


if __name__ == "__main__":
    main()
