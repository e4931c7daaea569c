"""Where the scheduler's time goes: one grid workload, one system, py-spy on the scheduler process.

    python -m bench.profile_scheduler --model tiny --gen 256 --pool-fraction 0.5 --window 64 \
        --system kara --out /tmp/prof

Runs the workload of ``python -m bench.throughput --grid`` (same prompts, pool and Kara shape) once,
samples the scheduler with ``py-spy record --format raw`` (collapsed stacks; ``pip install
py-spy``) and writes ``stacks.txt`` (raw: keep it out of the repository), ``summary.md`` and the run
record (run.json, bench/record.py): the share of samples in each stage below
(a sample counts for the first stage, in this order, that one of its frames matches) and the
heaviest leaf frames inside compression events.

    event: recompute forward   EventRunner._recompute           (the extra forward, App. C.2)
    event: scoring             ScoringPass / window_scores      (captured queries, or hooks)
    event: select              policy select / top_k
    event: compaction          compact_rows / compact_kv
    event: other               the rest of EventRunner.run / plan_jobs
    per-step Kara              on_decode_step, forward hooks (offsets, ring writes)
    decode attention           torch_native decode (cpu/attention.py or SGLang's)
    forward: projections + MLP, logits (lm_head), norms, rotary, activation
                               the model's forward by SGLang layer file
    forward (other)            the model's forward outside attention and those layers
    sampling                   SGLang's Sampler
    result processing          the scheduler's per-request output handling
    scheduler (other)          everything else (batching, IPC)
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

EVENT_STAGES = [  # inside EventRunner.run; the innermost matching frame decides
    ("event: recompute forward", ("EventRunner._recompute ",)),
    ("event: scoring", ("score_layer ", "window_scores", "ScoringPass.")),
    ("event: select", ("select (", "top_k (")),
    ("event: compaction", ("compact_rows ", "compact_kv ", "copy_slots ")),
]
STEP_STAGES = [  # outside events; the innermost matching frame decides
    ("decode attention", ("run_sdpa_forward_decode ", "_run_sdpa_forward_decode ")),
    ("attention (extend)", ("forward_extend ",)),
    ("ring writes / observers", ("QueryRing.write ", "observe (")),
    (
        "per-step Kara",
        ("on_decode_step ", "on_forward_batch ", "sync_offset ", "plan_jobs "),
    ),
    # the model's forward by SGLang layer file: a key ending in '/' or '.py:' names a file (py-spy
    # writes the shortest unique path suffix, e.g. "forward (linear.py:626)")
    ("forward: projections + MLP (linear)", ("linear.py:", "unquant.py:")),
    ("forward: logits (lm_head)", ("logits_processor.py:",)),
    ("forward: norms", ("layernorm.py:",)),
    ("forward: rotary", ("rotary_embedding/", "rotary_embedding.py:")),
    ("forward: activation", ("activation.py:",)),
    ("model forward (other)", ("ModelRunner.forward ",)),
    ("sampling", ("sampler.py:",)),
    ("result processing", ("scheduler_output_processor_mixin.py:",)),
]
ORDER = (
    [n for n, _ in EVENT_STAGES]
    + ["event: other"]
    + [n for n, _ in STEP_STAGES]
    + ["scheduler (other)"]
)


def _in_file(frame: str, key: str) -> bool:
    """Does ``frame`` ("function (path/file.py:line)") lie in the file or folder ``key`` names?"""
    return f"({key}" in frame or f"/{key}" in frame


def stage_of(stack: str) -> str:
    frames = stack.split(";")
    if any(f.startswith("EventRunner.run ") for f in frames):
        stages, fallback = EVENT_STAGES, "event: other"
    else:
        stages, fallback = STEP_STAGES, "scheduler (other)"
    for frame in reversed(frames):
        for name, keys in stages:
            if any(
                _in_file(frame, k) if k.endswith(("/", ".py:")) else frame.startswith(k)
                for k in keys
            ):
                return name
    return fallback


def summarize(stacks_path: str, step_ms: float | None = None) -> str:
    """Samples per stage; with ``step_ms`` (the run's mean scheduler CPU per decode step) also each
    stage's CPU ms per step, which runs at different batch sizes can be compared by."""
    per_stage: collections.Counter = collections.Counter()
    event_leaves: collections.Counter = collections.Counter()
    total = 0
    for line in open(stacks_path):
        line = line.rstrip("\n")
        if not line or " " not in line:
            continue
        stack, count = line.rsplit(" ", 1)
        if "event_loop" not in stack:
            continue  # start-up (model load), other threads (watchdog, IPC)
        n = int(count)
        total += n
        stage = stage_of(stack)
        per_stage[stage] += n
        if stage.startswith("event"):
            event_leaves[";".join(stack.split(";")[-2:])] += n
    ms = f", CPU per decode step {step_ms:.1f} ms" if step_ms else ""
    lines = [
        f"samples in the scheduler's event loop: {total}{ms}",
        "",
        "| stage | samples | share | ms per step |",
        "|---|---|---|---|",
    ]
    for name in ORDER:
        share = per_stage[name] / max(1, total)
        lines.append(
            f"| {name} | {per_stage[name]} | {100 * share:.1f}% | "
            f"{'-' if not step_ms else f'{share * step_ms:.2f}'} |"
        )
    lines += ["", "heaviest frames inside events (last two frames):", ""]
    lines += [f"- {n} {leaf}" for leaf, n in event_leaves.most_common(15)]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The options; the parsed namespace is also what the grid's runner reads (``run_one``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model", default="tiny", help="tiny | smollm2 | a checkpoint path"
    )
    ap.add_argument(
        "--system",
        default="kara",
        help="vanilla | kara | snapkv | streaming | h2o | rkv",
    )
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--pool-fraction", type=float, default=0.5)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument(
        "--spread",
        type=float,
        default=0.0,
        help="output lengths spread evenly over [G(1-S), G(1+S)], as the grid's --spread",
    )
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--retention", type=float, default=0.25)
    ap.add_argument("--omp-threads", type=int, default=1)
    ap.add_argument(
        "--query-source", default="auto", choices=("auto", "capture", "recompute")
    )
    ap.add_argument(
        "--kara-opt",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra sgl_kara option for the kara system, e.g. trigger=pressure (repeatable)",
    )
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--out", required=True)
    return ap


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    import psutil
    from transformers import AutoTokenizer

    from bench import throughput_grid as grid
    from bench.engine_run import run_system
    from bench.record import RunRecord

    model = grid.model_path(args.model)
    args.model_path = model
    record = RunRecord(args.out, argv)
    tok = AutoTokenizer.from_pretrained(model)
    prompts = grid.grid_prompts(args.requests)
    p_len = max(len(tok(p)["input_ids"]) for p in prompts) + 1
    pool = int(args.pool_fraction * args.requests * (p_len + args.gen))
    try:  # --kara-opt items go into the system's options (grid.system_spec)
        label, opts, per_request = grid.system_spec(
            args.system, args.gen, args.window, args, args.requests
        )
    except ValueError as e:
        ap.error(str(e))
    if args.kara_opt and opts is None:
        ap.error("--kara-opt applies to a compression system, not vanilla")
    stacks = os.path.join(args.out, "stacks.txt")
    scratch = tempfile.mkdtemp(prefix="profile_scheduler_")  # py-spy's pid and log
    stop = threading.Event()
    spy: list = []

    def attach():
        # The scheduler is a child of this process: wait until it exists, then sample it until
        # told to stop (py-spy writes its stacks when interrupted).
        me = psutil.Process()
        while not stop.is_set():
            for child in me.children(recursive=True):
                try:
                    if "scheduler" in " ".join(child.cmdline()):
                        # Detached (sh exits, py-spy is re-parented): SGLang's Engine.shutdown kills every
                        # child of this process, which would kill py-spy before it writes.
                        spy_bin = os.path.join(
                            os.path.dirname(sys.executable), "py-spy"
                        )
                        pid_file = os.path.join(scratch, "py-spy.pid")
                        subprocess.run(
                            [
                                "sh",
                                "-c",
                                f"'{spy_bin}' record --pid {child.pid} --rate {args.rate} --format raw "
                                f"--output '{stacks}' --nonblocking > '{scratch}/py-spy.log' 2>&1 & "
                                f"echo $! > '{pid_file}'",
                            ],
                            check=True,
                        )
                        spy.append(int(open(pid_file).read()))
                        return
                except psutil.Error:
                    pass
            time.sleep(0.2)

    t = threading.Thread(target=attach, daemon=True)
    t.start()
    try:
        r = grid.run_one(
            run_system, args, prompts, args.gen, pool, label, opts, per_request, record
        )
    finally:
        stop.set()
        t.join(timeout=10)
        for pid in spy:
            try:
                os.kill(pid, signal.SIGINT)
            except ProcessLookupError:
                pass
            for _ in range(600):  # py-spy writes its stacks, then exits
                if (
                    not psutil.pid_exists(pid)
                    or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
                ):
                    break
                time.sleep(0.1)
    text = (
        f"model {model}, {label}, G={args.gen} (spread {args.spread:g}), pool {pool} ({args.pool_fraction:g}), "
        f"{args.requests} requests\n"
        f"tok/sched-CPU-s {r['tps_sched']:.1f}, mean running {r['mean_running']:.1f}, events {r['events']}, "
        f"compress share {100 * r['compress_share']:.1f}%\n"
        f"steps with a request waiting: {100 * r.get('waiting_share', 0):.0f}%, mean running then "
        f"{r.get('running_while_waiting')}, after {r.get('running_after_waiting')}; "
        f"mean running by tenth of the steps: {r.get('running_by_tenth')}\n\n"
    )
    steps = r.get("steps_rate")
    step_ms = 1e3 * steps["cpu"] / steps["steps"] if steps else None
    text += (
        summarize(stacks, step_ms)
        if os.path.exists(stacks)
        else "py-spy wrote no stacks\n"
    )
    record.write_md(os.path.join(args.out, "summary.md"), text)
    record.finish()
    print(text)


if __name__ == "__main__":
    main()
