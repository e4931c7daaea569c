"""GSM8K accuracy under KV compression: full KV against Kara and every baseline, graded answers.

Each configuration answers the same GSM8K test problems (bench/reasoning/data.py: 100, verbatim,
with gold answers) through ``sgl_kara.Engine``: the model's chat template around the problem set's
own instruction (step by step, final number in ``\\boxed{}``), greedy, up to ``--max-new-tokens``
(EOS ends an answer), ``--max-running`` requests at once on a KV pool that holds them all
uncompressed (no retraction). The answer is the last ``\\boxed{}`` (else ``####``), compared
exactly with the gold number (bench/reasoning/grading.py).

Configurations (``--configs``; W, U, delta, r from the flags):

    full        --kara-policy none: plain SGLang, full KV
    kara        the paper's Kara: windows of W, buffer U, due every delta of a request's tokens, r
    kara-band   Kara with its recency band, --kara-recent R (--recent, default 2W)
    random      Kara's windows and schedule, random entries kept (same KV as kara by construction)
    snapkv, streaming, h2o, rkv
                threshold baselines at Kara's measured mean generated KV: per problem, the budget N
                whose threshold schedule (trigger gap W - U) has the mean generated KV Kara had on
                that problem over Kara's decode steps (bench/quality/real_lm.py: budget_for_mean);
                needs the kara run at the same ratio first

Every compressing configuration runs each event whole at its due step (``--kara-spread off``: the
paper's schedule) and scores from captured queries.

Reported per configuration: accuracy with a 95% Wilson interval; paired with full KV on the same
problems: problems won (policy right, full wrong) and lost, exact McNemar p; every other
compressing configuration also paired with Kara at its ratio the same way; mean and peak
generated KV per answer (``meta_info["kara"]`` kv_mean_len / kv_peak_len minus the prompt; full
KV: its length), answer length, truncated answers (hit ``--max-new-tokens``), answers without a
``\\boxed{}`` / ``####``, tokens per wall second and per CPU second of the engine's processes.

Resumable: each configuration's answers are appended to ``OUT/<name>.partial.jsonl`` as they
finish; a rerun skips the answered problems, and a configuration whose ``OUT/<name>.json`` exists is
not rerun. The table (``OUT/gsm8k.md`` and ``.json``) is rewritten after every configuration from
what OUT holds (``--report`` only rewrites it). The answer texts go to ``--answers-dir`` (default
OUT). ``OUT/run.json`` is the run record (bench/record.py; one per invocation: ``run.json``, then
``run-2.json`` ...).

    python -m bench.reasoning.gsm8k --model 0.5b --ratio 0.25 --out bench/results/DIR
    python -m bench.reasoning.gsm8k --model 0.5b --ratio 0.25 --configs full kara --n 8 --out /tmp/smoke
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import time

from bench.engine_run import engine_cpu_seconds
from bench.reasoning import stats
from bench.reasoning.grading import grade

CONFIGS = ("full", "kara", "kara-band", "random", "snapkv", "streaming", "h2o", "rkv")
THRESHOLD = ("snapkv", "streaming", "h2o", "rkv")
WHOLE_EVENTS = {
    "kara_spread": "off"
}  # each event whole at its due step: the paper's schedule


def result_name(config: str, ratio: float) -> str:
    return "full" if config == "full" else f"{config}_r{ratio:g}"


def model_path(name: str) -> str:
    """``0.5b`` / ``1.5b``: the converted Qwen2.5-Coder checkpoint (bench.models.qwen_coder);
    anything else: a model directory."""
    from bench.models import qwen_coder

    if name in qwen_coder.RECIPES:
        try:
            return str(qwen_coder.converted_path(name))
        except qwen_coder.ModelNotConverted as e:
            raise SystemExit(f"error: {e}") from None
    if not os.path.isdir(name):
        raise SystemExit(
            f"error: --model {name!r} is neither one of {', '.join(qwen_coder.RECIPES)} nor a directory"
        )
    return name


def threshold_budgets(kara_rows: list[dict], gap: int, floor: int) -> list[int]:
    """Per problem: the threshold baseline's budget N at Kara's measured mean generated KV over
    Kara's own decode steps (completion tokens - 1)."""
    from bench.quality.real_lm import budget_for_mean

    return [
        budget_for_mean(r["kv_mean"], gap, max(1, r["completion_tokens"] - 1), floor)
        for r in kara_rows
    ]


