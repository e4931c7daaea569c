"""Where compression's throughput gain stops short of its step-cost ceiling: sgl_kara with Kara
against ``--kara-policy none`` (the same engine, code and CPU kernels: compression alone) on one
memory-bound workload, per scheduler CPU-second, each run's CPU split from its per-step trace.

Both systems run ``bench.engine_run.run_system`` (sgl_kara.Engine, SGLang's defaults, one OpenMP
thread, the scheduler pinned to a core), interleaved over ``--repeats``, on the same requests
(``ignore_eos``, sampled) and KV pool. From the trace (``KARA_TRACE``: one line per decode step,
bench/step_costs.py ``intervals``):

    model       the step-cost model, CPU per decode step = fixed + per request B + per KV row rows,
                fitted jointly to both systems' steps without an event or an admission
    ceiling     Kara's rate over none's at what the pool allows each at its admission charge
                (bench/serving.py ``admission_charges``, ``pool_allows``: the requests it holds
                while every one runs), by the model, at each system's measured rows per request:
                no event time, no prefill, no drain
    split       per run, the scheduler CPU of its steps: ``decode`` (the model's cost of the steps
                run), ``events`` (compression, within the steps), ``admissions`` (what the steps
                that admitted requests cost beyond the model: their prefill), ``residual`` (what
                the other steps cost beyond the model: per-step work the joint fit does not
                carry, such as Kara's hooks)
    factors     measured rate = model rate at the allowed concurrency x ``concurrency`` (the
                model's rate at the steps run / at the allowed concurrency: requests short of
                the pool's allowance, the finite batch's drain) x ``decode share`` (decode / all
                CPU), exactly; so measured ratio = ceiling x the two factors' ratios

    python -m bench.ceiling --out DIR [--requests 40] [--gen 512] [--pool 3500]
        [--window 128 --buffer 16 --period 16] [--repeats 2]

Writes ceiling.json, ceiling.md, each run's trace and the run record (run.json) under --out.
Imports nothing from SGLang at module level.
"""

from __future__ import annotations

import argparse
import json
import os
import types

SYSTEMS = ("none", "kara")


# ------------------------------------------------------------------ pure
def split(ivs: list[dict], model) -> dict:
    """A run's decode steps (step_costs ``intervals``) against the step-cost model: tokens,
    scheduler CPU and its parts (see the module docstring), mean running, rows per request."""
    tokens = sum(iv["running"] for iv in ivs)
    cpu = sum(iv["cpu"] for iv in ivs)
    decode = events = admissions = residual = 0.0
    for iv in ivs:
        step = model.step(iv["running"], iv["rows"] / iv["running"])
        decode += step
        events += iv["event"]
        rest = iv["cpu"] - iv["event"] - step
        if iv["admitted"]:
            admissions += rest
        else:
            residual += rest
    return dict(
        tokens=tokens,
        cpu=cpu,
        tps=tokens / cpu,
        decode=decode,
        events=events,
        admissions=admissions,
        residual=residual,
        steps=len(ivs),
        running=tokens / len(ivs),
        rows_per_request=sum(iv["rows"] for iv in ivs) / tokens,
    )


def factors(part: dict, model, allowed: float) -> dict:
    """``part`` (``split``) as model rate at ``allowed`` running x concurrency x decode share."""
    at_allowed = model.tps(allowed, part["rows_per_request"])
    return dict(
        at_allowed=at_allowed,
        concurrency=(part["tokens"] / part["decode"]) / at_allowed,
        decode_share=part["decode"] / part["cpu"],
    )


def breakdown(base: dict, kara: dict, model, allowed: dict) -> dict:
    """Kara's ratio over none's and its ceiling; ``base`` / ``kara``: ``split`` dicts (one run
    each, or summed); ``allowed``: requests the pool allows each ({"none": n, "kara": n})."""
    fb, fk = (
        factors(base, model, allowed["none"]),
        factors(kara, model, allowed["kara"]),
    )
    return dict(
        measured=kara["tps"] / base["tps"],
        ceiling=fk["at_allowed"] / fb["at_allowed"],
        concurrency=fk["concurrency"] / fb["concurrency"],
        decode_share=fk["decode_share"] / fb["decode_share"],
        none=fb,
        kara=fk,
    )


def merge(parts: list[dict]) -> dict:
    """Several runs' ``split`` dicts as one (their steps together)."""
    keys = ("tokens", "cpu", "decode", "events", "admissions", "residual", "steps")
    out = {k: sum(p[k] for p in parts) for k in keys}
    out["tps"] = out["tokens"] / out["cpu"]
    out["running"] = out["tokens"] / out["steps"]
    out["rows_per_request"] = (
        sum(p["rows_per_request"] * p["tokens"] for p in parts) / out["tokens"]
    )
    return out


