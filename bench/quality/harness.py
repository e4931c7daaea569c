"""What compression costs in answers (``python -m bench.quality``): policies x retention ratios
through the real runtime.

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
and generated length; then fidelity to full KV on the first --fidelity-n problems (next-token
agreement and KL when the full-KV output is fed through each policy, bench/quality/fidelity.py;
per token role on the proxy). Writes a table to --out/quality.md (+ .json with per-problem
results), a PNG if matplotlib is present, and the run record (run.json, bench/record.py: every
engine's resolved settings). Runs split over processes (``--no-full``, ``--fidelity-only``) are
joined by ``--merge``.

    python -m bench.quality --n 500        # the reasoning proxy (bench/models/reasoning_proxy)
    python -m bench.quality --n 4 --ratios 0.25 --policies none kara    # smoke run

Real models (plumbing; numbers need a GPU): ``--model-path M --jsonl math500.jsonl`` where each
line has ``problem`` and ``answer``; answers are extracted from the last ``\\boxed{...}``; pass@1
with greedy decoding and ``--max-new-tokens`` (paper: 8192 for R1-Llama-8B).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import sys
import time

from bench.engine_env import kara_opts
from bench.quality import real_lm
from bench.reasoning.grading import last_boxed
from bench.reasoning.stats import wilson

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)

# the synthetic harness's policies: real_lm's own settings, those the synthetic task runs
POLICIES = {
    name: real_lm.POLICIES[name]
    for name in ("none", "kara", "kara-noT2C", "kara-causal", "snapkv", "streaming")
}


def load_problems(args):
    """[(prompt, answer, max_new_tokens, checker)]."""
    if args.jsonl:
        rows = [json.loads(line) for line in open(args.jsonl) if line.strip()][: args.n]
        suffix = (
            "\nPlease reason step by step, and put your final answer within \\boxed{}."
        )
        return [
            (
                r["problem"] + suffix,
                str(r["answer"]).strip(),
                args.max_new_tokens,
                lambda out, ans: last_boxed(out) == ans,
            )
            for r in rows
        ]
    from bench.quality import task

    rng = random.Random(args.seed)  # held-out: training draws from other seeds
    probs = [
        task.make_problem(rng, rng.randint(args.size_min, args.size_max))
        for _ in range(args.n)
    ]
    out = []
    for prompt, solution, answer in probs:
        budget = task.count_tokens(solution) + 16
        out.append((prompt, answer, budget, task.check))
    return out


def run_engine(
    model_path,
    options,
    problems,
    per_request=None,
    threads=1,
    fidelity=None,
    record=None,
    label=None,
):
    """Greedy outputs of ``problems`` ((prompt, answer, max_new_tokens, checker) tuples) on one
    engine (bench/quality/real_lm.py: run_engine); per_request: custom_params.kara per problem;
    fidelity: custom_params.fidelity per problem (record / force, bench/quality/fidelity.py), a
    forced problem generating exactly its forced tokens; ``record``: a bench.record.RunRecord that
    gets the engine's resolved settings under ``label``."""

    def params_of(i, problem):
        forced = fidelity and fidelity[i]["mode"] == "force"
        return {
            "max_new_tokens": len(fidelity[i]["tokens"]) if forced else problem[2],
            "temperature": 0.0,
        }

    return real_lm.run_engine(
        model_path,
        options,
        problems,
        params_of,
        per_request,
        fidelity,
        threads,
        record,
        label,
        text_of=lambda problem: problem[0],
    )


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
    row = dict(
        policy=name,
        ratio=ratio,
        correct=k,
        n=n,
        acc=k / n,
        lo=lo,
        hi=hi,
        peak_kv=sum(peak) / n,
        mean_kv=sum(mean) / n,
        gen_len=sum(gen) / n,
        kept_share=sum(pk / max(1, g) for pk, g in zip(peak, gen)) / n,
        per_problem=dict(correct=correct, peak_kv=peak, gen_len=gen),
    )
    if full_correct is not None:
        pair_with_full(row, full_correct)
    return row, correct


