"""Reasoning accuracy on long answers: several GSM8K problems per request, graded per problem.

The workload (bench/reasoning/workload.py): the 100 GSM8K test problems (bench/reasoning/data.py),
shuffled with ``--seed`` and cut into requests of ``--per-request`` problems, each request one
chat message asking for the problems in order, each with its ``Problem i:`` heading and its
``\\boxed{}`` answer. One answer is ~200 tokens a problem (Qwen2.5-Coder-1.5B), so a request of
10 problems answers in ~2,000 tokens, long enough for Kara at W 256 / U 32 / r 0.2 to end its
answer holding about a third of its generated KV, and the problems answered late are answered over
a cache already cut several times.

Configurations (``--configs``; W, U, delta, r from the flags; greedy; every compressing one runs
each event whole at its due step and scores from captured queries, as bench/reasoning/gsm8k.py):

    full              --kara-policy none: full KV
    kara              Kara at W, U, delta, r (alpha, gamma: the paper's defaults)
    random            Kara's windows and schedule, random entries kept (Kara's KV by construction,
                      so matched at mean and at final KV at once)
    kara-band         Kara with its recency band R (--recent) at the lower --band-ratio on the older
                      windows: chosen so its mean KV equals Kara's (the band traded at equal KV)
    snapkv, streaming, h2o, rkv
                      threshold baselines (trigger gap W - U) at Kara's mean generated KV per
                      request: budget N whose schedule has Kara's mean over Kara's decode steps
                      (bench/quality/real_lm.py: budget_for_mean)
    snapkv-final, streaming-final, h2o-final, rkv-final
                      the same at Kara's final generated KV per request: N + gap/2 + 1 (the middle
                      of the threshold's sawtooth, where it ends on average) = Kara's final KV

Reported per configuration (OUT/long_answers.md and .json): problems right with a 95% Wilson
interval; paired per problem with full KV and with Kara (won / lost, exact McNemar p); generated KV
per request -- final (when the answer ends), mean over the answer -- and as retention: the same
divided by what full KV holds for that answer (final: tokens - 1; mean: (tokens - 2) / 2), the
mean over requests and the largest; answer tokens; truncated answers; problems without an
answer; accuracy on the first problems of each request against the later ones; tokens per second.

Resumable per request: answers are appended to ``OUT/<name>.partial.jsonl`` as they finish; a
rerun answers the rest; a configuration whose ``OUT/<name>.json`` exists is not rerun (one
engine per configuration). ``OUT/run.json`` (then ``run-2.json`` ...) is the run record.

    python -m bench.reasoning.long_answers --model 1.5b --dtype bfloat16 --out bench/results/DIR
    python -m bench.reasoning.long_answers --model 1.5b --configs full kara --requests 2 --out /tmp/x
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import sys
import time
from fractions import Fraction

from bench.reasoning import gsm8k, stats, workload

THRESHOLD = ("snapkv", "streaming", "h2o", "rkv")
FINAL = tuple(f"{b}-final" for b in THRESHOLD)
CONFIGS = ("full", "kara", "random", "kara-band", *THRESHOLD, *FINAL)


def result_name(config: str, args) -> str:
    if config == "full":
        return "full"
    if config == "kara-band":
        return f"kara-band{args.recent}_r{args.band_ratio:.3g}"
    return f"{config}_r{args.ratio:g}"


def final_budget(final: float, gap: int, floor: int) -> int:
    """Threshold budget N whose sawtooth (N + 1 .. N + gap + 1 once it compresses) has ``final``
    in its middle: the generated KV the policy ends an answer with, on average over where in its
    cycle the answer ends."""
    return max(floor, round(final - gap / 2 - 1))


def kara_replay(
    tokens: int, window: int, buffer: int, period: int, keep: int, recent: int = 0
) -> tuple[int, float]:
    """(final, mean) generated KV of Kara's schedule over an answer of ``tokens`` tokens, as the
    runtime measures them (the length at each decode step before its event and token; the first
    token comes from prefill): every ``period`` steps the oldest window [f, f + W), once it is
    followed by ``recent`` newer rows, has its first W - U rows cut to ``keep``."""
    length = frontier = total = 0
    for step in range(1, tokens):
        total += length
        if step % period == 0 and length - frontier >= window + recent:
            length -= window - buffer - keep
            frontier += keep
        length += 1
    return length, total / max(1, tokens - 1)


def band_ratio_at_equal_kv(kara_rows: list[dict], args) -> float:
    """The retention r' = K / (W - U) of the band's older windows whose replayed mean generated KV
    over Kara's answers (their lengths) is closest to Kara's measured mean (sums over requests)."""
    m = args.window - args.buffer
    target = sum(r["kv_mean"] for r in kara_rows)

    def replayed(keep: int) -> float:
        return sum(
            kara_replay(
                r["completion_tokens"],
                args.window,
                args.buffer,
                args.period,
                keep,
                args.recent,
            )[1]
            for r in kara_rows
        )

    best = min(range(1, m + 1), key=lambda k: abs(replayed(k) - target))
    return best / m


def engine_options(config: str, args, kara_rows: list[dict] | None):
    """(sgl_kara.Engine keywords, per-request custom_params.kara or None)."""
    base = config.removesuffix("-final")
    if config == "kara-band":
        opts, per = gsm8k.engine_options("kara-band", args.band_ratio, args)
    else:
        rows = None
        if base in THRESHOLD:
            if kara_rows is None:
                raise SystemExit(
                    f"{config} needs the kara run at r={args.ratio:g} first (budget matching)"
                )
            # gsm8k.threshold_budgets reads kv_mean and completion_tokens per row
            rows = kara_rows
        opts, per = gsm8k.engine_options(base, args.ratio, args, rows)
        if config != base:
            gap, floor = args.window - args.buffer, opts[f"kara_{base}_budget"]
            per = [
                {"budget": final_budget(r["kv_final"], gap, floor)} for r in kara_rows
            ]
    opts["dtype"] = args.dtype
    return opts, per


def request_record(problems: list[dict], out: dict, prompt_len: int, budget) -> dict:
    meta = out["meta_info"]
    g = int(meta["completion_tokens"])
    kara = meta.get("kara") or {}
    graded = workload.grade_request(
        out["text"], [Fraction(p["gold"]) for p in problems]
    )
    rec = {
        "problems": [p["id"] for p in problems],
        "correct": [bool(c) for c, _ in graded],
        "answers": [a for _, a in graded],
        "prompt_tokens": prompt_len,
        "completion_tokens": g,
        "finish": (meta.get("finish_reason") or {}).get("type"),
        "compressions": kara.get("compressions", 0),
        "text": out["text"],
    }
    if "kv_mean_len" in kara:
        rec["kv_final"] = kara["kv_physical_len"] - prompt_len
        rec["kv_peak"] = kara["kv_peak_len"] - prompt_len
        rec["kv_mean"] = kara["kv_mean_len"] - prompt_len
    else:  # full KV, as sgl_kara reports a request it never compresses
        rec["kv_final"] = rec["kv_peak"] = max(0, g - 1)
        rec["kv_mean"] = max(0, g - 2) / 2
    if budget is not None:
        rec["budget"] = budget
    return rec


def chat_prompts(requests: list[list[dict]], model: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    out = []
    for probs in requests:
        text = tok.apply_chat_template(
            [{"role": "user", "content": workload.message(probs)}],
            add_generation_prompt=True,
            tokenize=False,
        )
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


def run_config(config, requests, prompts, args, record, kara_rows) -> None:
    """Answer every request not yet in OUT/<name>.partial.jsonl, appending each as it finishes."""
    import sgl_kara
    from bench.engine_env import engine_env

    name = result_name(config, args)
    partial = os.path.join(args.out, name + ".partial.jsonl")
    done = {r["request"] for r in gsm8k._read_jsonl(partial)}
    todo = [i for i in range(len(requests)) if i not in done]
    if not todo:
        return
    opts, per_request = engine_options(config, args, kara_rows)
    print(f"{name}: {len(todo)} of {len(requests)} requests to answer", flush=True)
    with engine_env(args.omp_threads):
        engine = sgl_kara.Engine(
            model_path=args.model_path,
            log_level="error",
            random_seed=0,
            disable_overlap_schedule=True,
            **opts,
        )
    try:
        record.add_engine(name, engine)
        cpu0, tic = gsm8k.engine_cpu_seconds(), time.time()
        tokens = 0

        async def one(i: int, sink) -> None:
            nonlocal tokens
            sp = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0}
            if per_request is not None:
                sp["custom_params"] = {"kara": per_request[i]}
            out = await engine.async_generate(input_ids=prompts[i], sampling_params=sp)
            rec = request_record(
                requests[i],
                out,
                len(prompts[i]),
                per_request[i]["budget"] if per_request is not None else None,
            )
            rec["request"] = i
            tokens += rec["completion_tokens"]
            sink.write(json.dumps(rec) + "\n")
            sink.flush()
            os.fsync(sink.fileno())
            print(
                f"{name}: request {i} done: {rec['completion_tokens']} tokens, "
                f"{sum(rec['correct'])}/{len(rec['correct'])} right, KV final "
                f"{rec['kv_final']:.0f} mean {rec['kv_mean']:.0f} "
                f"({time.time() - tic:.0f} s)",
                flush=True,
            )

        async def all_of(sink) -> None:
            await asyncio.gather(*(one(i, sink) for i in todo))

        with open(partial, "a") as sink:
            engine.loop.run_until_complete(all_of(sink))
        seconds, cpu = time.time() - tic, gsm8k.engine_cpu_seconds() - cpu0
        with open(os.path.join(args.out, name + ".sessions.jsonl"), "a") as f:
            f.write(
                json.dumps(
                    {
                        "requests": len(todo),
                        "tokens": tokens,
                        "seconds": round(seconds, 2),
                        "cpu_seconds": round(cpu, 2),
                    }
                )
                + "\n"
            )
        print(
            f"{name}: {len(todo)} answers, {tokens} tokens in {seconds:.0f} s "
            f"({tokens / seconds:.1f} tok/s)",
            flush=True,
        )
    finally:
        engine.shutdown()


KEEP = (
    "request",
    "problems",
    "correct",
    "answers",
    "completion_tokens",
    "finish",
    "compressions",
    "kv_final",
    "kv_peak",
    "kv_mean",
    "budget",
)


def finalize(config, requests, args, opts) -> dict:
    """OUT/<name>.json (settings, sessions, one line per request) and the answer texts in
    ANSWERS/<name>.answers.jsonl.gz, once every request is answered."""
    name = result_name(config, args)
    partial = os.path.join(args.out, name + ".partial.jsonl")
    rows = {r["request"]: r for r in gsm8k._read_jsonl(partial)}
    missing = [i for i in range(len(requests)) if i not in rows]
    if missing:
        raise RuntimeError(f"{name}: requests {missing} unanswered")
    ordered = [rows[i] for i in range(len(requests))]
    answers = args.answers_dir or args.out
    os.makedirs(answers, exist_ok=True)
    with gzip.open(os.path.join(answers, name + ".answers.jsonl.gz"), "wt") as f:
        for r in ordered:
            f.write(json.dumps({"request": r["request"], "text": r["text"]}) + "\n")
    result = {
        "config": config,
        "name": name,
        "ratio": None if config == "full" else args.ratio,
        "engine_options": opts,
        "max_new_tokens": args.max_new_tokens,
        "sessions": gsm8k._read_jsonl(os.path.join(args.out, name + ".sessions.jsonl")),
        "requests": [{k: r[k] for k in KEEP if k in r} for r in ordered],
    }
    head = json.dumps({k: v for k, v in result.items() if k != "requests"}, indent=1)
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        f.write(
            head[:-2]
            + ',\n "requests": [\n'
            + ",\n".join(json.dumps(r) for r in result["requests"])
            + "\n ]\n}\n"
        )
    os.remove(partial)
    return result


def per_problem(result: dict) -> dict[int, tuple[bool, int]]:
    """problem id -> (correct, position in its request, from 1)."""
    out = {}
    for r in result["requests"]:
        for pos, (pid, ok) in enumerate(zip(r["problems"], r["correct"]), 1):
            out[pid] = (ok, pos)
    return out


def _paired(reference: dict | None, mine: dict[int, tuple[bool, int]]) -> dict | None:
    if reference is None:
        return None
    ref = per_problem(reference)
    if set(ref) != set(mine):
        return None
    ids = sorted(mine)
    return stats.paired([ref[i][0] for i in ids], [mine[i][0] for i in ids])


def summarize(result: dict, full: dict | None, kara: dict | None, early: int) -> dict:
    """One table row."""
    reqs = result["requests"]
    probs = per_problem(result)
    n, k = len(probs), sum(ok for ok, _ in probs.values())
    lo, hi = stats.wilson(k, n)
    first = [ok for ok, pos in probs.values() if pos <= early]
    later = [ok for ok, pos in probs.values() if pos > early]
    final_ret = [r["kv_final"] / max(1, r["completion_tokens"] - 1) for r in reqs]
    mean_ret = [r["kv_mean"] / max(1, (r["completion_tokens"] - 2) / 2) for r in reqs]
    sessions = result.get("sessions") or []
    tokens = sum(s["tokens"] for s in sessions)
    seconds = sum(s["seconds"] for s in sessions)
    row = {
        "name": result["name"],
        "config": result["config"],
        "ratio": result["ratio"],
        "budget_ratio": result.get("engine_options", {}).get("kara_retention"),
        "requests": len(reqs),
        "n": n,
        "correct": k,
        "acc": k / n,
        "lo": lo,
        "hi": hi,
        "acc_first": sum(first) / len(first) if first else None,
        "acc_later": sum(later) / len(later) if later else None,
        "kv_final": sum(r["kv_final"] for r in reqs) / len(reqs),
        "kv_mean": sum(r["kv_mean"] for r in reqs) / len(reqs),
        "ret_final": sum(final_ret) / len(reqs),
        "ret_final_max": max(final_ret),
        "ret_mean": sum(mean_ret) / len(reqs),
        "answer_len": sum(r["completion_tokens"] for r in reqs) / len(reqs),
        "answer_min": min(r["completion_tokens"] for r in reqs),
        "answer_max": max(r["completion_tokens"] for r in reqs),
        "truncated": sum(r["finish"] == "length" for r in reqs),
        "no_answer": sum(a is None for r in reqs for a in r["answers"]),
        "tok_s": tokens / seconds if seconds else None,
    }
    if full is not None:
        fr = {r["request"]: r for r in full["requests"]}
        same = [r for r in reqs if r["request"] in fr]
        if same:  # generated KV against full KV's own answers to the same requests
            full_final = sum(fr[r["request"]]["kv_final"] for r in same)
            full_mean = sum(fr[r["request"]]["kv_mean"] for r in same)
            row["vs_full_final"] = sum(r["kv_final"] for r in same) / full_final
            row["vs_full_mean"] = sum(r["kv_mean"] for r in same) / full_mean
    if result["config"] != "full" and (p := _paired(full, probs)) is not None:
        row.update(p)
        ref = per_problem(full)  # the lost problems by where they sit in their request
        lost = [pos for i, (ok, pos) in probs.items() if ref[i][0] and not ok]
        row["lost_first"] = sum(pos <= early for pos in lost)
        row["lost_later"] = len(lost) - row["lost_first"]
    if (
        result["config"] not in ("full", "kara")
        and (p := _paired(kara, probs)) is not None
    ):
        row.update(kara_won=p["won"], kara_lost=p["lost"], kara_p=p["mcnemar_p"])
    return row


def regrade(args) -> None:
    """Grade every finished configuration in OUT again from its answer texts (``--answers-dir``):
    rewrites ``correct`` and ``answers`` in OUT/<name>.json after a change of the grader."""
    from bench.reasoning import data

    gold = {p["id"]: Fraction(p["gold"]) for p in data.load()}
    for fname in sorted(os.listdir(args.out)):
        path = os.path.join(
            args.answers_dir or args.out, fname[:-5] + ".answers.jsonl.gz"
        )
        if not fname.endswith(".json") or not os.path.exists(path):
            continue
        with open(os.path.join(args.out, fname)) as fh:
            text = fh.read()
        with gzip.open(path, "rt") as fh:
            texts = {r["request"]: r["text"] for r in map(json.loads, fh)}
        before = after = 0
        for line in text.splitlines():
            if not line.startswith('{"request"'):
                continue
            r = json.loads(line.rstrip(","))
            graded = workload.grade_request(
                texts[r["request"]], [gold[i] for i in r["problems"]]
            )
            new = dict(
                r, correct=[c for c, _ in graded], answers=[a for _, a in graded]
            )
            before, after = before + sum(r["correct"]), after + sum(new["correct"])
            text = text.replace(line.rstrip(","), json.dumps(new), 1)
        with open(os.path.join(args.out, fname), "w") as fh:
            fh.write(text)
        print(f"{fname[:-5]}: {before} -> {after} right", flush=True)


def report(args) -> list[dict]:
    """OUT/long_answers.md and .json from every finished configuration in OUT."""
    results = {}
    for fname in sorted(os.listdir(args.out)):
        if fname.endswith(".json") and not fname.startswith(("run", "long_answers")):
            res = gsm8k.load_result(args.out, fname[:-5])
            if res is not None and "requests" in res:
                results[fname[:-5]] = res
    full = results.get("full")
    rows = []
    for res in results.values():
        kara = results.get(f"kara_r{res['ratio']:g}") if res["ratio"] else None
        rows.append(summarize(res, full, kara, args.early))
    order = {c: i for i, c in enumerate(CONFIGS)}
    rows.sort(key=lambda r: (r["ratio"] or 0, order.get(r["config"], 99)))

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    head = (
        "| configuration | problems right [95% CI] | won / lost vs full (McNemar p) "
        "| won / lost vs Kara (p) | final gen. KV (retention, max) | mean gen. KV (retention) "
        "| KV vs full's answers: final / mean | first / later problems right (lost vs full) "
        "| answer tokens (min-max) | truncated | no answer | tok/s |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        label = r["config"] + (f" r {r['ratio']:g}" if r["ratio"] else "")
        if r["config"] == "kara-band":
            label = f"kara-band R {args.recent} r {r['budget_ratio']:.3g}"
        vs_full = (
            f"{r['won']} / {r['lost']} ({r['mcnemar_p']:.3f})" if "won" in r else "-"
        )
        vs_kara = (
            f"{r['kara_won']} / {r['kara_lost']} ({r['kara_p']:.3f})"
            if "kara_won" in r
            else "-"
        )
        vs = (
            f"{r['vs_full_final']:.2f} / {r['vs_full_mean']:.2f}"
            if "vs_full_final" in r
            else "-"
        )
        lost = f" ({r['lost_first']} / {r['lost_later']})" if "lost_first" in r else ""
        lines.append(
            f"| {label} | {r['correct']}/{r['n']} = {r['acc']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}] "
            f"| {vs_full} | {vs_kara} | {r['kv_final']:.0f} ({r['ret_final']:.2f}, {r['ret_final_max']:.2f}) "
            f"| {r['kv_mean']:.0f} ({r['ret_mean']:.2f}) | {vs} "
            f"| {f(r['acc_first'], '.2f')} / {f(r['acc_later'], '.2f')}{lost} "
            f"| {r['answer_len']:.0f} ({r['answer_min']}-{r['answer_max']}) | {r['truncated']} "
            f"| {r['no_answer']} | {f(r['tok_s'], '.1f')} |"
        )
    # problems right by position in the request (1 = answered first)
    positions = {}
    for res in results.values():
        by = {}
        for ok, pos in per_problem(res).values():
            by.setdefault(pos, []).append(ok)
        positions[res["name"]] = by
    k = max((max(by) for by in positions.values() if by), default=0)
    lines += [
        "",
        "| problems right at position | "
        + " | ".join(map(str, range(1, k + 1)))
        + " |",
        "|" + "---|" * (k + 1),
    ]
    for r in rows:
        by = positions[r["name"]]
        lines.append(
            f"| {r['name']} | "
            + " | ".join(
                f"{sum(by.get(i, []))}/{len(by.get(i, []))}" for i in range(1, k + 1)
            )
            + " |"
        )
    from bench.record import stamp

    runs = []
    for fname in sorted(os.listdir(args.out), key=lambda n: (len(n), n)):
        if fname.startswith("run") and fname.endswith(".json"):
            with open(os.path.join(args.out, fname)) as fh:
                rec = json.load(fh)
            runs.append(f"command: {rec['command']}  ({fname}, {rec['date'][:10]})")
    runs = runs or [
        "command: "
        + " ".join(["python -m bench.reasoning.long_answers", *sys.argv[1:]])
    ]
    with open(os.path.join(args.out, "long_answers.md"), "w") as fh:
        fh.write(
            "\n".join(runs)
            + f"\n{stamp()}\nmodel: {args.model} ({args.dtype})\n"
            + f"first problems: positions 1-{args.early} of each request\n\n"
            + "\n".join(lines)
            + "\n"
        )
    with open(os.path.join(args.out, "long_answers.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    print("\n".join(lines), flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(
        prog="python -m bench.reasoning.long_answers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="1.5b", help="0.5b / 1.5b or a model directory")
    ap.add_argument(
        "--dtype", default="bfloat16", help="weights and KV: bfloat16 / float32"
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS[:8]), choices=CONFIGS)
    ap.add_argument("--ratio", type=float, default=0.2, help="Kara's r")
    ap.add_argument("--per-request", type=int, default=10, help="problems per request")
    ap.add_argument("--seed", type=int, default=0, help="shuffle of the problems")
    ap.add_argument("--n", type=int, default=100, help="the first N GSM8K problems")
    ap.add_argument(
        "--requests", type=int, default=None, help="only the first N requests"
    )
    ap.add_argument(
        "--early", type=int, default=3, help="'first problems': positions 1..E"
    )
    ap.add_argument("--max-new-tokens", type=int, default=4096)
    ap.add_argument(
        "--max-running", type=int, default=None, help="default: all requests"
    )
    ap.add_argument("--max-total-tokens", type=int, default=None)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--buffer", type=int, default=32)
    ap.add_argument("--period", type=int, default=32)
    ap.add_argument(
        "--recent",
        type=int,
        default=64,
        help="kara-band's R (on ~2,000-token answers at W 256 / r 0.2, R 64 leaves the older "
        "windows r 0.14 at Kara's mean KV, R 128 r 0.07)",
    )
    ap.add_argument(
        "--band-ratio",
        type=float,
        default=None,
        help="kara-band's r on older windows (default: Kara's mean KV, by replay of the kara run)",
    )
    ap.add_argument("--omp-threads", type=int, default=2)
    ap.add_argument("--answers-dir", default=None)
    ap.add_argument("--report", action="store_true", help="only rewrite the table")
    ap.add_argument(
        "--regrade",
        action="store_true",
        help="grade the finished configurations again from their answer texts, then --report",
    )
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    args.model_path = gsm8k.model_path(args.model)
    if args.regrade:
        regrade(args)
    if args.report or args.regrade:
        return report(args)

    from bench.reasoning import data
    from bench.record import RunRecord

    requests = workload.group(data.load(args.n), args.per_request, args.seed)
    if args.requests:
        requests = requests[: args.requests]
    prompts = chat_prompts(requests, args.model_path)
    if args.max_running is None:
        args.max_running = len(requests)
    if args.max_total_tokens is None:
        args.max_total_tokens = (
            args.max_running * (max(map(len, prompts)) + args.max_new_tokens) + 256
        )
    record = RunRecord(args.out, argv, name=gsm8k._record_path(args.out))
    record.note(
        workload=f"GSM8K test problems ({data.PACKAGE}=={data.VERSION}), {args.per_request} "
        f"per request, shuffle seed {args.seed}",
        requests=len(requests),
        problems=sum(map(len, requests)),
        prompt_tokens=[len(p) for p in prompts],
        **{
            k: getattr(args, k)
            for k in (
                "model",
                "dtype",
                "max_new_tokens",
                "max_running",
                "max_total_tokens",
                "ratio",
                "window",
                "buffer",
                "period",
                "recent",
                "band_ratio",
                "omp_threads",
            )
        },
        whole_events=gsm8k.WHOLE_EVENTS,
    )
    order = sorted(
        args.configs,
        key=lambda c: (c.removesuffix("-final") in THRESHOLD, CONFIGS.index(c)),
    )
    for config in order:
        kara = gsm8k.load_result(args.out, f"kara_r{args.ratio:g}")
        kara_rows = kara["requests"] if kara else None
        if kara_rows is not None and len(kara_rows) != len(requests):
            raise SystemExit(
                f"{config}: the kara run in {args.out} answered other requests"
            )
        if config == "kara-band" and args.band_ratio is None:
            if kara_rows is None:
                raise SystemExit("kara-band at Kara's KV needs the kara run first")
            args.band_ratio = band_ratio_at_equal_kv(kara_rows, args)
            print(f"kara-band: r {args.band_ratio:.4f} on older windows", flush=True)
        name = result_name(config, args)
        if gsm8k.load_result(args.out, name) is not None:
            print(f"{name}: done earlier ({name}.json)", flush=True)
            continue
        run_config(config, requests, prompts, args, record, kara_rows)
        finalize(config, requests, args, engine_options(config, args, kara_rows)[0])
        report(args)
    record.finish()
    return report(args)


if __name__ == "__main__":
    main()
