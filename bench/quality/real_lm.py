"""Quality on a real LM (``python -m bench.quality --real``): fidelity to full KV, through the runtime.

The default model (SmolLM2-135M-Instruct) answers the committed prompts (real_prompts.jsonl: 48
prompts asking for long answers) with full KV; EOS is suppressed for ``--new-tokens`` so every
output has that length. Greedy by default; ``--decoding sample`` draws the full-KV outputs with
seeded sampling (this small model's greedy outputs often loop, which favours recency). Then each
policy is fed that output (bench/quality/fidelity.py) and, per step, compared with full KV:

    agreement      the policy's greedy choice equals full KV's
    KL             KL(p_full || p_policy), nats per token
    PPL            perplexity of the full-KV text under the policy (EOS tokens left out)
    shared prefix  first disagreement = length of the output free greedy decoding would share
                   with full KV (median over prompts; "identical" = never disagrees)

each also on the steps before the full-KV output's first repetition loop ("no-loop") and on the
steps past Kara's peak KV ("late": after both Kara and the baseline have compressed). Policies:
``POLICIES``, ``<kara variant or random>-r<R>`` (a recency band), or any registered policy
(``--policy-file FILE``: bench/reasoning/configs.py). Kara runs first at each ratio; every
budget-taking baseline gets, per prompt, N = Kara's peak generated KV - (W - U), so its peak
equals Kara's (``--match peak``); ``--match mean``: equal mean generated KV; ``--match
trajectory``: Kara's generated KV at every decode step (``custom_params.kara.match_kara``, no
Kara run needed). A few prompts are also decoded freely under every policy and shown as text.

A long table can be filled over several runs: ``--ref-dir DIR`` keeps the full-KV record (and
Kara's peaks per ratio) and reuses it when model, prompts, length and decoding match; ``--merge
A.json B.json ...`` writes one table and plot from the runs' quality_real.json files;
``--free-only`` adds the free generations to a kept record; ``--stride k`` takes every k-th
prompt. ``bench/quality/paired.py`` compares two rows of one kept record prompt by prompt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import statistics
import tempfile
import time

from bench.reasoning import configs

HERE = os.path.dirname(os.path.abspath(__file__))

POLICIES = {
    "none": dict(kara_policy="none"),
    "kara": dict(kara_policy="kara"),
    "kara-noT2C": dict(kara_policy="kara", kara_chunk_budget=0),
    "kara-causal": dict(kara_policy="kara", kara_scoring="buffer"),
    "snapkv": dict(kara_policy="snapkv"),
    "streaming": dict(kara_policy="streaming"),
    "h2o": dict(kara_policy="h2o"),
    "rkv": dict(kara_policy="rkv"),
    "random": dict(kara_policy="random"),
}


class _BudgetPolicies:
    """The registered policies that take a per-request budget, asked of the registry when used
    (a policy registered later, by ``--policy-file``, is one of them)."""

    def __contains__(self, name) -> bool:
        return name in configs.budget_policies()

    def __iter__(self):
        return iter(configs.budget_policies())


THRESHOLD = _BudgetPolicies()


def policy_spec(name: str) -> dict:
    """Engine options of a policy name: one of POLICIES, a Kara variant (or random) with a
    recency band, ``<name>-r<R>`` (e.g. ``kara-r128``: ``--kara-recent 128``), or any registered
    policy (its defaults; the harness adds the window settings or the budget)."""
    if name in POLICIES:
        return POLICIES[name]
    if name in configs.names():
        return dict(kara_policy=name)
    base, _, r = name.rpartition("-r")
    if (
        base in POLICIES
        and (base.startswith("kara") or base == "random")
        and r.isdigit()
    ):
        key = "kara_recent" if base.startswith("kara") else "kara_random_recent"
        return dict(POLICIES[base], **{key: int(r)})
    raise SystemExit(
        f"unknown policy {name!r}: one of {', '.join(POLICIES)}, a registered policy "
        f"({', '.join(configs.names())}), or kara*/random with -r<R> (recency band)"
    )


def policy_order(name: str) -> tuple:
    """Table order: POLICIES' order, a recency variant after its base, by R; other registered
    policies after them."""
    base, _, r = name.rpartition("-r")
    if name in POLICIES:
        return list(POLICIES).index(name), 0
    if base in POLICIES and r.isdigit():
        return list(POLICIES).index(base), int(r) + 1
    return len(POLICIES), 0


def load_problems(args, tok) -> list[dict]:
    if getattr(args, "text", None) or getattr(args, "recall", False):
        from bench.quality import workloads

        if args.text:
            return workloads.text_problems(args.text, args.n, args.new_tokens, tok)
        return workloads.recall_problems(args.n, args.new_tokens, args.facts, tok)
    rows = [json.loads(line) for line in open(args.prompts) if line.strip()][
        :: args.stride
    ][: args.n]
    out = []
    for r in rows:
        text = tok.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        out.append(dict(r, input_ids=tok(text, add_special_tokens=False)["input_ids"]))
    return out


REFERENCE = "reference.json"  # in the record directory: {"key", "tokens"}


def reference_key(args, problems) -> str:
    """What the full-KV record depends on: model, prompts, length, decoding."""
    ident = dict(
        model=os.path.abspath(args.model_path),
        prompts=[p["input_ids"] for p in problems],
        targets=[p.get("target") for p in problems],
        new_tokens=args.new_tokens,
        decoding=args.decoding,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def load_reference(d: str, key: str, T: int) -> list[list[int]] | None:
    """The full-KV outputs recorded in ``d`` for ``key``, or None when absent, stale or partial
    (every ref file must hold exactly T rows)."""
    path = os.path.join(d, REFERENCE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        rec = json.load(f)
    if rec.get("key") != key:
        return None
    from bench.quality import fidelity

    tokens = rec["tokens"]
    for k, t in enumerate(tokens):
        ref = fidelity.ref_path(d, k)
        if (
            len(t) != T
            or not os.path.exists(ref)
            or not os.path.getsize(ref)
            or os.path.getsize(ref) % (4 * T)
        ):
            return None
    return tokens


def first_loop(ids: list[int], span: int = 24, repeats: int = 3) -> int:
    """Start of the first repetition loop (a 4..span-token segment repeated ``repeats`` times
    back to back); len(ids) if none."""
    for end in range(len(ids)):
        for p in range(4, span + 1):
            start = end - repeats * p + 1
            if start < 0:
                break
            seg = ids[end - p + 1 : end + 1]
            if all(
                ids[start + r * p : start + (r + 1) * p] == seg
                for r in range(repeats - 1)
            ):
                return start
    return len(ids)


def threshold_mean_kv(budget: int, gap: int, steps: int) -> float:
    """Mean generated KV over ``steps`` decode steps of a threshold policy (N = budget, C_max =
    budget + gap), as the runtime measures it (kv_mean_len: the length at each step, before the
    step's event and token): 0, 1, ..., C_max + 1, then N + 1 ... C_max + 1 again."""
    kv = total = 0
    for _ in range(steps):
        total += kv
        if kv > budget + gap:
            kv = budget
        kv += 1
    return total / steps


def budget_for_mean(mean: float, gap: int, steps: int, floor: int) -> int:
    """The smallest N >= floor whose threshold_mean_kv reaches ``mean`` (equal KV-token-steps to
    a policy of that mean generated KV); the mean grows with N."""
    lo, hi = floor, max(floor, steps)
    while lo < hi:
        mid = (lo + hi) // 2
        if threshold_mean_kv(mid, gap, steps) >= mean:
            hi = mid
        else:
            lo = mid + 1
    return lo


def engine_options(name, ratio, args, kara_peaks=None, kara_means=None):
    """(engine keyword options, per-request custom_params.kara list or None). Threshold baselines
    get per-request budgets from Kara's run at ``ratio``: equal peak generated KV (``--match
    peak``) or equal mean generated KV (``--match mean``: equal KV-token-steps). ``--kara-opt``
    items go to every compressing policy."""
    opts, per_request = _engine_options(name, ratio, args, kara_peaks, kara_means)
    if name != "none":
        from bench.engine_env import kara_opts

        opts.update(kara_opts(getattr(args, "kara_opt", None)))
    return opts, per_request


def _engine_options(name, ratio, args, kara_peaks=None, kara_means=None):
    spec = policy_spec(name)
    opts = dict(
        spec,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running,
    )
    if name == "none":
        return opts, None
    opts.update(kara_max_seqs=4096, kara_query_source="capture")
    if name.startswith("kara"):
        opts.update(
            kara_window=args.window,
            kara_buffer=args.buffer,
            kara_retention=ratio,
            kara_period=args.period,
        )
        return opts, None
    if spec["kara_policy"] == "random":
        opts.update(
            kara_random_window=args.window,
            kara_random_buffer=args.buffer,
            kara_random_retention=ratio,
            kara_random_period=args.period,
        )
        return opts, None
    kara = configs.schedule(args.window, args.buffer, ratio, args.period)
    # a registered policy: Kara's window settings
    if spec["kara_policy"] not in THRESHOLD:
        extra, _ = configs.engine_options(spec["kara_policy"], kara)
        opts.update({k: v for k, v in extra.items() if k not in opts})
        return opts, None
    if args.match == "trajectory":
        extra, per = configs.engine_options(spec["kara_policy"], kara)
        opts.update({k: v for k, v in extra.items() if k not in opts})
        return opts, [dict(per) for _ in range(args.n)]
    gap = args.window - args.buffer
    prefix = f"kara_{spec['kara_policy']}_"
    default_w = configs.option_fields(spec["kara_policy"]).get("window")
    # its own observation window where smaller than U (R-KV keeps 8 queries), else U
    w = min(default_w, args.buffer) if isinstance(default_w, int) else args.buffer
    # server-wide N only needs to be valid (StreamingLLM's 4 sinks fit); requests bring their own
    floor = w + 8
    opts.update(
        {
            prefix + "window": w,
            prefix + "budget": floor,
            prefix + "threshold": floor + gap,
        }
    )
    if args.match == "mean":
        steps = args.new_tokens - 1  # decode steps (the first token comes from prefill)
        return opts, [
            {"budget": budget_for_mean(m, gap, steps, floor)} for m in kara_means[ratio]
        ]
    return opts, [{"budget": max(floor, peak - gap)} for peak in kara_peaks[ratio]]


def run_engine(
    model_path,
    opts,
    problems,
    params_of,
    per_request=None,
    fidelity=None,
    threads=1,
    record=None,
    label=None,
    text_of=None,
):
    """Outputs of ``problems`` on one engine: ``params_of(i, problem)`` its sampling params,
    per_request / fidelity its custom_params.kara / .fidelity (None: none); the prompt is
    ``problem["input_ids"]``, or the text ``text_of(problem)``; ``record``: a
    bench.record.RunRecord that gets the engine's resolved settings under ``label``."""
    from bench.engine_env import start_engine

    opts = dict(opts)
    if fidelity:
        opts["enable_custom_logit_processor"] = True
    engine = start_engine(model_path, threads, **opts)
    if record is not None:
        record.add_engine(label or opts.get("kara_policy", "engine"), engine)
    try:
        params = []
        for i, p in enumerate(problems):
            sp = params_of(i, p)
            custom = {}
            if per_request and per_request[i]:
                custom["kara"] = per_request[i]
            if fidelity:
                custom["fidelity"] = fidelity[i]
            if custom:
                sp["custom_params"] = custom
            params.append(sp)
        processor = None
        if fidelity:
            from bench.quality.fidelity import FidelityProcessor

            processor = [FidelityProcessor.to_str()] * len(problems)
        if text_of is not None:
            return engine.generate(
                [text_of(p) for p in problems], params, custom_logit_processor=processor
            )
        return engine.generate(
            input_ids=[p["input_ids"] for p in problems],
            sampling_params=params,
            custom_logit_processor=processor,
        )
    finally:
        engine.shutdown()


def generated_kv(outs, problems, key: str) -> list[int]:
    """Per request: its ``meta_info["kara"][key]`` KV length less its prompt."""
    return [
        o["meta_info"]["kara"][key] - len(p["input_ids"])
        for o, p in zip(outs, problems)
    ]


def summarize_policy(name, ratio, steps_by_k, outs, problems, loops, late_from) -> dict:
    """steps_by_k: per problem {"agree", "kl", "nll", "hit"} lists (hit and the scored steps of
    teacher-forced workloads: bench/quality/workloads.py)."""
    agree = [a for k in steps_by_k for a in steps_by_k[k]["agree"]]
    kl = [x for k in steps_by_k for x in steps_by_k[k]["kl"]]
    nll = [x for k in steps_by_k for x in steps_by_k[k]["nll"]]
    first = []
    for _k, st in steps_by_k.items():
        dis = [t for t, a in enumerate(st["agree"]) if not a]
        first.append(dis[0] if dis else len(st["agree"]))
    nl_agree = [a for k, st in steps_by_k.items() for a in st["agree"][: loops[k]]]
    nl_kl = [x for k, st in steps_by_k.items() for x in st["kl"][: loops[k]]]
    late_agree = [
        a for k, st in steps_by_k.items() for a in st["agree"][late_from[k] :]
    ]
    late_kl = [x for k, st in steps_by_k.items() for x in st["kl"][late_from[k] :]]
    metas = [o["meta_info"].get("kara", {}) for o in outs]
    prompt = [len(p["input_ids"]) for p in problems]
    peak = (
        [m.get("kv_peak_len", 0) - p for m, p in zip(metas, prompt)] if metas[0] else []
    )
    mean = (
        [m.get("kv_mean_len", 0) - p for m, p in zip(metas, prompt)] if metas[0] else []
    )
    steps = len(steps_by_k[next(iter(steps_by_k))]["agree"])
    return dict(
        policy=name,
        ratio=ratio,
        agree=sum(agree) / len(agree),
        kl=sum(kl) / len(kl),
        ppl=math.exp(sum(nll) / len(nll)),
        shared_prefix_median=statistics.median(first),
        identical=sum(f == steps for f in first),
        n=len(first),
        tokens=len(agree),
        agree_noloop=sum(nl_agree) / max(1, len(nl_agree)),
        kl_noloop=sum(nl_kl) / max(1, len(nl_kl)),
        noloop_tokens=len(nl_agree),
        agree_late=sum(late_agree) / max(1, len(late_agree)),
        kl_late=sum(late_kl) / max(1, len(late_kl)),
        late_tokens=len(late_agree),
        peak_kv=sum(peak) / len(peak) if peak else None,
        mean_kv=sum(mean) / len(mean) if mean else None,
        shared_prefix=first,
        **_scored(steps_by_k, problems),
    )


def _scored(steps_by_k, problems) -> dict:
    from bench.quality import workloads

    return workloads.scored_stats(steps_by_k, problems)


def main(args, argv):
    from transformers import AutoTokenizer

    from bench.quality import fidelity

    if args.model_path is None:
        from sgl_kara.cpu.smollm2 import default_model_path

        args.model_path = default_model_path()
    os.makedirs(args.out, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.model_path)
    problems = load_problems(args, tok)
    T = args.new_tokens
    ks = list(range(len(problems)))

    greedy = {"max_new_tokens": T, "min_new_tokens": T, "temperature": 0.0}

    def full_params(i, p):
        if args.decoding != "sample":
            return dict(greedy)
        sampled = dict(temperature=args.temperature, top_p=args.top_p)
        return dict(greedy, **sampled, sampling_seed=args.seed + i)

    rows, texts = [], {}
    tic = time.time()
    with contextlib.ExitStack() as stack:
        d = args.ref_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="kara_real_")
        )
        key = reference_key(args, problems)
        tokens = load_reference(d, key, T)
        if tokens is None:
            os.makedirs(d, exist_ok=True)
            for name in os.listdir(d):  # a stale or partial record: start over
                if (
                    name.startswith(("ref_", "kara_peaks_", "kara_means_"))
                    or name == REFERENCE
                ):
                    os.remove(os.path.join(d, name))
            rec = [dict(mode="record", dir=d, k=k) for k in ks]
            for r, p in zip(rec, problems):
                if "target" in p:  # teacher-forced text: the record is of that text
                    r["tokens"] = p["target"]
            outs = run_engine(
                args.model_path,
                engine_options("none", None, args)[0],
                problems,
                full_params,
                fidelity=rec,
                threads=args.omp_threads,
                record=args.record,
                label="none",
            )
            tokens = [o["output_ids"] for o in outs]
            assert all(len(t) == T for t in tokens), [len(t) for t in tokens]
            if any(
                "target" in p and p["target"] != t for p, t in zip(problems, tokens)
            ):
                raise RuntimeError(
                    "full KV: a teacher-forced output differs from its text"
                )
            with open(os.path.join(d, REFERENCE), "w") as f:
                json.dump({"key": key, "tokens": tokens}, f)
        else:
            print(f"full KV: reusing the record in {d}", flush=True)
        loops = {k: first_loop(tokens[k]) for k in ks}
        print(
            f"full KV: {len(ks)} x {T} tokens in {time.time() - tic:.0f}s; outputs with a loop: "
            f"{sum(loops[k] < T for k in ks)}",
            flush=True,
        )
        texts["none"] = [tok.decode(tokens[k]) for k in ks[: args.show]]
        if "target" in problems[0] and not args.free_only:
            from bench.quality import workloads

            rows.append(workloads.full_kv_row(d, problems))
        kara_peaks: dict[float, list[int]] = {}
        kara_means: dict[float, list[float]] = {}
        src = budget_source(args)
        # Kara's peaks from an earlier run on this record (it may not run now)
        for ratio in args.ratios:
            for store, what in ((kara_peaks, "peaks"), (kara_means, "means")):
                if os.path.exists(os.path.join(d, f"kara_{what}_{ratio}{src}.json")):
                    with open(os.path.join(d, f"kara_{what}_{ratio}{src}.json")) as f:
                        store[ratio] = json.load(f)
        forced_params = lambda i, p: dict(greedy)
        if args.free_only:  # the rows come from earlier runs on this record
            missing = [r for r in args.ratios if r not in kara_peaks]
            if missing and any(n in THRESHOLD for n in args.policies):
                raise SystemExit(
                    f"--free-only: no Kara peaks stored in {d} for ratios {missing}; run kara there first"
                )
        for name, ratio in (
            []
            if args.free_only
            else run_order(args.policies, args.ratios, args.budget_from)
        ):
            matched = name in THRESHOLD and args.match != "peak"
            tag = (
                f"{name}_{ratio}"
                + (f"_{args.match}" if matched else "")
                + (src if name in THRESHOLD else "")
            )
            forced = [
                {"mode": "force", "dir": d, "k": k, "tag": tag, "tokens": tokens[k]}
                for k in ks
            ]
            opts, per_request = engine_options(
                name, ratio, args, kara_peaks, kara_means
            )
            t0 = time.time()
            outs = run_engine(
                args.model_path,
                opts,
                problems,
                forced_params,
                per_request,
                forced,
                args.omp_threads,
                record=args.record,
                label=tag,
            )
            if any(o["output_ids"] != t for o, t in zip(outs, tokens)):
                raise RuntimeError(
                    f"{tag}: a forced output differs from the full-KV output"
                )
            if name == args.budget_from:
                kara_peaks[ratio] = generated_kv(outs, problems, "kv_peak_len")
                kara_means[ratio] = generated_kv(outs, problems, "kv_mean_len")
                # a later run's baselines and "late" steps use them without Kara
                if args.ref_dir:
                    for store, what in ((kara_peaks, "peaks"), (kara_means, "means")):
                        with open(
                            os.path.join(d, f"kara_{what}_{ratio}{src}.json"), "w"
                        ) as f:
                            json.dump(store[ratio], f)
            late_from = {
                k: kara_peaks[ratio][k] if ratio in kara_peaks else 0 for k in ks
            }
            steps = {k: fidelity.load_steps(d, tag, k) for k in ks}
            row = summarize_policy(name, ratio, steps, outs, problems, loops, late_from)
            row["seconds"] = time.time() - t0
            if matched:
                row["match"] = args.match
            if name in THRESHOLD and src:
                row["budget_from"] = args.budget_from
            rows.append(row)
            write(rows, texts, args, argv)
            print(
                f"{name:12s} r={ratio} agree {row['agree']:.4f} KL {row['kl']:.4f} PPL {row['ppl']:.3f} "
                f"shared prefix {row['shared_prefix_median']} identical {row['identical']}/{row['n']} "
                f"peak KV {row['peak_kv']} ({row['seconds']:.0f}s)",
                flush=True,
            )
    if args.show:
        free_generation(args, problems[: args.show], texts, kara_peaks, kara_means, tok)
    write(rows, texts, args, argv)
    plot(rows, args)
    return rows