def engine_options(
    config: str, ratio: float, args, kara_rows: list[dict] | None = None
) -> tuple[dict, list | None]:
    """(sgl_kara.Engine keywords, per-request custom_params.kara or None)."""
    opts = dict(
        max_total_tokens=args.max_total_tokens, max_running_requests=args.max_running
    )
    if config == "full":
        return dict(opts, kara_policy="none"), None
    opts.update(kara_query_source="capture", **WHOLE_EVENTS)
    window = dict(
        window=args.window, buffer=args.buffer, period=args.period, retention=ratio
    )
    if config in ("kara", "kara-band"):
        opts.update(kara_policy="kara", **{f"kara_{k}": v for k, v in window.items()})
        if config == "kara-band":
            opts["kara_recent"] = args.recent
        return opts, None
    if config == "random":
        opts.update(
            kara_policy="random", **{f"kara_random_{k}": v for k, v in window.items()}
        )
        return opts, None
    if config not in THRESHOLD:
        raise ValueError(
            f"unknown configuration {config!r}: one of {', '.join(CONFIGS)}"
        )
    if kara_rows is None:
        raise SystemExit(
            f"{config} at r={ratio} needs the kara run at the same ratio first (budget matching)"
        )
    gap = args.window - args.buffer
    # R-KV keeps its own 8 observation queries
    w = 8 if config == "rkv" else args.buffer
    # the server-wide N only needs to be valid; every request brings its own
    floor = w + 8
    prefix = f"kara_{config}_"
    opts.update(
        {
            "kara_policy": config,
            prefix + "window": w,
            prefix + "budget": floor,
            prefix + "threshold": floor + gap,
        }
    )
    return opts, [{"budget": b} for b in threshold_budgets(kara_rows, gap, floor)]


