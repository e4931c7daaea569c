"""Stopping and length in free generation (``python -m bench.quality --real --stopping``).

The committed prompts (real_prompts.jsonl) are answered greedily with EOS allowed, up to
``--new-tokens``, with full KV and then with every policy and ratio (threshold baselines get
per-prompt budgets from Kara's run at the same ratio: equal peak generated KV, or with ``--match
mean`` equal mean generated KV over Kara's own length). Over the prompts whose full-KV answer
stops (EOS before ``--new-tokens``):

    still stops    the policy's answer stops too (EOS, any length)
    ends with full its EOS comes within +/-10% of full KV's length
    runaway        it runs to ``--new-tokens`` (the server pays for tokens full KV never made);
                   ``loops``: how many of those are in a repetition loop (real_lm.first_loop)
    length ratio   mean of its length / full KV's length; extra tokens: mean difference
    identical      the answer is full KV's, token for token

A compressed answer that loops until max_tokens costs a server more than the memory it saved.
Writes quality_stopping.md / .json under --out.
"""

from __future__ import annotations

import json
import os
import statistics
import time


def stopped(out, limit: int) -> bool:
    """Ended by EOS (or a stop string), not by the token limit."""
    return (out["meta_info"].get("finish_reason") or {}).get("type") == "stop"


def compare(full, outs, limit: int, tolerance: float = 0.1) -> dict:
    """Stopping stats of ``outs`` against full KV's outputs ``full`` (same prompts)."""
    idx = [i for i, o in enumerate(full) if stopped(o, limit)]
    n = len(idx)
    lf = [full[i]["meta_info"]["completion_tokens"] for i in idx]
    lp = [outs[i]["meta_info"]["completion_tokens"] for i in idx]
    stops = [stopped(outs[i], limit) for i in idx]
    row = dict(n_prompts=len(full), n_stop=n)
    if n:
        row.update(
            still_stops=sum(stops) / n,
            ends_with_full=sum(
                s and abs(b - a) <= tolerance * a for s, a, b in zip(stops, lf, lp)
            )
            / n,
            runaway=sum(not s for s in stops) / n,
            length_ratio=statistics.mean(b / a for a, b in zip(lf, lp)),
            extra_tokens=statistics.mean(b - a for a, b in zip(lf, lp)),
            identical=sum(outs[i]["output_ids"] == full[i]["output_ids"] for i in idx)
            / n,
            full_len=statistics.mean(lf),
            len=statistics.mean(lp),
            # runaway answers: where their first repetition loop starts (real_lm.first_loop), or None
            loops=sum(
                s is False and _loop(outs[i]) is not None for i, s in zip(idx, stops)
            ),
            per_prompt=[
                dict(
                    k=i,
                    full=a,
                    policy=b,
                    stops=s,
                    loop_at=None if s else _loop(outs[i]),
                    diverges_at=_diverges(full[i]["output_ids"], outs[i]["output_ids"]),
                )
                for i, a, b, s in zip(idx, lf, lp, stops)
            ],
        )
    row["runaway_all"] = sum(not stopped(o, limit) for o in outs) / len(outs)
    return row


def _loop(out):
    from bench.quality.real_lm import first_loop

    ids = out["output_ids"]
    at = first_loop(ids)
    return at if at < len(ids) else None


def _diverges(a, b):
    """First token where two answers differ (None: identical)."""
    for t, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return t
    return None if len(a) == len(b) else min(len(a), len(b))


def kv_stats(outs, problems) -> dict:
    metas = [o["meta_info"].get("kara") for o in outs]
    if not metas[0]:
        return {}
    prompt = [len(p["input_ids"]) for p in problems]
    return dict(
        peak_kv=statistics.mean(m["kv_peak_len"] - p for m, p in zip(metas, prompt)),
        mean_kv=statistics.mean(m["kv_mean_len"] - p for m, p in zip(metas, prompt)),
    )