# ------------------------------------------------------------------ runs
def run(args) -> dict:
    from bench import step_costs
    from bench.engine_run import run_system
    from bench.record import RunRecord
    from bench.serving import admission_charges, kara_policy, pool_allows, timeline
    from bench.throughput_grid import grid_prompts, model_path

    record = RunRecord(args.out, args.argv)
    record.note(
        requests=args.requests,
        gen=args.gen,
        pool=args.pool,
        max_running=args.max_running,
        window=args.window,
        buffer=args.buffer,
        period=args.period,
        retention=args.retention,
    )
    opts = types.SimpleNamespace(
        model_path=model_path(args.model), omp_threads=1, pin=True
    )
    prompts = grid_prompts(args.requests)
    params = [
        {"max_new_tokens": args.gen, "temperature": 0.8, "ignore_eos": True}
        for _ in prompts
    ]
    kara = dict(
        kara_policy="kara",
        kara_window=args.window,
        kara_buffer=args.buffer,
        kara_period=args.period,
        kara_retention=args.retention,
        kara_query_source=args.query_source,
    )
    runs = []
    for rep in range(args.repeats):
        order = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]
        for system in order:
            r = run_system(
                system,
                opts,
                args.pool,
                args.max_running,
                kara=kara if system == "kara" else {"kara_policy": "none"},
                prompts_params=(prompts, params),
                repeat=rep,
                record=record,
            )
            path = os.path.join(args.out, f"{system}-{rep}.trace.jsonl")
            with open(path, "w") as f:
                f.writelines(json.dumps(line) + "\n" for line in r.trace)
            steps = [s for s in r.trace if s["running"] > 0]
            tl = timeline([dict(s, t=s.get("t", i)) for i, s in enumerate(steps)])
            runs.append(
                dict(
                    system=system,
                    repeat=rep,
                    trace=r.trace,
                    lengths_ok=r.lengths_ok,
                    retractions=r.retractions,
                    events=r.events,
                    tps_sched_psutil=r.tps_scheduler_cpu,
                    timeline=tl,
                )
            )
            print(system, rep, round(r.tps_scheduler_cpu, 1), tl.get("mean_running"))
    ivs = {id(x): step_costs.intervals(x["trace"]) for x in runs}
    model = step_costs.fit([step_costs.fit_stats(v) for v in ivs.values()])
    prompt = round(sum(x["timeline"]["prompt"] for x in runs) / len(runs))
    policy = kara_policy(
        dict(
            window=args.window,
            buffer=args.buffer,
            retention=args.retention,
            period=args.period,
        )
    )
    charges = {
        "none": admission_charges(None, prompt, args.gen),
        "kara": admission_charges(policy, prompt, args.gen),
    }
    allowed = {
        s: min(args.max_running, pool_allows(args.pool, c)["steady"])
        for s, c in charges.items()
    }
    for x in runs:
        x["split"] = split(ivs[id(x)], model)
        x["waited"] = step_costs.saturated(ivs[id(x)])
        del x["trace"]
    per_rep = [
        breakdown(
            next(
                x["split"] for x in runs if x["system"] == "none" and x["repeat"] == k
            ),
            next(
                x["split"] for x in runs if x["system"] == "kara" and x["repeat"] == k
            ),
            model,
            allowed,
        )
        for k in range(args.repeats)
    ]
    merged = {s: merge([x["split"] for x in runs if x["system"] == s]) for s in SYSTEMS}
    result = dict(
        model=dict(
            fixed=model.fixed,
            per_request=model.per_request,
            per_row=model.per_row,
            r2=model.r2,
            n=model.n,
        ),
        prompt=prompt,
        charges=charges,
        allowed=allowed,
        runs=runs,
        per_repeat=per_rep,
        all=breakdown(merged["none"], merged["kara"], model, allowed),
        merged=merged,
    )
    with open(os.path.join(args.out, "ceiling.json"), "w") as f:
        json.dump(result, f, indent=1)
    record.write_md(os.path.join(args.out, "ceiling.md"), report(result))
    record.finish()
    return result


def report(res: dict) -> str:
    m = res["model"]
    lines = [
        f"step-cost model: {1e3 * m['fixed']:.2f} ms + {1e3 * m['per_request']:.3f} ms B + "
        f"{1e6 * m['per_row']:.3f} us rows (R^2 {m['r2']:.2f}, {m['n']} steps)",
        f"prompt {res['prompt']} tokens; admission charges {res['charges']}; "
        f"the pool allows {res['allowed']}",
        "",
        "| system | repeat | tok/sched-CPU-s | mean running | while waiting | rows/request "
        "| decode | events | admissions | residual | running by tenth of the steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in res["runs"]:
        s, tl = x["split"], x["timeline"]
        share = {
            k: 100 * s[k] / s["cpu"]
            for k in ("decode", "events", "admissions", "residual")
        }
        waited = tl.get("running_while_waiting")
        lines.append(
            f"| {x['system']} | {x['repeat']} | {s['tps']:.0f} | {s['running']:.1f} | "
            f"{'-' if waited is None else f'{waited:.1f}'} | {s['rows_per_request']:.0f} | "
            + " | ".join(f"{share[k]:.1f}%" for k in share)
            + f" | {' '.join(f'{v:g}' for v in tl['by_tenth'] if v is not None)} |"
        )
    lines += [
        "",
        "| repeats | measured | ceiling | concurrency | decode share |",
        "|---|---|---|---|---|",
    ]
    for label, b in [*enumerate(res["per_repeat"]), ("all", res["all"])]:
        lines.append(
            f"| {label} | {b['measured']:.2f}x | {b['ceiling']:.2f}x | "
            f"{b['concurrency']:.2f}x | {b['decode_share']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--model", default="tiny", help="tiny | smollm2 | a checkpoint path"
    )
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--gen", type=int, default=512)
    ap.add_argument("--pool", type=int, default=3500)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--buffer", type=int, default=16)
    ap.add_argument("--period", type=int, default=16)
    ap.add_argument("--retention", type=float, default=0.25)
    ap.add_argument("--query-source", default="capture")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    args.argv = argv
    os.makedirs(args.out, exist_ok=True)
    print(report(run(args)))


if __name__ == "__main__":
    main()
