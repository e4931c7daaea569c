"""Server arguments before a model loads, in three jobs: unsupported SGLang features refused with a
message naming the flag, never ignored (``_UNSUPPORTED``, ``prepare_server_args``); the settings a
CPU-only machine needs (``cpu_defaults``, ``server_defaults``); ``--kara-query-source auto``
resolved to capture or recompute (``resolve_query_source``)."""

from __future__ import annotations

import dataclasses
import logging
import os

from sgl_kara import env
from sgl_kara.config import KaraConfig
from sgl_kara.memory import (
    CUDA_RING_SHARE,
    MemoryConfigError,
    ModelShape,
    available_ram_bytes,
    check_cpu_fit,
    cpu_memory_defaults,
    cpu_ring_budget,
    plan_text,
    ring_rows,
    total_ram_bytes,
)

logger = logging.getLogger(__name__)

# (ServerArgs field, predicate "is enabled", CLI flag, why)
_UNSUPPORTED = [
    ("speculative_algorithm", lambda v: v not in (None, "", "NONE"), "--speculative-algorithm",
     "speculative decoding verifies several tokens per step; Kara's positions assume one"),
    ("enable_dp_attention", bool, "--enable-dp-attention", "DP attention is not supported yet"),
    ("pp_size", lambda v: (v or 1) > 1, "--pp-size", "pipeline parallelism is not supported yet"),
    ("disaggregation_mode", lambda v: v not in (None, "null"), "--disaggregation-mode",
     "PD disaggregation is not supported yet"),
    ("enable_hierarchical_cache", bool, "--enable-hierarchical-cache", "HiCache is not supported yet"),
    ("enable_mixed_chunk", bool, "--enable-mixed-chunk",
     "mixed chunks re-derive decode prefixes from token counts, which compression changes"),
    ("enable_lmcache", bool, "--enable-lmcache", "LMCache is not supported"),
    ("enable_flexkv", bool, "--enable-flexkv", "FlexKV is not supported"),
    ("enable_streaming_session", bool, "--enable-streaming-session", "streaming sessions are not supported"),
    ("enable_session_radix_cache", bool, "--enable-session-radix-cache", "session radix cache is not supported"),
    ("enable_two_batch_overlap", bool, "--enable-two-batch-overlap", "two-batch overlap is not supported"),
    ("enable_unified_memory", bool, "--enable-unified-memory", "unified memory pools are not supported"),
    ("num_continuous_decode_steps", lambda v: (v or 1) > 1, "--num-continuous-decode-steps",
     "compression runs between decode steps; continuous steps skip it"),
    ("enable_hisparse", bool, "--enable-hisparse", "HiSparse is not supported"),
    ("tp_size", lambda v: (v or 1) > 1, "--tp-size",
     "tensor parallelism is not supported yet: compression events must run in lockstep on every rank "
     "(docs/TENSOR_PARALLEL.md); use --dp-size for several replicas"),
    ("kv_cache_dtype", lambda v: str(v) not in ("auto", "bfloat16", "float16", "float32", "bf16", "fp16"),
     "--kv-cache-dtype", "quantized (fp8) KV caches are not supported: scoring reads keys as floats"),
]
# SGLang environment switches that change the KV layout Kara's kernels index.
_UNSUPPORTED_ENV = [
    ("SGLANG_USE_HND_KVCACHE", "the HND KV layout is not supported: compaction and scoring index NHD slot rows"),
]


class UnsupportedFeature(ValueError):
    pass


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cpu_defaults() -> dict:
    """SGLang settings that make it run on a CPU-only machine (empty on GPU).

    dtype float32: SGLang's "auto" turns a float32 checkpoint into float16, and CPU float16 matmuls
    fall back to slow reference kernels (a py-spy profile of the quality benchmark spent most of
    each decode step in ``fp16_dot_with_fp32_arith`` and the generic ``cpublas_gemm_impl``;
    float32 linear layers were ~5x faster in a microbenchmark on this machine)."""
    if cuda_available():
        return {}
    return {"device": "cpu", "attention_backend": "torch_native", "page_size": 1, "dtype": "float32"}