def main(args, argv):
    from transformers import AutoTokenizer

    from bench.quality import real_lm

    if args.model_path is None:
        from sgl_kara.cpu.smollm2 import default_model_path

        args.model_path = default_model_path()
    os.makedirs(args.out, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.model_path)
    problems = real_lm.load_problems(args, tok)
    limit = args.new_tokens
    params = lambda i, p: {"max_new_tokens": limit, "temperature": 0.0}  # noqa: E731  (EOS allowed)
    tic = time.time()
    opts, _ = real_lm.engine_options("none", None, args)
    full = real_lm.run_engine(
        args.model_path,
        opts,
        problems,
        params,
        threads=args.omp_threads,
        record=args.record,
        label="none",
    )
    base = compare(full, full, limit)
    rows = [dict(policy="none", ratio=None, seconds=time.time() - tic, **base)]
    print(
        f"full KV: {base['n_stop']}/{len(full)} answers stop before {limit} tokens "
        f"(mean length {base.get('full_len', 0):.0f}; {time.time() - tic:.0f}s)",
        flush=True,
    )
    peaks, means, lens = {}, {}, {}
    gap = args.window - args.buffer
    for name, ratio in real_lm.run_order(args.policies, args.ratios, args.budget_from):
        t0 = time.time()
        opts, per_request = real_lm.engine_options(
            name, ratio, argparse_copy(args, match="peak"), peaks, means
        )
        if name in real_lm.THRESHOLD and args.match == "mean":
            floor = opts[f"kara_{real_lm.policy_spec(name)['kara_policy']}_budget"]
            per_request = [
                {"budget": real_lm.budget_for_mean(m, gap, max(1, n - 1), floor)}
                for m, n in zip(means[ratio], lens[ratio])
            ]
        outs = real_lm.run_engine(
            args.model_path,
            opts,
            problems,
            params,
            per_request,
            threads=args.omp_threads,
            record=args.record,
            label=f"{name} r={ratio}",
        )
        if name == args.budget_from:
            peaks[ratio] = real_lm.generated_kv(outs, problems, "kv_peak_len")
            means[ratio] = real_lm.generated_kv(outs, problems, "kv_mean_len")
            lens[ratio] = [o["meta_info"]["completion_tokens"] for o in outs]
        row = dict(policy=name, ratio=ratio, seconds=time.time() - t0)
        row.update(**compare(full, outs, limit), **kv_stats(outs, problems))
        if name in real_lm.THRESHOLD and args.match != "peak":
            row["match"] = args.match
        rows.append(row)
        write(rows, args, argv)
        print(
            f"{name:12s} r={ratio} still stops {row.get('still_stops', 0):.3f} ends with full "
            f"{row.get('ends_with_full', 0):.3f} runaway {row.get('runaway', 0):.3f} length ratio "
            f"{row.get('length_ratio', 0):.2f} ({row['seconds']:.0f}s)",
            flush=True,
        )
    write(rows, args, argv)
    return rows


def argparse_copy(args, **changes):
    import argparse

    return argparse.Namespace(**{**vars(args), **changes})


def write(rows, args, argv):
    head = (
        "| policy | retention | prompts stopping with full KV | still stop | end with full (±10%) | runaway "
        "| runaway in a loop | length ratio | extra tokens | identical | runaway (all prompts) | peak gen. KV "
        "| mean gen. KV |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def f(r, key, fmt):
        return format(r[key], fmt) if r.get(key) is not None else "-"

    for r in rows:
        name = r["policy"] + (f" ({r['match']}-matched)" if r.get("match") else "")
        lines.append(
            f"| {name} | {r['ratio'] if r['ratio'] is not None else '-'} | {r['n_stop']}/{r['n_prompts']} | "
            f"{f(r, 'still_stops', '.3f')} | {f(r, 'ends_with_full', '.3f')} | {f(r, 'runaway', '.3f')} | "
            f"{f(r, 'loops', 'd')} | "
            f"{f(r, 'length_ratio', '.2f')} | {f(r, 'extra_tokens', '.0f')} | {f(r, 'identical', '.3f')} | "
            f"{f(r, 'runaway_all', '.3f')} | {f(r, 'peak_kv', '.0f')} | {f(r, 'mean_kv', '.0f')} |"
        )
    args.record.write_md(
        os.path.join(args.out, "quality_stopping.md"), "\n".join(lines)
    )
    with open(os.path.join(args.out, "quality_stopping.json"), "w") as fh:
        saved = {k: v for k, v in vars(args).items() if k != "record"}
        json.dump({"rows": rows, "args": saved}, fh, indent=1)
    return "\n".join(lines)
