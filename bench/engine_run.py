"""One engine, one workload, measured: what every throughput comparison runs per system.

``run_system`` starts plain ``sglang.Engine`` (system ``vanilla``) or ``sgl_kara.Engine`` with the
given ``kara_*`` options on a KV pool of ``pool`` tokens, warms it up, generates the workload, and
returns a ``RunResult``: output tokens, wall and CPU seconds (the scheduler's apart), running
requests, retractions, compression events and their time, and the per-step trace (the plugin's
``KARA_TRACE`` hook, which instruments vanilla and Kara schedulers alike). Used by the workload
grid, bench/throughput_grid.py (``python -m bench.throughput --grid`` runs it).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass

from bench.engine_env import engine_env


@dataclass
class RunResult:
    system: str
    pool: int
    max_running: int
    seconds: float
    output_tokens: int
    lengths_ok: bool
    retractions: int
    mean_running: float
    peak_running: int
    events: int
    compress_seconds: float
    trace: list
    repeat: int = 0
    cpu_seconds: float = 0.0  # engine processes' CPU time during the run
    scheduler_cpu_seconds: float = 0.0  # of which the scheduler's (the model's compute)
    # capture query ring (memory beyond the KV pool; 0 with recompute)
    ring_bytes: int = 0
    # windows scored by recompute although capture was on (no ring row)
    fallbacks: int = 0
    mean_kv: float = 0.0  # KV rows a request held per decode step, mean over requests (what attention reads)
    skipped: int = 0  # due requests an event could not compact (no fresh slots), mostly skipped unscored

    @property
    def tps_cpu(self) -> float:
        """Output tokens per engine CPU-second (less sensitive to other load than wall time)."""
        return self.output_tokens / self.cpu_seconds if self.cpu_seconds else 0.0

    @property
    def tps_scheduler_cpu(self) -> float:
        return (
            self.output_tokens / self.scheduler_cpu_seconds
            if self.scheduler_cpu_seconds
            else 0.0
        )

    @property
    def steps(self) -> int:
        """Scheduler iterations that had requests running (decode steps, prefills folded in)."""
        return sum(1 for r in self.trace if r["running"] > 0)

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.seconds / max(1, self.steps)

    @property
    def tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def compress_share(self) -> float:
        return self.compress_seconds / self.seconds if self.seconds else 0.0


def engine_cpu_seconds() -> tuple[float, float]:
    """(CPU seconds used so far by this process and its children -- the engine's scheduler and
    detokenizer; its tokenizer manager runs in this process --, of which by the scheduler)."""
    import psutil

    me = psutil.Process()
    total, scheduler = sum(me.cpu_times()[:2]), 0.0
    for child in me.children(recursive=True):
        try:
            t = sum(child.cpu_times()[:2])
            total += t
            if "scheduler" in " ".join(child.cmdline()):
                scheduler += t
        except psutil.Error:
            pass
    return total, scheduler


def pin_scheduler() -> tuple[set[int], list] | None:
    """Give the engine's scheduler (the process that runs the model) the last core to itself and
    every other engine process (this one: tokenizer manager; the detokenizer) the others, so the
    processes do not trade cores mid-run. Returns what to restore, or None on a 1-core machine."""
    import psutil

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    me = psutil.Process()
    saved = set(cores)
    for child in me.children(recursive=True):
        try:
            child.cpu_affinity(
                [cores[-1]] if "scheduler" in " ".join(child.cmdline()) else cores[:-1]
            )
        except psutil.Error:
            pass
    me.cpu_affinity(cores[:-1])
    return saved, cores


def unpin(pinned) -> None:
    if pinned is not None:
        os.sched_setaffinity(0, pinned[0])


def run_system(
    system: str,
    args,
    pool: int,
    max_running: int,
    kara: dict | None = None,
    prompts_params=None,
    label: str | None = None,
    repeat: int = 0,
    record=None,
) -> RunResult:
    """One engine, one workload. ``system``: ``vanilla`` (plain ``sglang.Engine`` with sgl_kara's CPU
    defaults) or any other name (``sgl_kara.Engine`` with the ``kara_*`` options ``kara``);
    ``prompts_params``: (prompts, sampling params); ``args``: ``model_path``, ``omp_threads``,
    ``pin``; ``record``: a bench.record.RunRecord that gets the engine's resolved settings."""
    import sglang

    import sgl_kara
    from sgl_kara.cpu.server import cpu_defaults
    from sgl_kara.engine import shutdown_cleanly

    if system != "vanilla" and kara is None:
        raise ValueError(
            f"run_system({system!r}): a compressing system needs its kara_* options"
        )
    trace_path = tempfile.mktemp(prefix=f"trace_{system}_", suffix=".jsonl")
    # Both sides at SGLang's defaults (the overlap scheduler on); plain SGLang runs sgl_kara's CPU
    # kernels (KARA_CPU_KERNELS=1) so that only compression differs.
    common = dict(max_total_tokens=pool, max_running_requests=max_running)
    common.update(log_level="error", random_seed=0, disable_radix_cache=False)
    kernels = {"KARA_CPU_KERNELS": "1"} if system == "vanilla" else {}
    if args.model_path:
        common["model_path"] = args.model_path
    with engine_env(args.omp_threads, KARA_TRACE=trace_path, **kernels):
        if system == "vanilla":
            from sgl_kara.cpu.smollm2 import default_model_path

            engine = sglang.Engine(
                **{"model_path": default_model_path(), **cpu_defaults(), **common}
            )
        else:
            engine = sgl_kara.Engine(**common, **kara)
    if record is not None:
        record.add_engine(label or system, engine)
    pinned = pin_scheduler() if getattr(args, "pin", False) else None
    try:
        prompts, params = prompts_params
        engine.generate(prompts[:2], {"max_new_tokens": 4})  # warm up
        with open(trace_path, "w"):
            pass
        cpu0, sched0 = engine_cpu_seconds()
        tic = time.perf_counter()
        outs = engine.generate(prompts, params)
        seconds = time.perf_counter() - tic
        cpu1, sched1 = engine_cpu_seconds()
    finally:
        shutdown_cleanly(engine)  # vanilla sglang.Engine too
        unpin(pinned)
    trace = [json.loads(line) for line in open(trace_path)]
    os.unlink(trace_path)
    running = [r["running"] for r in trace if r["running"] > 0]
    comp = [o["meta_info"]["completion_tokens"] for o in outs]
    kv = [
        o["meta_info"]["kara"]["kv_mean_len"]
        for o in outs
        if (o["meta_info"].get("kara") or {}).get("kv_mean_len")
    ]
    # vanilla: every row grows by one per step, prompt + half the output on average
    if not kv:
        kv = [
            o["meta_info"]["prompt_tokens"] + o["meta_info"]["completion_tokens"] / 2
            for o in outs
        ]
    want = [p["max_new_tokens"] for p in params]
    first, last = (trace[0], trace[-1]) if trace else ({}, {})

    def grew(key: str):
        return last.get(key, 0) - first.get(key, 0)

    return RunResult(
        system=label or system,
        pool=pool,
        max_running=max_running,
        seconds=seconds,
        output_tokens=sum(comp),
        lengths_ok=comp == want,
        retractions=sum(o["meta_info"].get("num_retractions", 0) or 0 for o in outs),
        mean_running=sum(running) / max(1, len(running)),
        peak_running=max(running, default=0),
        events=last.get("kara_events", 0),
        compress_seconds=float(grew("kara_seconds")),
        trace=trace,
        repeat=repeat,
        cpu_seconds=cpu1 - cpu0,
        scheduler_cpu_seconds=sched1 - sched0,
        ring_bytes=last.get("kara_ring_bytes", 0),
        fallbacks=grew("kara_recompute_fallbacks"),
        mean_kv=sum(kv) / len(kv),
        skipped=grew("kara_skipped_no_memory"),
    )
