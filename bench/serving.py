"""SGLang's own ``bench_serving`` against launched servers: throughput, inter-token latency and the
running-request timeline of plain SGLang and sgl_kara on the same requests.

Each system is launched as users launch it, given SGLang's benchmark client (``python -m
sglang.benchmark.serving``, backend ``sglang``, dataset ``random-ids``, every request sent at
once, ``ignore_eos``), then stopped; the server writes one ``KARA_TRACE`` line per decode step
(plain SGLang too). Per system and round:

    throughput    bench_serving's ``output_throughput``
    ITL           its median and P99 inter-token latency, and the longest gap (max of ``itls``)
    running       running requests, mean over the decode steps, by tenth of the run's wall time,
                  and while a request waited for admission
    CPU           output tokens per scheduler CPU-second over the traced steps
    pool allows   (sgl_kara) how many requests the pool holds at what admission charges them
                  (``admission_charges``)

Systems (``--systems``, comma-separated; ``NAME@REV`` runs NAME from a git worktree of revision
REV, e.g. ``kara@HEAD~1``):

    sglang   ``python -m sglang.launch_server`` with the settings ``python -m
             sgl_kara.launch_server`` resolves to here and KARA_CPU_KERNELS=1: only compression
             differs
    kara     ``python -m sgl_kara.launch_server --max-total-tokens POOL`` at its defaults, or
             with ``--kara-flags``

    python -m bench.serving --out DIR [--systems sglang,kara,kara@REV] [--rounds 2]
        [--prompts 16] [--input-len 128] [--output-len 1536] [--pool 8192]
        [--kara-flags "--kara-window 256 --kara-period 32 ..."]

Rounds alternate the systems. Writes serving.json, serving.md, per run the client's result
(``<label>-<round>.bench.jsonl.gz``), the server's trace (gzipped) and log, and the run record
(run.json) under --out. Imports nothing from SGLang at module level.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gzip
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIENT = "sglang.benchmark.serving"
TIMELINE_BINS = 10


# ------------------------------------------------------------------ commands
def parse_system(spec: str) -> tuple[str, str | None]:
    """``kara@fc589ba`` -> ("kara", "fc589ba"); ``sglang`` -> ("sglang", None)."""
    name, _, rev = spec.partition("@")
    if name not in ("sglang", "kara"):
        raise ValueError(
            f"unknown system {spec!r}: sglang or kara, with @REV optionally"
        )
    return name, rev or None


def server_command(
    name: str, resolved, pool: int, kara_flags: tuple[str, ...] = ()
) -> tuple[list[str], dict]:
    """(command without --port, extra environment) of a system's server; ``kara_flags``
    (``--kara-*``) go to sgl_kara's."""
    py = sys.executable
    if name == "kara":
        cmd = [py, "-m", "sgl_kara.launch_server", "--max-total-tokens", str(pool)]
        return cmd + list(kara_flags), {}
    from bench.latency import sglang_command

    return sglang_command(resolved, pool), {"KARA_CPU_KERNELS": "1"}


def client_command(
    url: str, result: str, prompts: int, input_len: int, output_len: int, seed: int = 42
) -> list[str]:
    """SGLang's benchmark client: every prompt sent at once, fixed lengths (range ratio 1), no
    warm-up request of its own (the server was warmed up before: its steps stay out of the
    trace window)."""
    return [
        *(sys.executable, "-m", CLIENT, "--backend", "sglang", "--base-url", url),
        *("--dataset-name", "random-ids", "--num-prompts", str(prompts)),
        *("--random-input-len", str(input_len), "--random-output-len", str(output_len)),
        *("--random-range-ratio", "1", "--request-rate", "inf"),
        *("--warmup-requests", "0", "--seed", str(seed), "--output-file", result),
        *("--output-details", "--disable-tqdm"),
    ]


@contextlib.contextmanager
def worktrees(revs: list[str]):
    """{rev: path of a detached git worktree at rev} for the duration; removed on exit."""
    base = tempfile.mkdtemp(prefix="sgl_kara_serving_")
    paths = {}
    try:
        for rev in revs:
            path = os.path.join(base, rev.replace("/", "_").replace("~", "_"))
            subprocess.run(
                ["git", "-C", ROOT, "worktree", "add", "--detach", path, rev],
                check=True,
                capture_output=True,
            )
            paths[rev] = path
        yield paths
    finally:
        for path in paths.values():
            subprocess.run(
                ["git", "-C", ROOT, "worktree", "remove", "--force", path],
                capture_output=True,
            )
        with contextlib.suppress(OSError):
            os.rmdir(base)


