"""The GPU suite's checks, each a function returning its figures (tests/test_gpu.py asserts on
them; bench/gpu_suite.py runs them all and writes a results file). On a CUDA machine they use
SGLang's GPU backends (fa3, FlashInfer, Triton), bfloat16 and decode CUDA graphs; on CPU
(``bench/gpu_suite.py --cpu``) the parts that can run do, with torch_native attention and the
Triton kernels under TRITON_INTERPRET=1.

Models are written locally with head_dim 64 (fa3 and FlashInfer reject the tests' usual 16).
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
from conftest import (
    ENGINE_COMMON,
    _release_tasks_on_shutdown,
    _track,
    engine_env,
    flush_when_idle,
)

KARA_SMALL = dict(
    kara_window=40, kara_buffer=8, kara_chunk_budget=2, kara_max_chunk=4, kara_period=4
)
PROMPTS = [
    "Hello world",
    "Let x = 3. Let y = x + 4, so y = 7. Then z",
    "Once upon a time there was a server",
]


def cuda() -> bool:
    return torch.cuda.is_available()


def write_gpu_model(path: str, arch: str = "llama") -> str:
    from bench.models.tiny import write_tiny_model

    return str(
        write_tiny_model(
            path,
            arch,
            hidden_size=256,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
            intermediate_size=512,
            seed=11,
        )
    )


# CUDA graph capture sizes (SGLang 0.5.23 captures decode and, breakable, prefill graphs by
# default on CUDA): decode batches up to 16 requests (6 graphs), prefill batches up to 64 tokens
# (10 graphs). The checks run a few requests; capture time bounds each engine start.
DECODE_GRAPH_MAX_BS = 16
PREFILL_GRAPH_MAX_TOKENS = 64


def device_options(backend: str, page: int) -> dict:
    """Engine options (ServerArgs fields) for one attention backend and page size on this machine
    (tests/test_gpu_resolution.py resolves them with SGLang as on CUDA)."""
    if cuda():
        return dict(
            device="cuda",
            attention_backend=backend,
            page_size=page,
            dtype="bfloat16",
            mem_fraction_static=0.5,
            cuda_graph_max_bs_decode=DECODE_GRAPH_MAX_BS,
            cuda_graph_max_bs_prefill=PREFILL_GRAPH_MAX_TOKENS,
        )
    return dict(
        device="cpu", attention_backend=backend, page_size=page, dtype="float32"
    )


def decode_graphs_off(server_args) -> bool:
    """Whether an engine's resolved server args replay no decode CUDA graph (SGLang 0.5.23's
    resolved ``cuda_graph_config``; a record not resolved yet is read as it stands)."""
    cfg = server_args
    if getattr(server_args, "_resolution_finished", False):
        from sglang.srt.arg_groups.overrides import resolving_view

        cfg = resolving_view(server_args)
    return cfg.cuda_graph_config.decode.backend == "disabled"


def start(kind: str, model: str, **opts):
    """Vanilla SGLang (kind "sglang") or sgl_kara on this machine (Triton interpreted on CPU)."""
    opts = {**ENGINE_COMMON, **opts}
    interpret = (
        {"TRITON_INTERPRET": "1"}
        if not cuda() and opts.get("attention_backend") == "triton"
        else {}
    )
    with engine_env(**interpret):
        if kind == "sglang":
            import sglang

            engine = sglang.Engine(model_path=model, **opts)
            _release_tasks_on_shutdown(engine)
        else:
            import sgl_kara

            engine = sgl_kara.Engine(model_path=model, **opts)
    _track(engine)
    return engine


_VANILLA: dict[
    tuple, list
] = {}  # (model, backend, page, graphs off, gen) -> vanilla greedy tokens


def token_identity(
    model: str, backend: str, page: int, query_source: str, gen: int = 96
) -> dict:
    """Retention 1.0 (every window compacted into fresh slots, nothing dropped) must give vanilla
    SGLang's greedy tokens with the same backend, page size and decode CUDA-graph setting (the
    Kara run's, as resolved at its start: off for capture, on for recompute; prefill graphs as
    SGLang sets them in both); a vanilla reference is started once per configuration and reused."""
    greedy = {"max_new_tokens": gen, "temperature": 0.0, "ignore_eos": True}
    opts = device_options(backend, page)
    eng = start(
        "kara",
        model,
        kara_retention=1.0,
        kara_query_source=query_source,
        **KARA_SMALL,
        **opts,
    )
    try:
        outs = eng.generate(PROMPTS, greedy)
        graphs_off = decode_graphs_off(eng.server_args)
    finally:
        eng.shutdown()
    key = (model, backend, page, graphs_off, gen)
    if key not in _VANILLA:
        ref = start("sglang", model, disable_decode_cuda_graph=graphs_off, **opts)
        try:
            _VANILLA[key] = [o["output_ids"] for o in ref.generate(PROMPTS, greedy)]
        finally:
            ref.shutdown()
    want = _VANILLA[key]
    return dict(
        identical=all(o["output_ids"] == w for o, w in zip(outs, want)),
        compressions=[o["meta_info"]["kara"]["compressions"] for o in outs],
        cuda_graphs=not graphs_off,
    )


def oracle(model: str, backend: str, page: int, query_source: str, tmp: str) -> dict:
    """Kara at r=0.25 over several events vs the HF model with the evicted entries masked.
    bfloat16 on CUDA: the tolerance is bfloat16 rounding through a 2-layer model; the margin the
    unmasked reference must be off by (non-vacuity) measures the evictions' effect, so it stays
    the float32 one (20 x 2e-3) and must also exceed twice the observed error."""
    from pathlib import Path

    from oracle import TOL, run_and_check

    tol = 6e-2 if cuda() else TOL
    _, _, worst, control = run_and_check(
        model,
        Path(tmp),
        page,
        query_source,
        extra={**device_options(backend, page)},
        tol=tol,
        margin=20 * TOL,
    )
    return dict(max_err=worst, unmasked_control=control, tol=tol, margin=20 * TOL)


def retraction_storm(model: str, backend: str, page: int) -> dict:
    """SGLang's forced retractions every 3 steps, integrity checks at every event, SGLang's KV page
    invariant checks (conftest), then every slot free (strict idle check + a flush)."""
    env = dict(
        SGLANG_TEST_RETRACT="1",
        SGLANG_TEST_RETRACT_INTERVAL="3",
        KARA_CHECK_INTEGRITY="1",
    )
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        eng = start(
            "kara",
            model,
            kara_retention=0.25,
            max_total_tokens=2048,
            max_running_requests=6,
            **KARA_SMALL,
            **device_options(backend, page),
        )
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    try:
        outs = eng.generate(
            PROMPTS * 2,
            {"max_new_tokens": 120, "min_new_tokens": 120, "temperature": 0.7},
        )
        freed = flush_when_idle(eng)
    finally:
        eng.shutdown()
    return dict(
        all_finished=all(o["meta_info"]["completion_tokens"] == 120 for o in outs),
        all_slots_free=freed,
        retractions=sum(o["meta_info"].get("num_retractions", 0) or 0 for o in outs),
        compressions=sum(o["meta_info"]["kara"]["compressions"] for o in outs),
    )


def event_memory(model: str, backend: str, page: int, n_requests: int = 16) -> dict:
    """Peak device memory an event allocates above its start (KARA_TRACE records it)."""
    trace = tempfile.mktemp(suffix=".jsonl")
    saved = os.environ.get("KARA_TRACE")
    os.environ["KARA_TRACE"] = trace
    try:
        eng = start(
            "kara",
            model,
            kara_retention=0.25,
            kara_query_source="recompute",
            **KARA_SMALL,
            **device_options(backend, page),
        )
    finally:
        os.environ.pop("KARA_TRACE") if saved is None else os.environ.__setitem__(
            "KARA_TRACE", saved
        )
    try:
        eng.generate(
            [f"{p} {i}" for i in range(n_requests) for p in PROMPTS[:1]],
            {"max_new_tokens": 200, "temperature": 0.0, "ignore_eos": True},
        )
    finally:
        eng.shutdown()
    rows = [json.loads(line) for line in open(trace)]
    os.unlink(trace)
    return dict(
        events=rows[-1]["kara_events"],
        event_peak_bytes=max(r["kara_event_peak_bytes"] for r in rows),
    )


def kernels(model_name: str | None = None) -> dict:
    """bench/gpu_kernels.py for one model's serving shapes (CUDA; the tiny shapes on CPU): every
    Triton kernel against its reference, the pool sized to the device's memory."""
    from bench import (
        gpu_kernels as gk,
    )  # the repository root is on the path (pytest, python -m)

    small = not cuda()
    models = gk.SMALL_MODELS if small else gk.MODELS
    name = model_name or next(iter(models))
    timer = gk.Timer(cuda())
    rows = gk.run_model(
        name,
        models[name],
        small,
        gk.choose_batch(small),
        timer,
        gk.SMALL_REPS if small else gk.REPS,
        "cuda" if cuda() else "cpu",
    )
    return dict(
        all_ok=all(r["ok"] is not False for r in rows),
        model=name,
        rows=[
            {k: r.get(k) for k in ("kernel", "ok", "ms", "gb_s", "rel_err")}
            for r in rows
        ],
    )