def chat_prompts(messages: list[str], model: str) -> list[list[int]]:
    """Token ids of each message as the model's chat template puts a user turn."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    out = []
    for message in messages:
        text = tok.apply_chat_template(
            [{"role": "user", "content": message}],
            add_generation_prompt=True,
            tokenize=False,
        )
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


def problem_record(p: dict, out: dict, prompt_len: int, budget: int | None) -> dict:
    meta = out["meta_info"]
    g = int(meta["completion_tokens"])
    kara = meta.get("kara") or {}
    correct, answer = grade(out["text"], _fraction(p["gold"]))
    finish = meta.get("finish_reason") or {}
    rec = {
        "id": p["id"],
        "id_orig": p["id_orig"],
        "correct": bool(correct),
        "answer": answer,
        "gold": p["gold"],
        "prompt_tokens": prompt_len,
        "completion_tokens": g,
        "finish": finish.get("type"),
        "compressions": kara.get("compressions", 0),
        "text": out["text"],
    }
    if "kv_mean_len" in kara:
        rec["kv_peak"] = kara["kv_peak_len"] - prompt_len
        rec["kv_mean"] = kara["kv_mean_len"] - prompt_len
    else:  # full KV: what sgl_kara reports for a request it never compresses (peak g - 1, mean (g - 2) / 2)
        rec["kv_peak"] = max(0, g - 1)
        rec["kv_mean"] = max(0, g - 2) / 2
    if budget is not None:
        rec["budget"] = budget
    return rec


def _fraction(s: str):
    from fractions import Fraction

    return Fraction(s)


def run_config(
    config: str,
    ratio: float,
    problems: list[dict],
    prompts: list[list[int]],
    args,
    record,
    kara_rows: list[dict] | None,
) -> None:
    """Answer every problem not yet in OUT/<name>.partial.jsonl, appending each as it finishes."""
    from bench.engine_env import start_engine

    name = result_name(config, ratio)
    partial = os.path.join(args.out, name + ".partial.jsonl")
    done = {r["id"] for r in _read_jsonl(partial)}
    todo = [i for i, p in enumerate(problems) if p["id"] not in done]
    opts, per_request = engine_options(config, ratio, args, kara_rows)
    if not todo:
        return
    print(f"{name}: {len(todo)} of {len(problems)} problems to answer", flush=True)
    engine = start_engine(args.model_path, args.omp_threads, **opts)
    try:
        record.add_engine(name, engine)
        cpu0, tic = engine_cpu_seconds()[0], time.time()
        tokens = 0

        async def one(i: int, sink) -> None:
            nonlocal tokens
            sp = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0}
            if per_request is not None:
                sp["custom_params"] = {"kara": per_request[i]}
            out = await engine.async_generate(input_ids=prompts[i], sampling_params=sp)
            budget = per_request[i]["budget"] if per_request is not None else None
            rec = problem_record(problems[i], out, len(prompts[i]), budget)
            tokens += rec["completion_tokens"]
            sink.write(json.dumps(rec) + "\n")
            sink.flush()
            os.fsync(sink.fileno())

        async def all_of(sink) -> None:
            await asyncio.gather(*(one(i, sink) for i in todo))

        with open(partial, "a") as sink:
            engine.loop.run_until_complete(all_of(sink))
        seconds, cpu = time.time() - tic, engine_cpu_seconds()[0] - cpu0
        session = {"problems": len(todo), "tokens": tokens}
        session.update(seconds=round(seconds, 2), cpu_seconds=round(cpu, 2))
        with open(os.path.join(args.out, name + ".sessions.jsonl"), "a") as f:
            f.write(json.dumps(session) + "\n")
        print(
            f"{name}: {len(todo)} answers, {tokens} tokens in {seconds:.0f} s ({tokens / seconds:.1f} tok/s)",
            flush=True,
        )
    finally:
        engine.shutdown()


KEEP = "id correct answer completion_tokens finish compressions kv_peak kv_mean budget".split()


def finalize(config: str, ratio: float, problems: list[dict], args, opts: dict) -> dict:
    """OUT/<name>.json (settings, sessions, one line per problem: the fields in KEEP) and the
    answer texts in ANSWERS/<name>.answers.jsonl.gz (``--answers-dir``, default OUT), from the
    partial file once every problem is answered."""
    name = result_name(config, ratio)
    rows = {
        r["id"]: r for r in _read_jsonl(os.path.join(args.out, name + ".partial.jsonl"))
    }
    missing = [p["id"] for p in problems if p["id"] not in rows]
    if missing:
        raise RuntimeError(f"{name}: problems {missing[:10]} unanswered")
    ordered = [rows[p["id"]] for p in problems]
    write_answers(args.answers_dir or args.out, name, ordered, "id")
    sessions = _read_jsonl(os.path.join(args.out, name + ".sessions.jsonl"))
    result = {
        "config": config,
        "ratio": None if config == "full" else ratio,
        "name": name,
        "engine_options": opts,
        "max_new_tokens": args.max_new_tokens,
        "sessions": sessions,
        "problems": [{k: r[k] for k in KEEP if k in r} for r in ordered],
    }
    write_result(os.path.join(args.out, name + ".json"), result)
    os.remove(os.path.join(args.out, name + ".partial.jsonl"))
    return result


def write_answers(folder: str, name: str, rows: list[dict], key: str) -> None:
    """The answer texts, ``{key: row[key], "text": ...}`` a line, in FOLDER/<name>.answers.jsonl.gz."""
    os.makedirs(folder, exist_ok=True)
    with gzip.open(os.path.join(folder, name + ".answers.jsonl.gz"), "wt") as f:
        f.writelines(json.dumps({key: r[key], "text": r["text"]}) + "\n" for r in rows)


def write_result(path: str, result: dict, rows: str = "problems") -> None:
    """A result file: its settings indented, then one compact line per row of ``result[rows]``
    (per problem, per request): small and diffable; gzip-compressed when ``path`` ends in
    ``.gz``."""
    head = json.dumps({k: v for k, v in result.items() if k != rows}, indent=1)
    line = json.JSONEncoder(separators=(",", ":")).encode
    text = (
        (head[:-2] + "," if len(result) > 1 else "{")
        + f'\n "{rows}": [\n'
        + ",\n".join(map(line, result[rows]))
        + "\n ]\n}\n"
    )
    if path.endswith(".gz"):
        with gzip.GzipFile(path, "wb", mtime=0) as f:  # same content, same bytes
            f.write(text.encode())
    else:
        with open(path, "w") as f:
            f.write(text)


RESULT_SUFFIXES = (".json", ".json.gz")


def result_path(out: str, name: str) -> str | None:
    """The file of configuration ``name``'s result in ``out`` (``<name>.json`` or
    ``<name>.json.gz``; both is an error); None when it has none."""
    found = [
        os.path.join(out, name + s)
        for s in RESULT_SUFFIXES
        if os.path.exists(os.path.join(out, name + s))
    ]
    if len(found) > 1:
        raise ValueError(f"{out}: {name} has two result files {found}")
    return found[0] if found else None


def result_names(out: str, skip: tuple[str, ...]) -> list[str]:
    """The names of the result files in ``out`` (``.json`` or ``.json.gz``), sorted, less those
    starting with one of ``skip`` (run records, tables, workloads)."""
    names = set()
    for fname in os.listdir(out):
        if fname.startswith(skip):
            continue
        for s in RESULT_SUFFIXES:
            if fname.endswith(s):
                names.add(fname[: -len(s)])
    return sorted(names)


def read_result(path: str) -> dict:
    """A result file as ``write_result`` wrote it, plain or gzip-compressed."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return json.load(f)


