"""Decode-step weight matmuls on CPU: MKL's sgemm (``F.linear``) vs oneDNN on a prepacked weight
(``sgl_kara.cpu.linear``, as served: every linear weight packed, the lm_head's packed copy for
``LM_HEAD_ROWS`` only), by batch rows. One thread, float32, a model's shapes (default:
SmolLM2-135M: 30 layers of qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536]
and the lm_head [49152, 576] -- 540 MB, more than this machine's caches, as in serving).

    python -m bench.cpu_linear --out bench/results/2026-11-25-step-costs/cpu_linear.txt
    python -m bench.cpu_linear --model-path /path/to/hf/checkpoint --rows 1 2 4 8 16 32
    python -m bench.cpu_linear --rows 64 128 192 256 512   # recompute-forward sizes

Each row count times one pass over every weight, both forms interleaved, ``--repeats`` passes per
form; medians. Also the largest absolute difference between the two forms' outputs. With --out
the table goes to that file and the run record (bench/record.py) beside it (``<name>.run.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

SMOLLM2 = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
)


def shapes(cfg: dict) -> list[tuple[int, int]]:
    """[out, in] of every weight matmul of one decode step (fused qkv and gate_up, as SGLang runs)."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * d
    layer = [(qkv, h), (cfg["num_attention_heads"] * d, h), (2 * i, h), (h, i)]
    return layer * cfg["num_hidden_layers"] + [(cfg["vocab_size"], h)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model-path",
        default=None,
        help="an HF checkpoint's config.json shapes (default: SmolLM2-135M)",
    )
    ap.add_argument(
        "--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from sgl_kara.cpu import linear as cpu_linear

    torch.set_num_threads(args.threads)
    cfg = SMOLLM2
    if args.model_path:
        with open(os.path.join(args.model_path, "config.json")) as f:
            cfg = json.load(f)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=g) * 0.02 for o, i in shapes(cfg)]
    mb = sum(w.numel() for w in weights) * 4 / 2**20
    in_sizes = {w.shape[1] for w in weights}

    lm_head = weights[-1]
    packed = [
        cpu_linear.packed_copy(w) for w in weights[:-1]
    ]  # in serving: in place, no dense copy left

    def served(x, i):
        """Weight i's matmul as the hooks run it (i = len(weights) - 1: the lm_head)."""
        if i < len(packed):
            return cpu_linear.packed_linear(x, packed[i])
        if cpu_linear.lm_head_takes_copy(x, lm_head):
            return cpu_linear.packed_linear(x, cpu_linear.packed_copy(lm_head))
        return F.linear(x, lm_head)

    def one_pass(form, rows):
        xs = {i: torch.randn(rows, i, generator=g) for i in in_sizes}
        tic = time.perf_counter()
        for i, w in enumerate(weights):
            F.linear(xs[w.shape[1]], w) if form == "F.linear" else served(
                xs[w.shape[1]], i
            )
        return 1e3 * (time.perf_counter() - tic)

    lines = [
        f"weights {mb:.0f} MiB float32, {len(weights)} matmuls per step, {args.threads} thread(s), "
        f"torch {torch.__version__}, median of {args.repeats} passes per form (interleaved); linear weights packed "
        f"at every row count, the lm_head for rows in {cpu_linear.LM_HEAD_ROWS}",
        "",
        "| rows | F.linear (ms) | per row | sgl_kara.cpu.linear (ms) | per row | F.linear / cpu_linear | max abs diff (first weight) |",
        "|---|---|---|---|---|---|---|",
    ]
    for rows in args.rows:
        for form in (
            "F.linear",
            "packed",
        ):  # warm-up: packs the weights, touches every page
            one_pass(form, rows)
        times = {"F.linear": [], "packed": []}
        for _ in range(args.repeats):
            for form in times:
                times[form].append(one_pass(form, rows))
        a, b = statistics.median(times["F.linear"]), statistics.median(times["packed"])
        x = torch.randn(rows, weights[0].shape[1], generator=g)
        diff = (F.linear(x, weights[0]) - served(x, 0)).abs().max().item()
        lines.append(
            f"| {rows} | {a:.1f} | {a / rows:.1f} | {b:.1f} | {b / rows:.1f} | {a / b:.2f}x | {diff:.1e} |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        from bench.record import RunRecord

        record = RunRecord.beside(args.out, argv)
        record.note(
            threads=args.threads, model=args.model_path or "SmolLM2-135M shapes"
        )
        record.write_md(args.out, text)
        record.finish()
    print(text)


if __name__ == "__main__":
    main()