def server_defaults(model_path: str, given: dict) -> dict:
    """Server args sgl_kara sets when the user did not (``given``: the ServerArgs fields the user
    set, with their values): the CPU defaults plus, on CPU, a KV pool and request limit sized for
    the machine (sgl_kara.memory). On CUDA nothing: SGLang's own defaults apply."""
    out = {k: v for k, v in cpu_defaults().items() if k not in given}
    device = given.get("device") or out.get("device") or ("cuda" if cuda_available() else "cpu")
    if device != "cpu":
        return out
    shape = ModelShape.from_model_path(model_path)
    itemsize = shape.itemsize(given.get("dtype") or out.get("dtype")) if shape is not None else 4
    out.update(cpu_memory_defaults(shape, itemsize, total_ram_bytes(), set(given)))
    return out


def choose_query_source(device: str, ring_bytes: int | None, available_ram: int, device_memory: int | None,
                        kv_pool_bytes: int | None = None) -> str:
    """``--kara-query-source auto``: capture (no extra forward per event) on CPU, where compute is
    the bottleneck, while its ring needs at most CPU_RING_SHARE of the available RAM and at most
    CPU_RING_KV_RATIO x the KV pool (when the pool's size is known); on CUDA recompute (SGLang's
    default request limit makes a ring per request unaffordable) unless the ring is known and
    within CUDA_RING_SHARE of the device memory."""
    if ring_bytes is None:
        return "recompute"
    if device == "cpu":
        return "capture" if ring_bytes <= cpu_ring_budget(available_ram, kv_pool_bytes) else "recompute"
    if device_memory is None:
        return "recompute"
    return "capture" if ring_bytes <= CUDA_RING_SHARE * device_memory else "recompute"


def planned_ring_rows(server_args, cfg: KaraConfig) -> int:
    """Rows a capture ring would get under these server args (memory.ring_rows, as the scheduler
    allocates it); 0 when the policy keeps no queries or the request limit is not known yet."""
    capacity = cfg.query_ring_capacity
    running = getattr(server_args, "max_running_requests", None)
    if not capacity or not running:
        return 0
    return ring_rows(running, getattr(server_args, "max_total_tokens", None), capacity, cfg.query_ring_rows)


def resolve_query_source(cfg: KaraConfig, server_args, shape: ModelShape | None) -> KaraConfig:
    """``auto`` -> capture or recompute (choose_query_source), for the ring ``--kara-query-ring-rows``
    leaves. A ring over budget is not shrunk to fit: on CPU its memory sits beside the KV pool,
    and where memory binds it buys more as KV than as saved forwards (bench/RESULTS.md)."""
    if cfg.query_source != "auto":
        return cfg
    capacity = cfg.query_ring_capacity
    rows = planned_ring_rows(server_args, cfg)
    ring = kv_pool = None
    if shape is not None and rows:
        itemsize = shape.itemsize(server_args.dtype)
        ring = shape.ring_bytes(rows, capacity, itemsize)
        if server_args.max_total_tokens:
            kv_pool = server_args.max_total_tokens * shape.kv_bytes_per_token(itemsize)
    device = server_args.device or ("cuda" if cuda_available() else "cpu")
    device_memory = None
    if device != "cpu" and cuda_available():
        import torch

        device_memory = torch.cuda.get_device_properties(0).total_memory
    source = choose_query_source(device, ring, available_ram_bytes(), device_memory, kv_pool)
    rows_cap = cfg.query_ring_rows if source == "capture" else 0  # a cap is refused with recompute
    return dataclasses.replace(cfg, query_source=source, query_ring_rows=rows_cap)