def merge(paths, args, argv) -> list[dict]:
    """One table + plot from several real-LM runs' quality_real.json (ratios or policies split
    over runs on the same full-KV record): rows ordered by ratio then policy; a (policy, ratio)
    given twice must agree on its agreement and KL; free generations are kept from every run."""
    rows: dict[tuple, dict] = {}
    texts: dict[str, list] = {}
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        for r in run["rows"]:
            key = (r["policy"], r["ratio"], r.get("match"), r.get("budget_from"))
            if key in rows and (rows[key]["agree"], rows[key]["kl"]) != (
                r["agree"],
                r["kl"],
            ):
                raise SystemExit(f"--merge: {key} differs between runs ({path})")
            rows[key] = r
        texts.update(run.get("texts", {}))
    merged = sorted(
        rows.values(),
        key=lambda r: (
            r["ratio"] or 0,
            r.get("match") or "",
            policy_order(r["policy"]),
            r.get("budget_from") or "",
        ),
    )
    args.policies = list(dict.fromkeys(r["policy"] for r in merged))
    os.makedirs(args.out, exist_ok=True)
    write(merged, texts, args, argv)
    plot(merged, args)
    return merged


def budget_source(args) -> str:
    """Suffix of the stored peaks and of the baselines' tags: '' when Kara sets the budgets."""
    src = getattr(args, "budget_from", "kara")
    return "" if src == "kara" else f"_from_{src}"


