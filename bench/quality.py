"""What compression costs in answers: policies x retention ratios through the real runtime.

Runs held-out problems of the reasoning proxy task (bench/quality/task.py) through
``sgl_kara.Engine`` for: full KV (``none``), ``kara``, ``kara`` without Token2Chunk
(chunk_budget 0), ``kara`` without bidirectional scoring (buffer queries only), ``snapkv``
(threshold-triggered) and ``streaming``, across retention ratios. Budgets are matched per
sequence (seed 000 §5): Kara runs first, then each baseline gets a per-problem budget
(``custom_params.kara.budget``) from Kara's run of that problem. ``--match peak`` (default): the
baseline's peak generated KV (budget N plus its trigger gap W - U) equals Kara's peak;
``--match final``: N equals the generated-KV length Kara ended with (the paper's matching; the
baseline then holds up to W - U more entries than Kara did). Kara is evaluated with
period 1 (compress as soon as a window is full), as the paper does for accuracy.

Reports accuracy with counts and a 95% Wilson interval, paired comparisons against full KV
(problems a policy gets wrong where full KV is right, and the reverse), peak and mean KV kept,
and generated length; writes a table to --out/quality.md (and a PNG if matplotlib is present).

    python bench/quality.py --model-path bench/quality/proxy_model --n 500
    python bench/quality.py --n 4 --ratios 0.25 --policies none kara    # smoke run

Real models (plumbing; numbers need a GPU): ``--model-path M --jsonl math500.jsonl`` where each
line has ``problem`` and ``answer``; answers are extracted from the last ``\\boxed{...}``; pass@1
with greedy decoding and ``--max-new-tokens`` (paper: 8192 for R1-Llama-8B).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "quality"))

from engine_env import engine_env  # noqa: E402  (bench/engine_env.py)
from eval_hf import wilson  # noqa: E402  (bench/quality/eval_hf.py)

POLICIES = {
    "none": dict(kara_policy="none"),
    "kara": dict(kara_policy="kara"),
    "kara-noT2C": dict(kara_policy="kara", kara_chunk_budget=0),
    "kara-causal": dict(kara_policy="kara", kara_scoring="buffer"),
    "snapkv": dict(kara_policy="snapkv"),
    "streaming": dict(kara_policy="streaming"),
}


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (nested braces allowed)."""
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    depth, j = 0, i + len("\\boxed{")
    for k in range(j, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            if depth == 0:
                return text[j:k].strip()
            depth -= 1
    return None


def load_problems(args):
    """[(prompt, answer, max_new_tokens, checker)]."""
    if args.jsonl:
        rows = [json.loads(line) for line in open(args.jsonl) if line.strip()][: args.n]
        suffix = "\nPlease reason step by step, and put your final answer within \\boxed{}."
        return [(r["problem"] + suffix, str(r["answer"]).strip(), args.max_new_tokens,
                 lambda out, ans: last_boxed(out) == ans) for r in rows]
    import task
    from eval_hf import held_out_problems

    probs = held_out_problems(args.n, seed=args.seed, size_min=args.size_min, size_max=args.size_max)
    out = []
    for prompt, solution, answer in probs:
        budget = task.count_tokens(solution) + 16
        out.append((prompt, answer, budget, task.check))
    return out


def run_engine(model_path, options, problems, per_request=None, threads=1):
    import sgl_kara

    with engine_env(threads):
        engine = sgl_kara.Engine(model_path=model_path, log_level="error", random_seed=0,
                                 disable_overlap_schedule=True, **options)
    try:
        params = []
        for i, (_, _, max_new, _) in enumerate(problems):
            p = {"max_new_tokens": max_new, "temperature": 0.0}
            if per_request and per_request[i]:
                p["custom_params"] = {"kara": per_request[i]}
            params.append(p)
        return engine.generate([p[0] for p in problems], params)
    finally:
        engine.shutdown()


def baseline_budget(meta: dict, args) -> int:
    """Per-problem snapkv/streaming budget N from Kara's run (see --match)."""
    prompt, kara = meta["prompt_tokens"], meta["kara"]
    if args.match == "final":
        return kara["kv_physical_len"] - prompt
    return kara["kv_peak_len"] - prompt - trigger_gap(args)


def trigger_gap(args) -> int:
    """C_max - N of the baselines: one Kara window's compressible rows, W - U."""
    return args.window - args.buffer


def summarize(name, ratio, outs, problems, full_correct=None):
    correct = [chk(o["text"], ans) for o, (_, ans, _, chk) in zip(outs, problems)]
    k, n = sum(correct), len(correct)
    lo, hi = wilson(k, n)
    metas = [o["meta_info"].get("kara", {}) for o in outs]
    prompt = [o["meta_info"]["prompt_tokens"] for o in outs]
    gen = [o["meta_info"]["completion_tokens"] for o in outs]
    peak = [m.get("kv_peak_len", p + g) - p for m, p, g in zip(metas, prompt, gen)]
    mean = [m.get("kv_mean_len", p + g / 2) - p for m, p, g in zip(metas, prompt, gen)]
    row = dict(policy=name, ratio=ratio, correct=k, n=n, acc=k / n, lo=lo, hi=hi,
               peak_kv=sum(peak) / n, mean_kv=sum(mean) / n, gen_len=sum(gen) / n,
               kept_share=sum(pk / max(1, g) for pk, g in zip(peak, gen)) / n)
    if full_correct is not None:
        row["lost"] = sum(1 for a, b in zip(full_correct, correct) if a and not b)
        row["gained"] = sum(1 for a, b in zip(full_correct, correct) if b and not a)
    return row, correct


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=os.path.join(HERE, "quality", "proxy_model"))
    ap.add_argument("--jsonl", default=None, help="MATH-500-style problems (real models, GPU)")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--size-min", type=int, default=21, help="proxy problem size (21 values -> 313 solution tokens)")
    ap.add_argument("--size-max", type=int, default=62, help="proxy problem size (62 values -> 969 solution tokens)")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--buffer", type=int, default=16)
    ap.add_argument("--chunk-budget", type=int, default=8)
    ap.add_argument("--max-chunk", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8192)
    ap.add_argument("--max-total-tokens", type=int, default=200_000, help="KV pool size (tokens)")
    ap.add_argument("--match", choices=("peak", "final"), default="peak",
                    help="baseline budgets: equal peak generated KV to Kara's, or N = Kara's final length")
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--omp-threads", type=int, default=1,
                    help="OMP_NUM_THREADS (+ OMP_WAIT_POLICY=PASSIVE) for the engine; 0 = leave as is")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    problems = load_problems(args)
    common = dict(kara_window=args.window, kara_buffer=args.buffer, kara_max_chunk=args.max_chunk,
                  kara_period=1, kara_max_seqs=4096, kara_query_source="capture",
                  kara_snapkv_window=args.buffer)
    pool = dict(max_total_tokens=args.max_total_tokens, max_running_requests=args.max_running)

    rows = []
    runs = [("none", None)] + [(p, r) for r in args.ratios for p in args.policies if p != "none"]
    full_correct = None
    kara_budget: dict[float, list[int]] = {}
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        def tqdm(x, **_):
            return x
    # Kara variants first at each ratio so baselines can match its per-sequence budget.
    order = sorted(runs, key=lambda pr: (pr[1] or 0, pr[0] not in ("kara", "none")))
    for name, ratio in tqdm(order, desc="policies x ratios"):
        opts = dict(POLICIES[name], **pool)
        per_request = None
        if name.startswith("kara"):
            m = args.window - args.buffer
            k = max(1, math.ceil(round(ratio * m, 6)))
            chunk_budget = opts.pop("kara_chunk_budget", min(args.chunk_budget, k - 1))  # noT2C: 0
            opts.update(common, kara_retention=ratio, kara_chunk_budget=chunk_budget)
        elif name in ("snapkv", "streaming"):
            if ratio not in kara_budget:
                raise SystemExit(f"{name} at {ratio} needs a kara run at the same ratio first (budget matching)")
            opts.update(common, kara_snapkv_budget=max(args.buffer + 1, 2 * args.buffer),
                        kara_snapkv_threshold=max(args.buffer + 1, 2 * args.buffer) + trigger_gap(args))
            per_request = [{"budget": max(2, b)} for b in kara_budget[ratio]]
        tic = time.perf_counter()
        outs = run_engine(args.model_path, opts, problems, per_request, args.omp_threads)
        row, correct = summarize(name, ratio, outs, problems, full_correct)
        row["seconds"] = time.perf_counter() - tic
        if name == "none":
            full_correct = correct
        if name == "kara":
            kara_budget[ratio] = [baseline_budget(o["meta_info"], args) for o in outs]
        rows.append(row)
        write_table(rows, args, argv)
        print(f"{name:12s} r={ratio} acc {row['acc']:.3f} ({row['correct']}/{row['n']}) "
              f"peak KV {row['peak_kv']:.0f} mean KV {row['mean_kv']:.0f} gen {row['gen_len']:.0f}", flush=True)

    print(write_table(rows, args, argv))
    plot(rows, args)
    return rows