def default_threads_bind(server_args) -> str | None:
    """On CPU with several scheduler ranks (``--dp-size``), set SGLang's
    ``SGLANG_CPU_OMP_THREADS_BIND`` to the physical cores split evenly over the ranks, unless the
    user set it (rank_cores.py; SGLang refuses more ranks than NUMA nodes without it). Returns the
    value set, else None."""
    from sgl_kara.rank_cores import THREADS_BIND_VAR, split_cores

    ranks = 1
    for field in ("dp_size", "tp_size", "pp_size"):
        ranks *= getattr(server_args, field, None) or 1
    device = server_args.device or ("cuda" if cuda_available() else "cpu")
    if ranks <= 1 or device != "cpu" or os.environ.get(THREADS_BIND_VAR):
        return None
    from sgl_kara._sglang import get_cpu_ids_by_node

    try:
        bind = split_cores(get_cpu_ids_by_node(), ranks)
    except ValueError as e:
        raise UnsupportedFeature(f"--dp-size {server_args.dp_size}: {e}; set {THREADS_BIND_VAR} to share cores") from None
    if bind is not None:
        os.environ[THREADS_BIND_VAR] = bind
        logger.info("sgl_kara: %s=%s (%d scheduler ranks)", THREADS_BIND_VAR, bind, ranks)
    return bind


def prepare_server_args(server_args, cfg: KaraConfig) -> KaraConfig:
    """Refuse unsupported features; select Kara's radix backend; resolve ``auto`` options and
    check, on CPU, that weights + KV pool + capture ring fit in RAM (per replica, times
    ``--dp-size``); set the CPU thread binding for several ranks. Returns the resolved config."""
    if not cfg.enabled:
        default_threads_bind(server_args)
        return dataclasses.replace(cfg, query_source="recompute") if cfg.query_source == "auto" else cfg
    for name, enabled, flag, why in _UNSUPPORTED:
        value = getattr(server_args, name, None)
        if value is not None and enabled(value):
            raise UnsupportedFeature(f"{flag} is not supported with --kara-policy {cfg.policy}: {why}")
    for var, why in _UNSUPPORTED_ENV:
        if env.flag(var, False):
            raise UnsupportedFeature(f"{var}={os.environ[var]} is not supported with --kara-policy {cfg.policy}: {why}")
    backend = getattr(server_args, "radix_cache_backend", None)
    if backend not in (None, "", "kara"):
        raise UnsupportedFeature(
            f"--radix-cache-backend {backend} is not supported with --kara-policy {cfg.policy}: "
            "Kara needs its own backend ('kara') so compressed KV never enters the tree"
        )
    server_args.radix_cache_backend = "kara"
    # Compression edits rows the overlapped forward would still read: run without overlap.
    server_args.disable_overlap_schedule = True
    shape = ModelShape.from_model_path(server_args.model_path)
    if shape is not None and shape.mrope:
        raise UnsupportedFeature(
            f"--model-path {server_args.model_path} uses M-RoPE (multimodal rotary positions), which is not "
            f"supported with --kara-policy {cfg.policy}: its position offsets would not reach mrope_positions")
    cfg = resolve_query_source(cfg, server_args, shape)
    if cfg.query_source == "capture" or cfg.policy_class.observes_decode:
        # Captured queries and decode observers (H2O) run in the attention hook, which a replayed
        # CUDA graph never calls.
        server_args.disable_cuda_graph = True
    if server_args.device == "cpu" and shape is not None and server_args.max_total_tokens:
        rows = planned_ring_rows(server_args, cfg) if cfg.query_source == "capture" else 0
        try:
            sizes = check_cpu_fit(shape, shape.itemsize(server_args.dtype), server_args.max_total_tokens,
                                  rows, cfg.query_ring_capacity, available_ram_bytes(),
                                  packed_linear=env.packed_cpu_linear(),
                                  max_running_requests=server_args.max_running_requests,
                                  replicas=getattr(server_args, "dp_size", None) or 1)
        except MemoryConfigError as e:
            raise UnsupportedFeature(str(e)) from None
        logger.info("sgl_kara memory plan: %s", plan_text(sizes, server_args.max_total_tokens, rows,
                                                          cfg.query_ring_capacity))
    default_threads_bind(server_args)
    return cfg


def check_runtime_supported(scheduler) -> None:
    """Checks that need the built model / pools (run in the scheduler process)."""
    from sgl_kara._sglang import MHATokenToKVPool

    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    if type(pool) is not MHATokenToKVPool:
        raise UnsupportedFeature(
            f"Kara supports standard multi-head/GQA attention KV pools only; this model uses "
            f"{type(pool).__name__} (MLA, hybrid, sliding-window or quantized pools are not supported yet)"
        )
