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
import time

import torch

from conftest import ENGINE_COMMON, _release_tasks_on_shutdown, _track, engine_env, flush_when_idle

KARA_SMALL = dict(kara_window=40, kara_buffer=8, kara_chunk_budget=2, kara_max_chunk=4, kara_period=4)
PROMPTS = ["Hello world", "Let x = 3. Let y = x + 4, so y = 7. Then z", "Once upon a time there was a server"]


def cuda() -> bool:
    return torch.cuda.is_available()


def write_gpu_model(path: str, arch: str = "llama") -> str:
    from sgl_kara.models.tiny import write_tiny_model

    return str(write_tiny_model(path, arch, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                                head_dim=64, intermediate_size=512, seed=11))


def device_options(backend: str, page: int) -> dict:
    """Engine options for one attention backend and page size on this machine."""
    if cuda():
        return dict(device="cuda", attention_backend=backend, page_size=page, dtype="bfloat16",
                    mem_fraction_static=0.5)
    return dict(device="cpu", attention_backend=backend, page_size=page, dtype="float32")


def start(kind: str, model: str, **opts):
    """Vanilla SGLang (kind "sglang") or sgl_kara on this machine (Triton interpreted on CPU)."""
    opts = {**ENGINE_COMMON, **opts}
    interpret = {"TRITON_INTERPRET": "1"} if not cuda() and opts.get("attention_backend") == "triton" else {}
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


def token_identity(model: str, backend: str, page: int, query_source: str, gen: int = 96) -> dict:
    """Retention 1.0 (every window compacted into fresh slots, nothing dropped) must give vanilla
    SGLang's greedy tokens with the same backend; CUDA graphs stay on for recompute."""
    greedy = {"max_new_tokens": gen, "temperature": 0.0, "ignore_eos": True}
    opts = device_options(backend, page)
    ref = start("sglang", model, **opts)
    try:
        want = [o["output_ids"] for o in ref.generate(PROMPTS, greedy)]
    finally:
        ref.shutdown()
    eng = start("kara", model, kara_retention=1.0, kara_query_source=query_source, **KARA_SMALL, **opts)
    try:
        outs = eng.generate(PROMPTS, greedy)
        graphs = not eng.server_args.disable_cuda_graph
    finally:
        eng.shutdown()
    return dict(identical=all(o["output_ids"] == w for o, w in zip(outs, want)),
                compressions=[o["meta_info"]["kara"]["compressions"] for o in outs], cuda_graphs=graphs)


def oracle(model: str, backend: str, page: int, query_source: str, tmp: str) -> dict:
    """Kara at r=0.25 over several events vs the HF model with the evicted entries masked.
    bfloat16 on CUDA: the tolerance is bfloat16 rounding through a 2-layer model."""
    from pathlib import Path

    from test_oracle import run_and_check

    tol = 6e-2 if cuda() else 2e-3
    _, _, worst, control = run_and_check(model, Path(tmp), page, query_source,
                                         extra={**device_options(backend, page)}, tol=tol)
    return dict(max_err=worst, unmasked_control=control, tol=tol)


def retraction_storm(model: str, backend: str, page: int) -> dict:
    """SGLang's forced retractions every 3 steps, integrity checks at every event, SGLang's KV page
    invariant checks (conftest), then every slot free (strict idle check + a flush)."""
    env = dict(SGLANG_TEST_RETRACT="1", SGLANG_TEST_RETRACT_INTERVAL="3", KARA_CHECK_INTEGRITY="1")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        eng = start("kara", model, kara_retention=0.25, max_total_tokens=2048, max_running_requests=6,
                      **KARA_SMALL, **device_options(backend, page))
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    try:
        outs = eng.generate(PROMPTS * 2, {"max_new_tokens": 120, "min_new_tokens": 120, "temperature": 0.7})
        freed = flush_when_idle(eng)
    finally:
        eng.shutdown()
    return dict(all_finished=all(o["meta_info"]["completion_tokens"] == 120 for o in outs), all_slots_free=freed,
                retractions=sum(o["meta_info"].get("num_retractions", 0) or 0 for o in outs),
                compressions=sum(o["meta_info"]["kara"]["compressions"] for o in outs))