def load_result(out: str, name: str) -> dict | None:
    path = result_path(out, name)
    return None if path is None else read_result(path)


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                try:
                    rows.append(json.loads(line))
                # a line cut by a kill: that problem is answered again
                except json.JSONDecodeError:
                    pass
    return rows


def _paired_with(reference: dict | None, probs: list[dict]) -> dict | None:
    """won / lost / McNemar p of ``probs`` against ``reference`` on the same problems, else None."""
    if reference is None:
        return None
    by_id = {r["id"]: r["correct"] for r in reference["problems"]}
    if set(by_id) != {r["id"] for r in probs}:
        return None
    return stats.paired([by_id[r["id"]] for r in probs], [r["correct"] for r in probs])


def summarize(
    result: dict, full: dict | None, max_new_tokens: int, kara: dict | None = None
) -> dict:
    """One table row; paired with ``full`` (every configuration but full) and with ``kara`` at
    the same ratio (every configuration but full and kara): ``kara_won`` = this one right, Kara
    wrong."""
    probs = result["problems"]
    n = len(probs)
    k = sum(r["correct"] for r in probs)
    lo, hi = stats.wilson(k, n)
    sessions = result.get("sessions") or []
    tokens = sum(s["tokens"] for s in sessions)
    seconds = sum(s["seconds"] for s in sessions)
    cpu = sum(s.get("cpu_seconds", 0) for s in sessions)
    row = {key: result[key] for key in ("name", "config", "ratio")}
    row.update(n=n, correct=k, acc=k / n, lo=lo, hi=hi)
    row |= {
        "kv_mean": sum(r["kv_mean"] for r in probs) / n,
        "kv_peak": sum(r["kv_peak"] for r in probs) / n,
        "kv_peak_max": max(r["kv_peak"] for r in probs),
        "answer_len": sum(r["completion_tokens"] for r in probs) / n,
        "truncated": sum(r["completion_tokens"] >= max_new_tokens for r in probs),
        "no_answer": sum(r["answer"] is None for r in probs),
        "compressed": sum(r["compressions"] > 0 for r in probs),
        "tok_s": tokens / seconds if seconds else None,
        "tok_cpu_s": tokens / cpu if cpu else None,
    }
    if "budget" in probs[0]:
        row["budget_mean"] = sum(r["budget"] for r in probs) / n
    if (
        result["config"] != "full"
        and (vs_full := _paired_with(full, probs)) is not None
    ):
        row.update(vs_full)
    if (
        result["config"] not in ("full", "kara")
        and (vs_kara := _paired_with(kara, probs)) is not None
    ):
        row.update(
            kara_won=vs_kara["won"],
            kara_lost=vs_kara["lost"],
            kara_p=vs_kara["mcnemar_p"],
        )
    return row