def pair_with_full(row, full_correct):
    """Paired counts: problems this policy loses (full KV right, policy wrong) and gains."""
    correct = row["per_problem"]["correct"]
    if len(correct) != len(full_correct):
        raise ValueError(
            f"{row['policy']} r={row['ratio']}: {len(correct)} problems vs {len(full_correct)} full-KV"
        )
    row["lost"] = sum(1 for a, b in zip(full_correct, correct) if a and not b)
    row["gained"] = sum(1 for a, b in zip(full_correct, correct) if b and not a)


def merge(paths, args, argv):
    """One table from several runs' quality.json (ratios split over processes, a --fidelity-only run).

    Rows of the same (policy, ratio) are joined (accuracy fields from one run, fidelity fields from
    another; a field given twice must agree). Every run must use the same problems
    (--n/--seed/--size-*); paired counts are recomputed against the one full-KV accuracy row.
    """
    joined: dict[tuple, dict] = {}
    for path in paths:
        for r in json.load(open(path)):
            row = joined.setdefault((r["policy"], r["ratio"]), {})
            paired = ("lost", "gained", "seconds")
            clash = [f for f in r if f in row and row[f] != r[f] and f not in paired]
            if clash:
                raise SystemExit(
                    f"--merge: {r['policy']} r={r['ratio']} has different {clash} in {path}"
                )
            row.update(r)
    rows = list(joined.values())
    full = [r for r in rows if r["policy"] == "none" and "per_problem" in r]
    if len(full) != 1:
        raise SystemExit(
            f"--merge needs exactly one full-KV ('none') accuracy row among the inputs, found {len(full)}"
        )
    for r in rows:
        if "per_problem" in r:
            pair_with_full(r, full[0]["per_problem"]["correct"])
    rows.sort(key=lambda r: (r["ratio"] or 0, list(POLICIES).index(r["policy"])))
    args.policies = [p for p in POLICIES if any(r["policy"] == p for r in rows)]
    table = write_table(rows, args, argv)
    plot(rows, args)
    return table


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    arg = ap.add_argument
    h = "default: the embedded default model (the proxy)"
    arg("--model-path", default=None, help=h)
    arg("--jsonl", default=None, help="MATH-500-style problems (real models, GPU)")
    arg("--n", type=int, default=500)
    arg("--seed", type=int, default=1234)
    h = "proxy problem size (21 values -> 313 solution tokens)"
    arg("--size-min", type=int, default=21, help=h)
    h = "proxy problem size (62 values -> 969 solution tokens)"
    arg("--size-max", type=int, default=62, help=h)
    arg("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5])
    arg("--policies", nargs="+", default=list(POLICIES))
    arg("--window", type=int, default=128)
    arg("--buffer", type=int, default=16)
    arg("--chunk-budget", type=int, default=8)
    arg("--max-chunk", type=int, default=8)
    arg("--max-new-tokens", type=int, default=8192)
    arg("--max-total-tokens", type=int, default=200_000, help="KV pool size (tokens)")
    arg(
        "--match",
        choices=("peak", "final", "mean", "trajectory"),
        default="peak",
        help="baseline budgets: equal peak generated KV to Kara's, or N = Kara's final length "
        "(proxy mode), or equal mean generated KV = equal KV-token-steps (--real), or Kara's "
        "generated KV at every decode step (--real: custom_params.kara.match_kara)",
    )
    h = (
        "a Python file that registers a policy (@register); its name is then a policy "
        "(--real; repeatable)"
    )
    arg("--policy-file", action="append", default=[], metavar="FILE", help=h)
    arg("--max-running", type=int, default=64)
    h = "another sgl_kara option for every compressing policy, e.g. phase=server (repeatable)"
    arg("--kara-opt", action="append", default=[], metavar="NAME=VALUE", help=h)
    h = "OMP_NUM_THREADS (+ OMP_WAIT_POLICY=PASSIVE) for the engine; 0 = leave as is"
    arg("--omp-threads", type=int, default=1, help=h)
    h = "fidelity to full KV (next-token agreement, KL) on the first N problems; 0 = off"
    arg("--fidelity-n", type=int, default=100, help=h)
    arg("--fidelity-only", action="store_true", help="skip the accuracy runs")
    h = "skip the full-KV run (another process runs it; combine with --merge)"
    arg("--no-full", action="store_true", help=h)
    h = "write one table + plot from these runs' quality.json (with --real: quality_real.json) files and exit"
    arg("--merge", nargs="+", metavar="JSON", default=None, help=h)
    arg(
        "--out",
        default=os.path.join(
            BENCH, "results", f"{datetime.date.today().isoformat()}-quality"
        ),
        help="output folder (default: bench/results/<today>-quality)",
    )
    real = ap.add_argument_group(
        "real LM (--real): fidelity on the default model, bench/quality/real_lm.py"
    )
    opt = real.add_argument
    opt("--real", action="store_true", help="real-LM mode (model default: SmolLM2)")
    opt("--prompts", default=os.path.join(HERE, "real_prompts.jsonl"))
    h = "take every k-th prompt (the file is grouped by kind; 3 -> 16 prompts of every kind)"
    opt("--stride", type=int, default=1, help=h)
    h = "full-KV output length (EOS suppressed)"
    opt("--new-tokens", type=int, default=1000, help=h)
    opt("--decoding", choices=("greedy", "sample"), default="greedy")
    opt("--temperature", type=float, default=0.7)
    opt("--top-p", type=float, default=0.95)
    opt("--sample-seed", dest="seed_sample", type=int, default=0)
    opt("--period", type=int, default=1, help="Kara's event period in the real-LM runs")
    opt("--show", type=int, default=3, help="prompts decoded freely under every policy")
    h = "only the free generations of --show prompts (needs --ref-dir with Kara's stored peaks for the threshold baselines)"
    opt("--free-only", action="store_true", help=h)
    h = (
        "teacher-forced text instead of the prompts' answers: python | prose | a file, directory or "
        "glob (first 64 tokens = prompt, next --new-tokens forced; bench/quality/workloads.py)"
    )
    opt("--text", default=None, metavar="SOURCE", help=h)
    h = "teacher-forced recall: facts stated, prose, facts repeated; scored on the recalled values"
    opt("--recall", action="store_true", help=h)
    opt("--facts", type=int, default=8, help="facts per --recall item")
    h = (
        "free generation with EOS allowed: do compressed answers stop where full KV's do "
        "(bench/quality/stopping.py)"
    )
    opt("--stopping", action="store_true", help=h)
    h = (
        "the Kara variant whose per-prompt peak / mean KV sets the threshold baselines' budgets "
        "(e.g. kara-r128)"
    )
    opt("--budget-from", default="kara", help=h)
    h = (
        "keep the full-KV record (outputs + per-step log-probs: 4 x vocab bytes per token, "
        "9.4 GB for SmolLM2 x 48 prompts x 1,000 tokens) here and reuse it when it matches, so rows can be added in later runs"
    )
    opt("--ref-dir", default=None, help=h)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--policy-file", action="append", default=[])
    from bench.reasoning import configs

    configs.use_policy_files(pre.parse_known_args(argv)[0].policy_file)
    args = ap.parse_args(argv)
    try:
        kara_opts(args.kara_opt)
    except ValueError as e:
        ap.error(str(e))
    from bench.record import RunRecord

    # every mode: date, machine, commit, command; engines as they start
    args.record = RunRecord(args.out, argv)
    if args.real:
        given = argv if argv is not None else sys.argv[1:]
        if "--policies" not in given:
            args.policies = list(real_lm.POLICIES)
        if "--max-running" not in given:
            args.max_running = 16
        # the proxy's 200k tokens would be 9 GB of SmolLM2 KV
        if "--max-total-tokens" not in given:
            args.max_total_tokens = args.max_running * (args.new_tokens + 256)
        if sum(map(bool, (args.text, args.recall, args.stopping))) > 1:
            ap.error("--text, --recall and --stopping are separate workloads: give one")
        if args.text or args.recall or args.stopping:
            if "--n" not in given:
                args.n = 16 if args.stopping else 8
            if "--show" not in given:
                args.show = 0
        if (
            args.budget_from not in args.policies
            and not args.merge
            and not args.free_only
            and any(p in real_lm.THRESHOLD for p in args.policies)
            and args.budget_from != "kara"
        ):
            ap.error(f"--budget-from {args.budget_from} must be among --policies")
        if args.stopping:
            from bench.quality import stopping

            if args.stride < 1:
                ap.error(f"--stride must be >= 1 (got {args.stride})")
            return stopping.main(args, argv)
        args.seed = args.seed_sample
        if args.match == "final":
            ap.error(
                "--match final is for the proxy mode; --real takes peak, mean or trajectory"
            )
        if args.merge:
            return real_lm.merge(args.merge, args, argv)
        if args.stride < 1:
            ap.error(f"--stride must be >= 1 (got {args.stride})")
        if args.free_only and not (args.ref_dir and args.show):
            ap.error(
                "--free-only needs --ref-dir (the record with Kara's peaks) and --show >= 1"
            )
        return real_lm.main(args, argv)
    if args.match == "trajectory":
        ap.error("--match trajectory is for --real; the proxy mode takes peak or final")
    if args.model_path is None:
        from bench.models.proxy import proxy_model_path

        args.model_path = proxy_model_path()
    if args.merge:
        args.record.note(merged=args.merge)
        print(merge(args.merge, args, argv))
        return None
    problems = load_problems(args)
    rows: list[dict] = []
    names = ["none"] * (not args.no_full) + [p for p in args.policies if p != "none"]
    if not args.fidelity_only:
        accuracy_pass(problems, names, args, argv, rows)
    if args.fidelity_n:
        fidelity_pass(problems[: args.fidelity_n], names, args, argv, rows)
    print(write_table(rows, args, argv))
    plot(rows, args)
    args.record.finish()
    return rows


def run_order(names, ratios):
    """(policy, ratio) runs: full KV first, then per ratio the Kara variants before the baselines
    (which take their per-sequence budgets from Kara's run at that ratio)."""
    runs = [("none", None)] * ("none" in names) + [
        (p, r) for r in ratios for p in names if p != "none"
    ]
    return sorted(runs, key=lambda pr: (pr[1] or 0, pr[0] not in ("kara", "none")))


def policy_options(name, ratio, args, kara_budget):
    """(engine options, per-request custom_params.kara or None) for one policy at one ratio;
    ``--kara-opt`` items go to every compressing policy."""
    opts, per_request = _policy_options(name, ratio, args, kara_budget)
    if name != "none":
        opts.update(kara_opts(getattr(args, "kara_opt", None)))
    return opts, per_request


def _policy_options(name, ratio, args, kara_budget):
    opts = dict(
        POLICIES[name],
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running,
    )
    if name == "none":
        return opts, None
    opts.update(kara_max_seqs=4096, kara_query_source="capture")
    if name.startswith("kara"):
        m = args.window - args.buffer
        k = max(1, math.ceil(round(ratio * m, 6)))
        # noT2C: 0
        chunk_budget = opts.pop("kara_chunk_budget", min(args.chunk_budget, k - 1))
        opts.update(
            kara_window=args.window,
            kara_buffer=args.buffer,
            kara_max_chunk=args.max_chunk,
            kara_period=1,
            kara_retention=ratio,
            kara_chunk_budget=chunk_budget,
        )
        return opts, None
    if ratio not in kara_budget:
        raise SystemExit(
            f"{name} at {ratio} needs a kara run at the same ratio first (budget matching)"
        )
    # Threshold baselines: the server-wide N only needs to be valid; each request's own budget
    # (custom_params.kara.budget) is Kara's, and the threshold keeps the gap W - U.
    policy = POLICIES[name]["kara_policy"]
    budget = max(args.buffer + 1, 2 * args.buffer)
    opts.update(
        {
            f"kara_{policy}_window": args.buffer,
            f"kara_{policy}_budget": budget,
            f"kara_{policy}_threshold": budget + trigger_gap(args),
        }
    )
    return opts, [{"budget": max(2, b)} for b in kara_budget[ratio]]


def accuracy_pass(problems, names, args, argv, rows):
    full_correct = None
    kara_budget: dict[float, list[int]] = {}
    for name, ratio in progress(
        run_order(names, args.ratios), "accuracy: policies x ratios"
    ):
        opts, per_request = policy_options(name, ratio, args, kara_budget)
        tic = time.perf_counter()
        outs = run_engine(
            args.model_path,
            opts,
            problems,
            per_request,
            args.omp_threads,
            record=args.record,
            label=name if ratio is None else f"{name} r={ratio}",
        )
        row, correct = summarize(name, ratio, outs, problems, full_correct)
        row["seconds"] = time.perf_counter() - tic
        if name == "none":
            full_correct = correct
        if name == "kara":
            kara_budget[ratio] = [baseline_budget(o["meta_info"], args) for o in outs]
        rows.append(row)
        write_table(rows, args, argv)
        print(
            f"{name:12s} r={ratio} acc {row['acc']:.3f} ({row['correct']}/{row['n']}) "
            f"peak KV {row['peak_kv']:.0f} mean KV {row['mean_kv']:.0f} gen {row['gen_len']:.0f}",
            flush=True,
        )


def fidelity_pass(problems, names, args, argv, rows):
    """Full KV records its per-step distributions, then every policy (full KV included, as a check
    that forcing is exact: agreement 1, KL 0) is fed the full-KV output (bench/quality/fidelity.py)."""
    import tempfile

    from bench.quality import fidelity

    ks = list(range(len(problems)))
    kara_budget: dict[float, list[int]] = {}

    def run(opts, per_request, forced, label):
        model, threads, record = args.model_path, args.omp_threads, args.record
        return run_engine(
            model, opts, problems, per_request, threads, forced, record, label
        )

    with tempfile.TemporaryDirectory(prefix="kara_fidelity_") as d:
        rec = [{"mode": "record", "dir": d, "k": k} for k in ks]
        opts, _ = policy_options("none", None, args, kara_budget)
        outs = run(opts, None, rec, "none")
        tokens = [o["output_ids"] for o in outs]
        roles = None
        words = [o["text"].split() for o in outs]
        # The proxy's tokenizer is word-level: a word per step (+ EOS), so roles align with steps.
        if not args.jsonl and all(
            len(t) - len(w) in (0, 1) for t, w in zip(tokens, words)
        ):
            from bench.quality import task

            roles = {k: task.token_roles(o["text"]) for k, o in enumerate(outs)}
        for name, ratio in progress(
            run_order(["none"] + names, args.ratios), "fidelity: policies x ratios"
        ):
            tag = f"{name}_{ratio}"
            forced = [
                {"mode": "force", "dir": d, "k": k, "tag": tag, "tokens": tokens[k]}
                for k in ks
            ]
            opts, per_request = policy_options(name, ratio, args, kara_budget)
            label = name if ratio is None else f"{name} r={ratio}"
            outs = run(opts, per_request, forced, label)
            if any(o["output_ids"] != t for o, t in zip(outs, tokens)):
                raise RuntimeError(
                    f"fidelity {tag}: a forced output differs from the full-KV output"
                )
            if name == "kara":
                kara_budget[ratio] = [
                    baseline_budget(o["meta_info"], args) for o in outs
                ]
            stats = fidelity.summarize(d, tag, ks, roles)
            row = next(
                (r for r in rows if r["policy"] == name and r["ratio"] == ratio), None
            )
            if row is None:
                rows.append(row := dict(policy=name, ratio=ratio))
            row.update(stats)
            write_table(rows, args, argv)
            print(
                f"{name:12s} r={ratio} next-token agreement {stats['agree']:.4f} KL {stats['kl']:.4f} "
                f"({stats['fid_tokens']} tokens)",
                flush=True,
            )


def progress(items, desc):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return items
    return tqdm(items, desc=desc)


def write_table(rows, args, argv):
    """Markdown + JSON of the rows so far (rewritten after every policy run); '-' where a row has
    no accuracy run or no fidelity run."""
    lines = [
        "| policy | retention | accuracy (95% CI) | correct / n | lost vs full | gained vs full "
        "| next-token agreement | KL (nats/token) | peak gen. KV | mean gen. KV | gen. length |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc = (
            (
                f"{r['acc']:.3f} ({r['lo']:.3f}-{r['hi']:.3f}) | {r['correct']}/{r['n']} | {r.get('lost', '-')} | "
                f"{r.get('gained', '-')}"
            )
            if "acc" in r
            else "- | - | - | -"
        )
        fid = f"{r['agree']:.4f} | {r['kl']:.4f}" if "agree" in r else "- | -"
        kv = (
            (f"{r['peak_kv']:.0f} | {r['mean_kv']:.0f} | {r['gen_len']:.0f}")
            if "acc" in r
            else "- | - | -"
        )
        lines.append(
            f"| {r['policy']} | {r['ratio'] if r['ratio'] is not None else '-'} | {acc} | {fid} | {kv} |"
        )
    fids = {r["fid_n"] for r in rows if "fid_n" in r}
    if fids:
        lines.append(
            f"\nFidelity on the first {'/'.join(map(str, sorted(fids)))} problems: the full-KV output "
            "fed through each policy; agreement = policy's greedy token equals full KV's."
        )
    with_roles = [r for r in rows if "disagree_by_role" in r]
    if with_roles:
        roles = sorted({role for r in with_roles for role in r["disagree_by_role"]})
        lines += [
            "",
            "Disagreement with full KV by token role (bench/quality/task.py token_roles), "
            "% of that role's steps (steps per role in the header):",
            "",
            "| policy | retention | "
            + " | ".join(
                f"{role} ({with_roles[0]['disagree_by_role'].get(role, [0, 0])[1]})"
                for role in roles
            )
            + " |",
            "|---|---|" + "---|" * len(roles),
        ]
        for r in with_roles:
            cells = [r["disagree_by_role"].get(role, [0, 0]) for role in roles]
            lines.append(
                f"| {r['policy']} | {r['ratio'] if r['ratio'] is not None else '-'} | "
                + " | ".join(f"{100 * d / max(1, n):.1f}" for d, n in cells)
                + " |"
            )
    table = "\n".join(lines)
    args.record.write_md(os.path.join(args.out, "quality.md"), table)
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
    panels = [
        (f, label)
        for f, label in (
            ("acc", "exact-answer accuracy"),
            ("agree", "next-token agreement with full KV"),
        )
        if any(f in r for r in rows)
    ]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(6 * len(panels), 4), squeeze=False
    )
    for ax, (field, label) in zip(axes[0], panels):
        for name in args.policies:
            if name == "none":
                continue
            pts = sorted(
                (r["ratio"], r[field])
                for r in rows
                if r["policy"] == name and field in r
            )
            ax.plot([p for p, _ in pts], [a for _, a in pts], marker="o", label=name)
        full = next(
            (r[field] for r in rows if r["policy"] == "none" and field in r), None
        )
        if full is not None:
            ax.axhline(full, color="k", linestyle="--", label="full KV")
        ax.set_xlabel("retention ratio (share of each window kept)")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "quality_vs_retention.png"), dpi=120)


if __name__ == "__main__":
    main()
