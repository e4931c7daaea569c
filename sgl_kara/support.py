"""What the Kara runtime supports, checked before a model loads; CPU defaults.

Unsupported SGLang features are refused with a message naming the flag, never ignored.
"""

from __future__ import annotations

from sgl_kara.config import KaraConfig

# (ServerArgs field, predicate "is enabled", CLI flag, why)
_UNSUPPORTED = [
    ("speculative_algorithm", lambda v: v not in (None, "", "NONE"), "--speculative-algorithm",
     "speculative decoding verifies several tokens per step; Kara's positions assume one"),
    ("enable_dp_attention", bool, "--enable-dp-attention", "DP attention is not supported yet"),
    ("dp_size", lambda v: (v or 1) > 1, "--dp-size", "data parallelism is not supported yet"),
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


def prepare_server_args(server_args, cfg: KaraConfig) -> None:
    """Refuse unsupported features; select Kara's radix backend and the normal scheduler."""
    if not cfg.enabled:
        return
    for name, enabled, flag, why in _UNSUPPORTED:
        value = getattr(server_args, name, None)
        if value is not None and enabled(value):
            raise UnsupportedFeature(f"{flag} is not supported with --kara-policy {cfg.policy}: {why}")
    backend = getattr(server_args, "radix_cache_backend", None)
    if backend not in (None, "", "kara"):
        raise UnsupportedFeature(
            f"--radix-cache-backend {backend} is not supported with --kara-policy {cfg.policy}: "
            "Kara needs its own backend ('kara') so compressed KV never enters the tree"
        )
    server_args.radix_cache_backend = "kara"
    # Compression edits rows the overlapped forward would still read: run without overlap.
    server_args.disable_overlap_schedule = True
    if cfg.query_source == "capture":
        # Captured queries are written by a hook that a CUDA graph would freeze.
        server_args.disable_cuda_graph = True


def check_runtime_supported(scheduler) -> None:
    """Checks that need the built model / pools (run in the scheduler process)."""
    from sgl_kara._sglang import MHATokenToKVPool

    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    if type(pool) is not MHATokenToKVPool:
        raise UnsupportedFeature(
            f"Kara supports standard multi-head/GQA attention KV pools only; this model uses "
            f"{type(pool).__name__} (MLA, hybrid, sliding-window or quantized pools are not supported yet)"
        )