def event_memory(model: str, backend: str, page: int, n_requests: int = 16) -> dict:
    """Peak device memory an event allocates above its start (KARA_TRACE records it)."""
    trace = tempfile.mktemp(suffix=".jsonl")
    saved = os.environ.get("KARA_TRACE")
    os.environ["KARA_TRACE"] = trace
    try:
        eng = start("kara", model, kara_retention=0.25, kara_query_source="recompute",
                      **KARA_SMALL, **device_options(backend, page))
    finally:
        os.environ.pop("KARA_TRACE") if saved is None else os.environ.__setitem__("KARA_TRACE", saved)
    try:
        eng.generate([f"{p} {i}" for i in range(n_requests) for p in PROMPTS[:1]],
                     {"max_new_tokens": 200, "temperature": 0.0, "ignore_eos": True})
    finally:
        eng.shutdown()
    rows = [json.loads(line) for line in open(trace)]
    os.unlink(trace)
    return dict(events=rows[-1]["kara_events"], event_peak_bytes=max(r["kara_event_peak_bytes"] for r in rows))


def kernels(layers: int, kv_heads: int, head_dim: int, slots: int, dtype=torch.bfloat16, batch: int = 30,
            window: int = 512, buffer: int = 32, keep: int = 128) -> dict:
    """The Triton kernels on serving shapes vs their torch references: compaction and slot copies
    bit-exact, window scores within the dtype's tolerance; timings on CUDA."""
    from sgl_kara.kernels.compact import compact_kv, compact_kv_ref, copy_slots
    from sgl_kara.kernels.window_score import window_scores_paged, window_scores_paged_ref

    dev = "cuda" if cuda() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    k = [torch.randn(slots, kv_heads, head_dim, device=dev, dtype=dtype, generator=g) for _ in range(layers)]
    v = [torch.randn(slots, kv_heads, head_dim, device=dev, dtype=dtype, generator=g) for _ in range(layers)]
    m = window - buffer
    region = torch.randperm(slots - 1, device=dev, generator=g)[: batch * (m + keep)].view(batch, m + keep) + 1
    src_rows, dst = region[:, :m], region[:, m:]
    kept = torch.sort(torch.rand(batch, layers, kv_heads, m, device=dev, generator=g).argsort(-1)[..., :keep], -1).values
    src = torch.gather(src_rows[:, None, None, :].expand(-1, layers, kv_heads, -1), 3, kept)
    k2, v2 = [t.clone() for t in k], [t.clone() for t in v]
    compact_kv_ref(k2, v2, src, dst)
    sync = torch.cuda.synchronize if cuda() else (lambda: None)
    tic = time.perf_counter()
    compact_kv(k, v, src, dst)
    sync()
    compact_s = time.perf_counter() - tic
    exact = all(torch.equal(a, b) for a, b in zip(k + v, k2 + v2))
    a, b = region[:, :keep].reshape(-1), region[:, m:].reshape(-1)
    copy_slots(k, v, a, b, disjoint=True)
    copy_exact = all(torch.equal(t[b], t[a]) for t in k + v)
    q = torch.randn(batch, window, kv_heads * 4, head_dim, device=dev, dtype=dtype, generator=g)
    tic = time.perf_counter()
    got = window_scores_paged(q, k[0], src_rows)
    sync()
    score_s = time.perf_counter() - tic
    want = window_scores_paged_ref(q, k[0], src_rows)
    err = float(((got - want).abs().max() / want.abs().max()).item())
    moved = 2 * layers * batch * kv_heads * keep * head_dim * torch.empty((), dtype=dtype).element_size()
    return dict(compact_exact=exact, copy_exact=copy_exact, score_rel_err=err, compact_ms=compact_s * 1e3,
                compact_gb_s=moved / compact_s / 1e9, score_ms=score_s * 1e3,
                shapes=f"L={layers} H_kv={kv_heads} D={head_dim} S={slots} {str(dtype).replace('torch.', '')} "
                       f"B={batch} W={window} keep={keep}")