def run_order(names, ratios, first="kara"):
    """Per ratio, in the order given (a long run fills the table ratio by ratio): Kara (or the
    --budget-from policy) first (the baselines take their budgets from its peaks), then the rest."""
    order = [(n, r) for r in ratios for n in names if n != "none"]
    return sorted(order, key=lambda nr: (ratios.index(nr[1]), nr[0] != first))


def free_generation(args, problems, texts, kara_peaks, kara_means, tok):
    ratio = 0.25 if 0.25 in args.ratios else args.ratios[0]
    n = args.new_tokens
    params = lambda i, p: {"max_new_tokens": n, "min_new_tokens": n, "temperature": 0.0}
    for name in args.policies:
        if name == "none":
            continue
        peaks = means = None
        if name in THRESHOLD:
            peaks = {ratio: kara_peaks.get(ratio, [0] * args.n)[: len(problems)]}
            means = {ratio: kara_means.get(ratio, [0] * args.n)[: len(problems)]}
        opts, per_request = engine_options(name, ratio, args, peaks, means)
        outs = run_engine(
            args.model_path,
            opts,
            problems,
            params,
            per_request,
            threads=args.omp_threads,
            record=args.record,
            label=f"{name}_{ratio} free",
        )
        texts[f"{name}_{ratio}"] = [o["text"] for o in outs]


