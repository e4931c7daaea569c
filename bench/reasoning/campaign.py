"""The long-answer comparison as one resumable plan: the dtype check, then every configuration of
both workloads, most informative first, one engine (model load) per configuration.

    OUT/dtype-check/float32/    full KV in float32 on the independent workload's first
                                ``--check-requests`` requests
    OUT/independent-<dtype>/    bench.reasoning.long_answers --workload independent
    OUT/chained-<dtype>/        bench.reasoning.long_answers --workload chained
    OUT/dtype-check/decision.md bfloat16 against float32 on the same problems, and the choice
    OUT/campaign.txt            what ran when

Order: independent full KV in bfloat16 (also the check's bfloat16 side), the check in float32, the
decision; then chained full KV, Kara and StreamingLLM (the workload where old generated content is
needed), independent Kara and StreamingLLM, then random and every other budget-taking policy
(registry order), chained before independent. With
``--dtype auto`` (default) the runs after the check are in bfloat16 when it passes
(``dtype_agreement``), else in float32 from full KV again. Every step is a child
``python -m bench.reasoning.long_answers`` that skips what its directory already holds, so
running the same command again resumes where it stopped.

The check's rule, fixed before it runs: bfloat16 serves the comparison when its right / wrong grade
equals float32's on at least ``AGREE`` of the problems both answered (at least ``MIN_PROBLEMS``
problems) -- the accuracy difference can then be at most 1 - AGREE.

    python -m bench.reasoning.campaign --model 1.5b --out bench/results/DATE-long-answers-qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.reasoning import configs, gsm8k

AGREE = 0.9
MIN_PROBLEMS = 50
FIRST = ("full", "kara", "streaming")


def dtype_agreement(a: dict, b: dict) -> dict:
    """Per problem of ``a``'s requests that ``b`` also answered (results of long_answers, same
    workload): grades equal, answers equal, accuracies; ``pass``: the rule above."""
    rows_b = {r["request"]: r for r in b["requests"]}
    same_grade = same_answer = n = right_a = right_b = 0
    for r in a["requests"]:
        other = rows_b.get(r["request"])
        if other is None:
            continue
        if other["problems"] != r["problems"]:
            raise ValueError(f"request {r['request']}: other problems in the two runs")
        for ca, cb, xa, xb in zip(
            r["correct"], other["correct"], r["answers"], other["answers"]
        ):
            n += 1
            same_grade += ca == cb
            same_answer += xa == xb
            right_a += ca
            right_b += cb
    return {
        "problems": n,
        "same_grade": same_grade,
        "same_answer": same_answer,
        "right_a": right_a,
        "right_b": right_b,
        "pass": n >= MIN_PROBLEMS and same_grade >= AGREE * n,
    }


def plan(first: tuple[str, ...] = FIRST) -> list[tuple[str, str]]:
    """(workload, configuration) after the dtype check, most informative first."""
    rest = ["random"] + [p for p in configs.budget_policies() if p not in first]
    return (
        [("chained", c) for c in first]
        + [("independent", c) for c in first if c != "full"]
        + [("chained", c) for c in rest]
        + [("independent", c) for c in rest]
    )


def log(out: str, message: str) -> None:
    line = f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC  {message}"
    print(line, flush=True)
    with open(os.path.join(out, "campaign.txt"), "a") as f:
        f.write(line + "\n")


def run(out: str, argv: list[str]) -> None:
    cmd = [sys.executable, "-m", "bench.reasoning.long_answers", *argv]
    log(out, "run: python -m bench.reasoning.long_answers " + " ".join(argv))
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        log(out, f"failed with exit status {proc.returncode}")
        raise SystemExit(proc.returncode)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.reasoning.campaign",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="1.5b")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    ap.add_argument("--check-requests", type=int, default=5)
    ap.add_argument(
        "--requests",
        type=int,
        default=None,
        help="independent: the first N requests (default: all, 150 problems in 15)",
    )
    ap.add_argument(
        "--chained-requests",
        type=int,
        default=15,
        help="chained: the first N requests of 12 problems (15: 180 graded problems)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=3072)
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="configurations to run (default: full, kara, random and every budget policy)",
    )
    ap.add_argument(
        "--extra",
        nargs=argparse.REMAINDER,
        default=[],
        help="further long_answers options for every step (last on the line)",
    )
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    common = ["--model", args.model, "--max-new-tokens", str(args.max_new_tokens)]
    common += args.extra
    requests = {"independent": args.requests, "chained": args.chained_requests}

    def cell(workload: str, config: str, dtype: str) -> None:
        if args.only and config not in args.only:
            return
        out = os.path.join(args.out, f"{workload}-{dtype}")
        run(
            args.out,
            [
                "--workload",
                workload,
                "--dtype",
                dtype,
                "--configs",
                config,
                "--out",
                out,
                *common,
                *(
                    ["--requests", str(requests[workload])]
                    if requests[workload]
                    else []
                ),
            ],
        )

    dtype = args.dtype
    if dtype in ("auto", "bfloat16"):
        cell("independent", "full", "bfloat16")
    if dtype == "auto":
        check = os.path.join(args.out, "dtype-check")
        f32 = os.path.join(check, "float32")
        run(
            args.out,
            [
                "--workload",
                "independent",
                "--dtype",
                "float32",
                "--configs",
                "full",
                "--out",
                f32,
                *common,
                "--requests",
                str(args.check_requests),
            ],
        )
        bf = gsm8k.load_result(os.path.join(args.out, "independent-bfloat16"), "full")
        fp = gsm8k.load_result(f32, "full")
        verdict = dtype_agreement(fp, bf)
        dtype = "bfloat16" if verdict["pass"] else "float32"
        verdict["chosen"] = dtype
        with open(os.path.join(check, "decision.json"), "w") as f:
            json.dump(verdict, f, indent=1)
        with open(os.path.join(check, "decision.md"), "w") as f:
            f.write(
                f"full KV, independent workload, requests 0-{args.check_requests - 1}: "
                f"{verdict['problems']} problems; right/wrong grade equal on "
                f"{verdict['same_grade']}, extracted answer equal on {verdict['same_answer']}; "
                f"right: float32 {verdict['right_a']}, bfloat16 {verdict['right_b']}. Rule: "
                f"bfloat16 when the grades agree on >= {AGREE:.0%} of >= {MIN_PROBLEMS} "
                f"problems. Chosen: {dtype}.\n"
            )
        log(args.out, f"dtype check: {verdict}")
        if dtype == "float32":
            cell("independent", "full", "float32")
    elif dtype == "float32":
        cell("independent", "full", "float32")
    for workload, config in plan():
        cell(workload, config, dtype)
    log(args.out, "all configurations done")


if __name__ == "__main__":
    main()