# ------------------------------------------------------------------ the suite's plan
# One entry per check: (name, function, args, engine starts, decode steps, pass predicate). Each
# check starts its engines once; a vanilla reference is shared by the checks of one configuration.
# The time bound (budget_seconds) follows from the counts.
START_S = 20.0  # one engine start on one H100: imports, a 2-layer model, 6 decode + 10 prefill graphs
STEP_S = 0.02  # one decode step of a few requests (pessimistic: 50 steps/s)
REFERENCE_S = 10.0  # the HF reference of one oracle check
# bench/gpu_kernels.py for one model (gpu_kernels.estimate_seconds per model)
KERNELS_S = 90.0
GPU_BACKENDS = ("fa3", "flashinfer", "triton")


def _identity_ok(r):
    return r["identical"] and min(r["compressions"]) >= 2


def _oracle_ok(r):
    return r["max_err"] < r["tol"] and r["unmasked_control"] > max(
        r["margin"], 2 * r["max_err"]
    )


def _storm_ok(r):
    return r["all_finished"] and r["all_slots_free"] and r["retractions"] > 0


def plan(cpu: bool) -> list[tuple]:
    """The checks for this machine (CUDA, or ``cpu``: torch_native, kernels interpreted)."""
    if cpu:
        recompute = [("torch_native", 1), ("torch_native", 16)]
        capture = [("torch_native", 16)]
        oracles = [("torch_native", 1, "recompute")]
        storms = [("torch_native", 1)]
    else:
        recompute = [
            (b, p) for b in GPU_BACKENDS for p in (1, 64)
        ]  # decode CUDA graphs on
        capture = [("triton", 64)]  # graphs off
        oracles = [("fa3", 1, "recompute"), ("flashinfer", 64, "capture")]
        storms = [("flashinfer", 1), ("flashinfer", 64)]
    checks = []
    for backend, page in recompute:
        checks.append(
            (
                f"identity {backend} page {page} recompute",
                "token_identity",
                (backend, page, "recompute"),
                2,
                2 * 96,
                _identity_ok,
            )
        )
    for backend, page in capture:
        checks.append(
            (
                f"identity {backend} page {page} capture",
                "token_identity",
                (backend, page, "capture"),
                2,
                2 * 96,
                _identity_ok,
            )
        )
    for backend, page, qs in oracles:
        checks.append(
            (
                f"oracle {backend} page {page} {qs}",
                "oracle",
                (backend, page, qs),
                1,
                150,
                _oracle_ok,
            )
        )
    for backend, page in storms:
        checks.append(
            (
                f"retraction storm {backend} page {page}",
                "retraction_storm",
                (backend, page),
                1,
                2 * 120,
                _storm_ok,
            )
        )
    checks.append(("kernels", "kernels", (), 0, 0, lambda r: r["all_ok"]))
    if not cpu:
        checks.append(
            (
                "event memory fa3",
                "event_memory",
                ("fa3", 1),
                1,
                200,
                lambda r: r["events"] > 0 and 0 < r["event_peak_bytes"] < 1 << 30,
            )
        )
    return checks


def budget_seconds(checks) -> float:
    """Upper bound of a CUDA run of ``checks`` from their engine starts and decode steps."""
    return sum(
        starts * START_S
        + steps * STEP_S
        + (REFERENCE_S if fn == "oracle" else 0)
        + (KERNELS_S if fn == "kernels" else 0)
        for _, fn, _, starts, steps, _ in checks
    )