def label(row) -> str:
    """The policy's name in tables: budget-matched at equal mean KV rows are marked (and the
    policy that set the budgets, when not Kara)."""
    return (
        row["policy"]
        + (f" ({row['match']}-matched)" if row.get("match") else "")
        + (f" (budget of {row['budget_from']})" if row.get("budget_from") else "")
    )


def write(rows, texts, args, argv):
    forced = any("hit" in r for r in rows)
    if forced:  # teacher-forced text / recall (bench/quality/workloads.py)
        scored = any("hit_scored" in r for r in rows)
        head = (
            "| policy | retention | agreement | KL | PPL | text hit | agreement late | KL late "
            + (
                "| recall accuracy | recall agreement | recall KL | recall PPL "
                if scored
                else ""
            )
            + "| peak gen. KV | mean gen. KV |"
        )
    else:
        head = (
            "| policy | retention | agreement | KL | PPL | shared prefix (median) | identical | agreement no-loop "
            "| KL no-loop | agreement late | KL late | peak gen. KV | mean gen. KV |"
        )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def f(r, key, fmt):
        return format(r[key], fmt) if r.get(key) is not None else "-"

    for r in rows:
        kv = f"{f(r, 'peak_kv', '.0f')} | {f(r, 'mean_kv', '.0f')}"
        ratio = r["ratio"] if r["ratio"] is not None else "-"
        if forced:
            rec = (
                (
                    f"{f(r, 'hit_scored', '.4f')} | {f(r, 'agree_scored', '.4f')} | {f(r, 'kl_scored', '.4f')} | "
                    f"{f(r, 'ppl_scored', '.3f')} | "
                )
                if scored
                else ""
            )
            lines.append(
                f"| {label(r)} | {ratio} | {r['agree']:.4f} | {r['kl']:.4f} | {r['ppl']:.3f} | "
                f"{f(r, 'hit', '.4f')} | {f(r, 'agree_late', '.4f')} | {f(r, 'kl_late', '.4f')} | {rec}{kv} |"
            )
            continue
        lines.append(
            f"| {label(r)} | {ratio} | {r['agree']:.4f} | {r['kl']:.4f} | {r['ppl']:.3f} | "
            f"{r['shared_prefix_median']:.0f} | {r['identical']}/{r['n']} | {r['agree_noloop']:.4f} | "
            f"{r['kl_noloop']:.4f} | {r['agree_late']:.4f} | {r['kl_late']:.4f} | {kv} |"
        )
    with open(os.path.join(args.out, "quality_real.md"), "w") as f:
        f.write(args.record.header + "\n".join(lines) + "\n")
        for key, outs in texts.items():
            f.write(f"\n### Free generation: {key}\n\n")
            for i, t in enumerate(outs):
                f.write(f"**prompt {i}**: {json.dumps(t[:1500])}\n\n")
    with open(os.path.join(args.out, "quality_real.json"), "w") as f:
        saved = {k: v for k, v in vars(args).items() if k != "record"}
        json.dump({"rows": rows, "texts": texts, "args": saved}, f, indent=1)


def plot(rows, args):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, field, ylabel in (
        (axes[0], "agree", "next-token agreement with full KV"),
        (axes[1], "kl", "KL(full || policy)"),
    ):
        for name in dict.fromkeys(label(r) for r in rows if r["ratio"] is not None):
            pts = sorted((r["ratio"], r[field]) for r in rows if label(r) == name)
            ax.plot([p for p, _ in pts], [v for _, v in pts], marker="o", label=name)
        ax.set_xlabel("retention ratio")
        ax.set_ylabel(ylabel)
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "quality_real.png"), dpi=120)
