"""Paired comparison of two policies' forced-output runs on the same full-KV record.

``python -m bench.quality --real --ref-dir DIR`` leaves one per-step file per policy row and prompt in DIR
(``<tag>_<k>.json``: agree / kl / nll lists, tag = ``<policy>_<ratio>[_mean]``). Both rows saw the
same prompts and the same forced tokens, so the difference is paired by prompt: per prompt, A's
agreement (KL) minus B's, then the mean over prompts with a 95% bootstrap interval over prompts
(prompts are the independent unit; steps within one output are not), and how many prompts A wins.

    python -m bench.quality.paired --dir REF_DIR kara_0.25:kara-noT2C_0.25 kara_0.25:kara-causal_0.25
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re


def per_prompt(directory: str, tag: str) -> dict[int, dict[str, float]]:
    """{k: {"agree": mean agreement, "kl": mean KL}} for every prompt k recorded under ``tag``."""
    pat = re.compile(re.escape(tag) + r"_(\d+)\.json$")
    out = {}
    for name in os.listdir(directory):
        m = pat.fullmatch(name)
        if m:
            with open(os.path.join(directory, name)) as f:
                st = json.load(f)
            out[int(m.group(1))] = {
                "agree": sum(st["agree"]) / len(st["agree"]),
                "kl": sum(st["kl"]) / len(st["kl"]),
            }
    return out


def bootstrap_mean(
    xs: list[float], reps: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, 2.5th, 97.5th percentile of the resampled means)."""
    rng = random.Random(seed)
    n = len(xs)
    means = sorted(sum(rng.choice(xs) for _ in range(n)) / n for _ in range(reps))
    return sum(xs) / n, means[int(0.025 * reps)], means[int(0.975 * reps) - 1]


def compare(directory: str, a: str, b: str) -> dict:
    pa, pb = per_prompt(directory, a), per_prompt(directory, b)
    ks = sorted(set(pa) & set(pb))
    if not ks:
        raise SystemExit(
            f"no prompt recorded under both {a!r} and {b!r} in {directory}"
        )
    row = {"a": a, "b": b, "n": len(ks)}
    for field in ("agree", "kl"):
        d = [pa[k][field] - pb[k][field] for k in ks]
        row[field] = bootstrap_mean(d)
        row[field + "_a_better"] = sum(x > 0 if field == "agree" else x < 0 for x in d)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dir", required=True, help="the --ref-dir of the quality runs")
    h = "two tags, e.g. kara_0.25:streaming_0.25_mean"
    ap.add_argument("pairs", nargs="+", metavar="A:B", help=h)
    args = ap.parse_args(argv)
    print(
        "| A | B | prompts | agreement A - B [95% CI] | A better (agreement) | KL A - B [95% CI] | A better (KL) |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = []
    for pair in args.pairs:
        if pair.count(":") != 1:
            raise SystemExit(f"pairs are A:B (got {pair!r})")
        r = compare(args.dir, *pair.split(":"))
        rows.append(r)
        (ma, la, ha), (mk, lk, hk) = r["agree"], r["kl"]
        print(
            f"| {r['a']} | {r['b']} | {r['n']} | {ma:+.4f} [{la:+.4f}, {ha:+.4f}] | {r['agree_a_better']}/{r['n']} "
            f"| {mk:+.4f} [{lk:+.4f}, {hk:+.4f}] | {r['kl_a_better']}/{r['n']} |"
        )
    return rows


if __name__ == "__main__":
    main()