def write_table(rows, args, argv):
    """Markdown + JSON of the rows so far (rewritten after every policy run)."""
    lines = ["| policy | retention | accuracy (95% CI) | correct / n | lost vs full | gained vs full "
             "| peak gen. KV | mean gen. KV | gen. length |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['ratio'] if r['ratio'] is not None else '-'} | {r['acc']:.3f} "
            f"({r['lo']:.3f}-{r['hi']:.3f}) | {r['correct']}/{r['n']} | {r.get('lost', '-')} | "
            f"{r.get('gained', '-')} | {r['peak_kv']:.0f} | {r['mean_kv']:.0f} | {r['gen_len']:.0f} |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "quality.md"), "w") as f:
        f.write(f"command: python bench/quality.py {' '.join(argv if argv is not None else sys.argv[1:])}\n\n{table}\n")
    with open(os.path.join(args.out, "quality.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return table


def plot(rows, args):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    full = next((r["acc"] for r in rows if r["policy"] == "none"), None)
    for name in args.policies:
        if name == "none":
            continue
        pts = sorted((r["ratio"], r["acc"]) for r in rows if r["policy"] == name)
        ax.plot([p for p, _ in pts], [a for _, a in pts], marker="o", label=name)
    if full is not None:
        ax.axhline(full, color="k", linestyle="--", label="full KV")
    ax.set_xlabel("retention ratio")
    ax.set_ylabel("exact-answer accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "quality_vs_retention.png"), dpi=120)


if __name__ == "__main__":
    main()