def gzip_in_place(path: str, round_times: bool = False) -> None:
    """Replace ``path`` by ``path.gz`` so results folders stay small; with ``round_times``, the
    client result's per-token gaps and first-token times are stored to 10 us (figures are computed
    before, from the client's full precision)."""
    with open(path, "rb") as src:
        data = src.read()
    if round_times:
        lines = data.decode().splitlines()
        result = json.loads(lines[-1])
        result["itls"] = [[round(t, 5) for t in r] for r in result.get("itls") or []]
        result["ttfts"] = [round(t, 5) for t in result.get("ttfts") or []]
        data = "\n".join([*lines[:-1], json.dumps(result)]).encode() + b"\n"
    with gzip.open(path + ".gz", "wb") as dst:
        dst.write(data)
    os.unlink(path)


def commit_of(rev: str | None, where: str = ROOT) -> str | None:
    out = subprocess.run(
        ["git", "-C", where, "rev-parse", rev or "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() or None


# ------------------------------------------------------------------ results (pure)
def itl_max_ms(itls: list[list[float]]) -> float:
    """The longest inter-token gap, ms, over bench_serving's per-request ``itls`` (seconds)."""
    return 1e3 * max((x for per in itls for x in per), default=0.0)


def client_figures(result: dict) -> dict:
    """What a table reports of one bench_serving result (its JSONL line with --output-details)."""
    return dict(
        completed=result["completed"],
        output_tokens=result["total_output_tokens"],
        duration_s=round(result["duration"], 1),
        tok_s=round(result["output_throughput"], 1),
        itl_p50_ms=round(result["median_itl_ms"], 1),
        itl_p99_ms=round(result["p99_itl_ms"], 1),
        itl_max_ms=round(itl_max_ms(result.get("itls") or []), 1),
        ttft_p50_ms=round(result["median_ttft_ms"], 1),
    )


def window(trace: list[dict], t0: float, t1: float) -> list[dict]:
    """The decode steps (running > 0) traced between t0 and t1 (the server's ``t`` is
    ``time.perf_counter``: the machine's monotonic clock, the same in every process)."""
    return [r for r in trace if t0 <= r["t"] <= t1 and r["running"] > 0]


def timeline(steps: list[dict], bins: int = TIMELINE_BINS) -> dict:
    """Running requests over a run's decode steps: mean over the steps, peak, mean while a
    request waited for admission, mean over the steps of each of ``bins`` equal parts of the
    run's wall time (None: no step in that part), the admissions (steps after which more
    requests run: how many joined) and the prompt length of the first admission (rows per
    request at the first step, less the token that step decodes)."""
    if not steps:
        return {}
    running = [s["running"] for s in steps]
    waited = [s["running"] for s in steps if s.get("waiting", 0) > 0]
    t0, t1 = steps[0]["t"], steps[-1]["t"]
    span = (t1 - t0) or 1.0
    parts: list[list[int]] = [[] for _ in range(bins)]
    for s in steps:
        parts[min(bins - 1, int(bins * (s["t"] - t0) / span))].append(s["running"])
    joined = [
        b["running"] - a["running"]
        for a, b in zip(steps, steps[1:])
        if b["running"] > a["running"]
    ]
    first = steps[0]
    return dict(
        steps=len(steps),
        mean_running=sum(running) / len(running),
        peak_running=max(running),
        running_while_waiting=sum(waited) / len(waited) if waited else None,
        waiting_share=len(waited) / len(steps),
        by_tenth=[round(sum(p) / len(p), 1) if p else None for p in parts],
        admissions=[first["running"], *joined],
        prompt=round(first.get("rows", 0) / first["running"]) - 1,
        mean_free=sum(s.get("free", 0) for s in steps) / len(steps),
    )


def cpu_rate(trace: list[dict]) -> dict | None:
    """Tokens per scheduler CPU-second over the traced steps, with the mean batch, rows per
    request and the compression share of that CPU time (bench/step_costs.py ``rate``)."""
    from bench import step_costs

    return step_costs.rate(step_costs.intervals(trace))


def kara_trajectory(policy, prompt: int, gen: int, slack: int = 0) -> list[dict]:
    """One request of ``prompt`` tokens generating ``gen`` through Kara's schedule at its own
    token counts (``--kara-phase request``; every due window compressed, as the runtime does
    unless memory is short): per decode step, the KV it holds and what admission charges it
    then (``runtime.charge``: its held KV plus ``schedule.growth`` of its remaining tokens, plus a
    capped spread's ``slack``)."""
    from sgl_kara.policies.base import RowView
    from sgl_kara.scheduler.state import KaraReqState

    state = KaraReqState(protected=prompt, frontier=prompt)
    frontier, length, out = prompt, prompt, []
    for done in range(1, gen):
        remaining = gen - done
        state.frontier = frontier
        row = RowView(prompt, frontier, length, 0, state)
        grow = min(remaining, policy.schedule.growth(remaining, row) + slack)
        out.append(dict(done=done, held=length, charge=length + grow))
        if policy.schedule.due(done):
            region = policy.region(row)
            if region is not None and policy.schedule.worth_compressing(row, remaining):
                length -= region.length - region.keep
                frontier = region.start + region.keep
        length += 1
    return out


def admission_charges(
    policy, prompt: int, gen: int, page: int = 1, slack: int = 0
) -> dict:
    """What SGLang's PrefillAdder counts for a request under sgl_kara's admission
    (scheduler/admission.py): ``new`` when it is admitted (its prompt, SGLang's page of
    overhead and the charge ``runtime.charge`` presents: ``schedule.growth`` of a row holding
    only its prompt), ``running`` the most it counts while it runs (held KV plus growth, over
    its life), ``peak`` the most KV it holds; ``policy`` None: plain SGLang (prompt + gen)."""
    if policy is None:
        full = prompt + gen
        return dict(new=full + page, running=full, peak=full)
    from sgl_kara.policies.base import RowView
    from sgl_kara.scheduler.state import KaraReqState

    fresh = RowView(-1, 0, 0, 0, KaraReqState())
    new = prompt + min(gen, policy.schedule.growth(gen, fresh) + slack) + page
    steps = kara_trajectory(policy, prompt, gen, slack)
    return dict(
        new=new,
        running=max(s["charge"] for s in steps),
        peak=max(s["held"] for s in steps) + 1,
    )


def pool_allows(pool: int, charges: dict) -> dict:
    """Requests the pool holds at these charges: ``steady`` while every request runs (n
    running charges within the pool), ``admitted`` how many one admission pass takes into an
    empty pool (each new request's charge strictly below what is left, as SGLang's
    ``PrefillBudget.check_prefill``), ``joined`` the most running once n - 1 run and one more
    is admitted."""
    steady = pool // charges["running"]
    admitted = 0
    while (admitted + 1) * charges["new"] < pool:
        admitted += 1
    joined = 0
    while joined * charges["running"] + charges["new"] < pool:
        joined += 1
    return dict(steady=steady, admitted=admitted, joined=joined)


def kara_policy(options: dict):
    """The KaraPolicy of these resolved options (a KaraConfig's ``to_dict()``)."""
    from sgl_kara.config import KaraConfig

    keep = {
        k: options[k]
        for k in ("window", "buffer", "retention", "period", "recent")
        if k in options
    }
    return KaraConfig.build(policy="kara", **keep).make_policy()


# ------------------------------------------------------------------ one run
RAM_REFUSAL = "of RAM is available"


def when_ram_allows(attempt, minutes: float, pause: float = 30.0):
    """``attempt()``, again every ``pause`` seconds for up to ``minutes`` while sgl_kara's
    launcher refuses for want of RAM (a machine shared with other jobs); other failures raise."""
    deadline = time.monotonic() + 60 * minutes
    while True:
        try:
            return attempt()
        except (RuntimeError, SystemExit) as e:
            if not getattr(e, "ram", False) or time.monotonic() > deadline:
                raise
            print(f"waiting for RAM: {e}", file=sys.stderr, flush=True)
            time.sleep(pause)


def start_in(cwd: str, env: dict, log: str, cmd: list[str]):
    """bench.serve_numbers.start from ``cwd``; a refusal for want of RAM is marked ``ram``."""
    from bench.serve_numbers import start

    try:
        with contextlib.chdir(cwd):
            return start(env, log, 900, cmd)
    except RuntimeError as e:
        with open(log) as f:
            e.ram = RAM_REFUSAL in f.read()
        raise


def resolve(pool: int, kara_flags: tuple[str, ...] = ()):
    """(KaraConfig, ServerArgs) the launcher resolves the default server to, with this pool and
    these ``--kara-*`` flags."""
    import io

    from sgl_kara.launch_server import parse

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse(["--max-total-tokens", str(pool), *kara_flags])
    except SystemExit as e:
        sys.stderr.write(err.getvalue())
        e.ram = RAM_REFUSAL in err.getvalue()
        raise


def run_one(label: str, name: str, cwd: str, resolved, args, rnd: int, record) -> dict:
    import requests

    from bench.latency import run_load
    from bench.serve_numbers import stop

    cmd, extra = server_command(name, resolved, args.pool, args.kara_flags)
    stem = os.path.join(args.out, f"{label}-{rnd}")
    trace_path, result_path = stem + ".trace.jsonl", stem + ".bench.jsonl"
    for path in (trace_path, result_path):
        for stale in (path, path + ".gz"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(extra, OMP_WAIT_POLICY="PASSIVE", KARA_TRACE=trace_path)
    if cwd != ROOT:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (cwd, env.get("PYTHONPATH")) if p
        )
    client_env = {k: v for k, v in env.items() if k != "KARA_TRACE"}
    proc, url, startup = when_ram_allows(
        lambda: start_in(cwd, env, stem + ".log", cmd), args.wait_ram
    )
    try:
        run_load(url, 2, 16)  # warm-up: first forwards, allocator (outside the window)
        t0 = time.perf_counter()
        with open(stem + ".client.log", "w") as log:
            subprocess.run(
                client_command(
                    url, result_path, args.prompts, args.input_len, args.output_len
                ),
                cwd=ROOT,
                env=client_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                check=True,
                timeout=7200,
            )
        t1 = time.perf_counter()
        info = requests.get(url + "/server_info", timeout=30).json()
    finally:
        stop(proc)
    from bench.record import SERVER_FIELDS

    server = {k: info.get(k) for k in SERVER_FIELDS}
    kara = info["internal_states"][0].get("kara")
    config = {"server": server, "argv": cmd[1:], "env": extra}
    if name == "sglang":
        config["kara"] = {"policy": "none"}
    # the launcher's own resolution (another revision's: its server log)
    elif cwd == ROOT:
        config["kara"] = record_server_config(tuple(cmd[3:]))["kara"]
    record.add_config(label, {**config, "commit": commit_of(None, cwd)})
    with open(result_path) as f:
        result = json.loads(f.read().splitlines()[-1])
    with open(trace_path) as f:
        trace = [json.loads(line) for line in f]
    steps = window(trace, t0, t1)
    gzip_in_place(trace_path)
    gzip_in_place(result_path, round_times=True)
    out = dict(
        system=label,
        round=rnd,
        startup_s=round(startup, 1),
        **client_figures(result),
        **timeline(steps),
        max_running_requests=server["max_running_requests"],
        max_total_tokens=server["max_total_tokens"],
    )
    rate = cpu_rate(steps)
    if rate:
        out.update(
            tok_per_sched_cpu_s=round(rate["tps"], 1),
            compress_share=round(rate["event_share"], 4),
            rows_per_request=round(rate["rows_per_request"], 1),
        )
    if kara:
        out.update(
            events=kara.get("events"),
            event_max_ms=round(1e3 * kara.get("event_max_seconds", 0.0), 1),
            compression_s=round(kara.get("compression_seconds", 0.0), 2),
            skipped_no_memory=kara.get("skipped_no_memory"),
        )
    return out


@functools.cache
def record_server_config(launch_argv: tuple[str, ...]) -> dict:
    """What the checkout's launcher resolves these flags to (bench/record.py), once per argv."""
    from bench.record import server_config

    return server_config(list(launch_argv))


# ------------------------------------------------------------------ report
KEYS = (
    "tok_s tok_per_sched_cpu_s itl_p50_ms itl_p99_ms itl_max_ms "
    "mean_running running_while_waiting peak_running max_running_requests "
    "events"
).split()


def table(runs: list[dict], allows: dict) -> str:
    lines = [
        "| system | round | " + " | ".join(KEYS) + " | running by tenth of the run |",
        "|---|---|" + "---|" * (len(KEYS) + 1),
    ]
    for r in runs:
        cells = []
        for k in KEYS:
            v = r.get(k)
            cells.append(
                "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)
            )
        tenths = " ".join("-" if x is None else f"{x:g}" for x in r.get("by_tenth", []))
        lines.append(
            f"| {r['system']} | {r['round']} | " + " | ".join(cells) + f" | {tenths} |"
        )
    lines += ["", "What the pool allows at each side's admission charge:", ""]
    lines += [
        "| side | prompt | charge admitted | charge running | peak KV | steady | one admission | joined |"
    ]
    lines += ["|---|---|---|---|---|---|---|---|"]
    for side, a in allows.items():
        c, n = a["charges"], a["allows"]
        lines.append(
            f"| {side} | {a['prompt']} | {c['new']} | {c['running']} | {c['peak']} "
            f"| {n['steady']} | {n['admitted']} | {n['joined']} |"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    arg = ap.add_argument
    arg("--out", required=True)
    arg("--systems", default="sglang,kara")
    arg("--rounds", type=int, default=2)
    arg("--prompts", type=int, default=16)
    arg("--input-len", type=int, default=128)
    arg("--output-len", type=int, default=1536)
    arg("--pool", type=int, default=8192, help="KV pool tokens, both sides")
    h = "minutes to wait, retrying, while a server is refused for want of RAM"
    arg("--wait-ram", type=float, default=30, help=h)
    h = "sgl_kara's --kara-* flags, one string (e.g. the long-reasoning preset's)"
    arg("--kara-flags", default="", help=h)
    args = ap.parse_args(argv)
    args.kara_flags = tuple(shlex.split(args.kara_flags))
    bad = [
        f for f in args.kara_flags if f.startswith("--") and not f.startswith("--kara-")
    ]
    if bad:
        ap.error(f"--kara-flags takes --kara-* flags only, got {bad}")
    # servers of other revisions run from elsewhere
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    from bench.record import RunRecord

    cfg, resolved = when_ram_allows(
        lambda: resolve(args.pool, args.kara_flags), args.wait_ram
    )
    record = RunRecord(args.out, argv)
    record.note(
        prompts=args.prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        pool=args.pool,
        client=CLIENT,
        dataset="random-ids",
    )
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    parsed = {s: parse_system(s) for s in systems}
    revs = sorted({rev for _, rev in parsed.values() if rev})
    runs: list[dict] = []
    with worktrees(revs) as paths:
        for rnd in range(args.rounds):
            k = rnd % len(systems)
            for spec in systems[k:] + systems[:k]:
                name, rev = parsed[spec]
                cwd = paths[rev] if rev else ROOT
                res = run_one(spec, name, cwd, resolved, args, rnd, record)
                runs.append(res)
                print(json.dumps(res), flush=True)
                with open(os.path.join(args.out, "serving.json"), "w") as f:
                    json.dump(dict(runs=runs), f, indent=1)
    prompt = round(sum(r["prompt"] for r in runs if "prompt" in r) / max(1, len(runs)))
    allows = {}
    policy = kara_policy(cfg.to_dict())
    for side, pol in (("plain SGLang", None), ("sgl_kara", policy)):
        charges = admission_charges(pol, prompt, args.output_len, resolved.page_size)
        allows[side] = dict(
            prompt=prompt, charges=charges, allows=pool_allows(args.pool, charges)
        )
    with open(os.path.join(args.out, "serving.json"), "w") as f:
        json.dump(dict(runs=runs, allows=allows), f, indent=1)
    text = table(runs, allows)
    record.write_md(os.path.join(args.out, "serving.md"), text)
    record.finish()
    print(text)


if __name__ == "__main__":
    main()