def report(args) -> list[dict]:
    """OUT/gsm8k.md and OUT/gsm8k.json from every finished configuration in OUT."""
    results = {}  # name -> finished result, each file read once
    for name in result_names(args.out, ("run", "gsm8k", "regrade")):
        res = load_result(args.out, name)
        if res is not None and "problems" in res:
            results[name] = res
    full = results.get("full")
    rows = []
    for res in results.values():
        r = res["ratio"]
        kara = None if r is None else results.get(result_name("kara", r))
        n = res.get("max_new_tokens", args.max_new_tokens)
        rows.append(summarize(res, full, n, kara))
    order = {c: i for i, c in enumerate(CONFIGS)}
    rows.sort(key=lambda r: (r["ratio"] or 0, order.get(r["config"], 99)))

    def fmt(v, spec, dash="-"):
        return dash if v is None else format(v, spec)

    head = (
        "| configuration | r | accuracy [95% CI] | won / lost vs full | McNemar p | won / lost vs Kara (p) "
        "| mean gen. KV | peak gen. KV | answer tokens | truncated | no answer | compressed | tok/s | tok/CPU-s |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        paired = f"{r['won']} / {r['lost']}" if "won" in r else "-"
        vs_kara = (
            f"{r['kara_won']} / {r['kara_lost']} ({r['kara_p']:.3f})"
            if "kara_won" in r
            else "-"
        )
        lines.append(
            f"| {r['config']} | {fmt(r['ratio'], 'g')} | {r['correct']}/{r['n']} = {r['acc']:.2f} "
            f"[{r['lo']:.2f}, {r['hi']:.2f}] | {paired} | {fmt(r.get('mcnemar_p'), '.3f')} | {vs_kara} | {r['kv_mean']:.0f} "
            f"| {r['kv_peak']:.0f} | {r['answer_len']:.0f} | {r['truncated']} | {r['no_answer']} | {r['compressed']} "
            f"| {fmt(r['tok_s'], '.1f')} | {fmt(r['tok_cpu_s'], '.1f')} |"
        )
    from bench.models.qwen_coder import RECIPES
    from bench.reasoning.long_answers import run_lines

    model = getattr(args, "model", None)
    if model in RECIPES:
        model = f"{RECIPES[model].upstream} (Q4_K_M GGUF, float32)"
    else:
        model = args.model_path
    runs, stamp_lines = run_lines(args.out, "bench.reasoning.gsm8k")
    with open(os.path.join(args.out, "gsm8k.md"), "w") as f:
        f.write(
            "\n".join(runs)
            + f"\n{stamp_lines}\nmodel: {model}\n\n"
            + "\n".join(lines)
            + "\n"
        )
    with open(os.path.join(args.out, "gsm8k.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n".join(lines), flush=True)
    return rows


def regrade(out: str) -> list[dict]:
    """Grade every configuration in ``out`` again with the grader of now, from the answer each
    problem's record keeps (the extracted ``\\boxed{}`` content: enough for a change in how that
    content reads, e.g. boxed working ``64 - 48 = 16``); rewrites ``correct`` in OUT/<name>.json
    and writes OUT/regrade.md (old and new per configuration)."""
    from fractions import Fraction

    from bench.reasoning import data
    from bench.reasoning.grading import to_number

    gold = {p["id"]: Fraction(p["gold"]) for p in data.load()}
    rows = []
    for name in result_names(out, ("run", "gsm8k", "regrade")):
        res = load_result(out, name)
        if res is None or "problems" not in res:
            continue
        old = new = gained = lost = 0
        for r in res["problems"]:
            value = to_number(r["answer"])
            now = value is not None and value == gold[r["id"]]
            old, new = old + r["correct"], new + now
            gained += now and not r["correct"]
            lost += r["correct"] and not now
            r["correct"] = bool(now)
        write_result(result_path(out, name), res)
        rows.append(
            dict(
                name=res["name"],
                n=len(res["problems"]),
                old=old,
                new=new,
                gained=gained,
                lost=lost,
            )
        )
        print(f"{res['name']}: {old} -> {new} right", flush=True)
    lines = [
        "Regraded from each problem's stored answer with bench/reasoning/grading.py of now.",
        "",
        "| configuration | graded | right before | right now | now right / now wrong |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['name']} | {r['n']} | {r['old']} | {r['new']} | +{r['gained']} / -{r['lost']} |"
        for r in rows
    ]
    with open(os.path.join(out, "regrade.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return rows


def _record_path(out: str) -> str:
    name, k = "run.json", 1
    while os.path.exists(os.path.join(out, name)):
        k += 1
        name = f"run-{k}.json"
    return name


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(
        prog="python -m bench.reasoning.gsm8k",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    arg = ap.add_argument
    h = (
        "0.5b / 1.5b (converted Qwen2.5-Coder, "
        "python -m bench.models.qwen_coder) or a model directory"
    )
    arg("--model", default="0.5b", help=h)
    arg("--out", required=True)
    arg("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    h = "retention r of the compressing configurations"
    arg("--ratio", type=float, default=0.25, help=h)
    arg("--n", type=int, default=100, help="the first N problems")
    h = (
        "a JSON-lines file of {question, answer ending '#### N'} "
        "instead of the GSM8K test problems"
    )
    arg("--problems", default=None, help=h)
    arg("--max-new-tokens", type=int, default=1024)
    arg("--max-running", type=int, default=16)
    h = "KV pool (default: max-running x (longest prompt + max-new-tokens) + 256: no retraction)"
    arg("--max-total-tokens", type=int, default=None, help=h)
    arg("--window", type=int, default=128)
    arg("--buffer", type=int, default=16)
    arg("--period", type=int, default=32)
    arg("--recent", type=int, default=None, help="kara-band's R (default 2W)")
    arg("--omp-threads", type=int, default=1)
    arg(
        "--answers-dir", default=None, help="where the answer texts go (default: --out)"
    )
    h = "only rewrite the table from what --out holds"
    arg("--report", action="store_true", help=h)
    h = (
        "grade every configuration in --out again from its stored answers "
        "(--out/regrade.md: old and new), then rewrite the table"
    )
    arg("--regrade", action="store_true", help=h)
    args = ap.parse_args(argv)
    args.recent = 2 * args.window if args.recent is None else args.recent
    os.makedirs(args.out, exist_ok=True)
    if args.regrade:
        regrade(args.out)
    # the table names the model; no need for its weights
    if args.report or args.regrade:
        args.model_path = args.model
        return report(args)
    args.model_path = model_path(args.model)

    from bench.reasoning import data
    from bench.record import RunRecord

    problems = (
        data.load_jsonl(args.problems, args.n) if args.problems else data.load(args.n)
    )
    prompts = chat_prompts(
        [f"{p['instruction']}\n\n{p['question']}" for p in problems], args.model_path
    )
    if args.max_total_tokens is None:
        args.max_total_tokens = (
            args.max_running * (max(map(len, prompts)) + args.max_new_tokens) + 256
        )
    record = RunRecord(args.out, argv, name=_record_path(args.out))
    keys = (
        "model max_new_tokens max_running max_total_tokens ratio window buffer period"
    )
    record.note(
        problems=len(problems),
        source=args.problems or f"{data.PACKAGE}=={data.VERSION}",
        **{k: getattr(args, k) for k in keys.split() + ["recent"]},
        whole_events=WHOLE_EVENTS,
        omp_threads=args.omp_threads,
    )
    # kara before the baselines
    order = sorted(args.configs, key=lambda c: (c in THRESHOLD, CONFIGS.index(c)))
    for config in order:
        name = result_name(config, args.ratio)
        if load_result(args.out, name) is not None:
            print(f"{name}: done earlier ({name}.json)", flush=True)
            continue
        kara = None
        if config in THRESHOLD:
            kara = load_result(args.out, result_name("kara", args.ratio))
        kara_rows = kara["problems"] if kara else None
        ids = [p["id"] for p in problems]
        if kara_rows is not None and [r["id"] for r in kara_rows] != ids:
            raise SystemExit(
                f"{config}: the kara run in {args.out} answered other problems"
            )
        run_config(config, args.ratio, problems, prompts, args, record, kara_rows)
        opts = engine_options(config, args.ratio, args, kara_rows)[0]
        finalize(config, args.ratio, problems, args, opts)
        report(args)
    record.finish()
    return report(args)


if __name__ == "__main__":
    main()
